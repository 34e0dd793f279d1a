"""Containers of blocks a model's resolved blocks leave out: what an adapter (or ``blocks=``) may have missed.

A block is recognised by its class: the classes of the declared blocks, those of the adapter's
``attention_calls``, and the model's own statement of its repeated blocks (diffusers' and transformers'
``_no_split_modules``, diffusers' ``_repeated_blocks``, transformers' decoder-layer base class).
Checkpointing warns at apply time and the conformance suite fails on what this finds.
"""

from __future__ import annotations

from .blocks import ModelBlocks
from .containers import CONTAINER_TYPES, inside
from .libraries.declarations import LAYER_BASE, declared_block_classes


def block_classes(resolved: ModelBlocks) -> frozenset[str]:
    """Class names that mark a module of ``resolved.model`` as one of its blocks."""
    names = {block.class_name for block in resolved}
    if resolved.model_spec is not None:
        names |= set(resolved.model_spec.attention_calls)
    for module in (resolved.model, resolved.served_model):
        names |= declared_block_classes(module)
    names.add(LAYER_BASE)
    return frozenset(names)


def undeclared_containers(resolved: ModelBlocks) -> dict[str, str]:
    """FQN -> "ClassName at fqn.i" of each ModuleList (ModuleDict, Sequential) holding blocks that ``resolved`` neither
    checkpoints nor declares excluded."""
    classes = block_classes(resolved)
    known = {c.path for c in resolved.containers} | {fqn for e in resolved.excluded for fqn, _ in e.modules}
    found: dict[str, str] = {}
    for fqn, module in resolved.model.named_modules():
        if not fqn or not isinstance(module, CONTAINER_TYPES) or inside(fqn, known):
            continue
        for name, child in module.named_children():
            cls = next((c.__name__ for c in type(child).__mro__ if c.__name__ in classes), None)
            if cls is not None:
                found[fqn] = f"{cls} at {fqn}.{name}"
                break
    return found
