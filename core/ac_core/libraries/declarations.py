"""What a model says its repeated blocks are, and the containers holding them.

diffusers models name their block classes in ``_repeated_blocks`` and ``_no_split_modules``; transformers
models in ``_no_split_modules``, and every transformers 5 decoder layer derives from
``GradientCheckpointingLayer``. Classes are read by name, so nothing of either library is imported. The
library route, ``ac-core inspect --draft`` and the coverage check read the declarations from here.
"""

from __future__ import annotations

from torch import nn

from ..containers import CONTAINER_TYPES, inside, module_lists, outermost

LAYER_BASE = "GradientCheckpointingLayer"
"""The base class of transformers 5's decoder layers (``transformers.modeling_layers``)."""

_DECLARING_ATTRIBUTES = ("_no_split_modules", "_repeated_blocks")


def declared_block_classes(model: nn.Module) -> frozenset[str]:
    """The class names ``model`` lists in ``_no_split_modules`` and ``_repeated_blocks``."""
    names: set[str] = set()
    for attr in _DECLARING_ATTRIBUTES:
        value = getattr(model, attr, None) or ()
        names |= {value} if isinstance(value, str) else {str(v) for v in value}
    return frozenset(names)


def _is_layer_base(cls: type) -> bool:
    return cls.__name__ == LAYER_BASE and cls.__module__.startswith("transformers.")


def is_declared_block(module: nn.Module, declared: frozenset[str]) -> bool:
    """Whether ``module`` is of a class in ``declared`` (or derives from one), or is a transformers decoder layer."""
    return any(c.__name__ in declared or _is_layer_base(c) for c in type(module).__mro__)


def _holds_declared_block(child: nn.Module, declared: frozenset[str]) -> bool:
    """Whether a container's ``child`` is a declared block, or a wrapper of one: a module with no parameters of
    its own whose only child is one (HiDream-Image lists ``HiDreamBlock(block)``, the declared class inside)."""
    if is_declared_block(child, declared):
        return True
    inner = list(child.children())
    return (
        len(inner) == 1
        and not any(True for _ in child.parameters(recurse=False))
        and (is_declared_block(inner[0], declared))
    )


def declared_containers(model: nn.Module, declared: frozenset[str]) -> list[str]:
    """FQNs of the containers (ModuleList, ModuleDict, Sequential) holding blocks of a ``declared`` class or
    decoder layers (or wrappers of them), outermost only."""
    return outermost(
        path
        for path in module_lists(model)
        if any(_holds_declared_block(child, declared) for child in model.get_submodule(path).children())
    )


def one_off_modules(model: nn.Module, declared: frozenset[str], containers: list[str]) -> list[tuple[str, str]]:
    """(FQN, class name) of the modules of a declared class outside every container, outermost only: a patch
    embedding, a norm or a token refiner the library keeps whole, not a repeated block."""
    found = [
        (fqn, type(module).__name__)
        for fqn, module in model.named_modules()
        if fqn
        and not isinstance(module, CONTAINER_TYPES)
        and not inside(fqn, containers)
        and is_declared_block(module, declared)
    ]
    kept = set(outermost(fqn for fqn, _ in found))
    return [(fqn, name) for fqn, name in found if fqn in kept]
