"""Check 1: every declared block is checkpointed, and no container of blocks is silently missed."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ac_core import AdapterError, CheckpointType, apply_activation_checkpointing, checkpointed_blocks
from ac_core._containers import resolve_containers, resolve_path

from ..probes import attribute_ops, is_attention_like
from ..subjects import Subject
from ..training import build

# Decoder layers of transformers 5 derive from this class; its name is enough, nothing is imported.
_TRANSFORMERS_LAYER_BASE = "GradientCheckpointingLayer"


@dataclass(frozen=True)
class CoverageReport:
    """What the coverage check saw: checkpointed block FQNs by policy, and the block classes it looked for."""

    checkpointed: dict[str, CheckpointType]
    block_classes: frozenset[str]


def _inside(fqn: str, prefixes: set[str]) -> bool:
    return any(fqn == p or fqn.startswith(p + ".") for p in prefixes)


def block_classes(model: nn.Module, subject: Subject, declared_blocks: list[nn.Module]) -> frozenset[str]:
    """Class names that mark a module as one of this model's blocks.

    The classes in its declared containers, those in its ``attention_calls``, and the model's own
    statement of its repeated blocks: diffusers' and transformers' ``_no_split_modules``, diffusers'
    ``_repeated_blocks``, and transformers' decoder-layer base class.
    """
    names = {type(block).__name__ for block in declared_blocks} | set(subject.model.attention_calls)
    for attr in ("_no_split_modules", "_repeated_blocks"):
        value = getattr(model, attr, None) or ()
        names |= {value} if isinstance(value, str) else {str(v) for v in value}
    names.add(_TRANSFORMERS_LAYER_BASE)
    return frozenset(names)


def _is_block(module: nn.Module, classes: frozenset[str]) -> str | None:
    return next((cls.__name__ for cls in type(module).__mro__ if cls.__name__ in classes), None)


def _other_containers(model: nn.Module, known: set[str]) -> dict[str, nn.Module]:
    """ModuleLists/Sequentials outside the declared and excluded containers and their blocks."""
    return {
        fqn: module
        for fqn, module in model.named_modules()
        if fqn and isinstance(module, (nn.ModuleList, nn.Sequential)) and not _inside(fqn, known)
    }


def check_coverage(subject: Subject, policy: str, *, n_layer: int = 2) -> CoverageReport:
    """Fail unless exactly the declared blocks are checkpointed and every container of blocks is declared.

    ``full``/``ops`` checkpoint every block of every declared container, ``block_skip`` exactly
    indices 0, n, 2n, ... of each; nothing else is checkpointed, excluded containers included.
    A ModuleList holding the model's block classes, or whose elements run attention outside the
    declared blocks, must be declared (or declared excluded): an upstream rename or a new
    container fails here, by name.
    """
    kind = CheckpointType(policy)
    case = build(subject)
    model = case.model
    owner = f"adapter {subject.adapter.name!r}"
    problems: list[str] = []

    try:
        containers = resolve_containers(model, subject.model.containers, owner)
    except AdapterError as exc:
        raise AssertionError(f"{subject.id}: a declared container is missing (renamed upstream?): {exc}") from None
    for path in subject.model.containers:
        if not any(blocks for fqn, blocks in containers if fqn == path or _matches_pattern(fqn, path)):
            problems.append(f"declared container {path!r} has no block in the tiny model, so nothing checks it")

    excluded: dict[str, list[tuple[str, nn.Module]]] = {}
    for entry in subject.model.excluded:
        resolved = resolve_path(model, entry.path)
        if resolved is None:
            problems.append(f"excluded container {entry.path!r} does not exist in {type(model).__name__} (renamed?)")
            continue
        for fqn, container in resolved:
            excluded[fqn] = [(f"{fqn}.{name}", child) for name, child in container.named_children()]

    apply_activation_checkpointing(model, kind, n_layer, adapter=subject.adapter)
    got = checkpointed_blocks(model)
    block_kind = CheckpointType.FULL if kind is CheckpointType.BLOCK_SKIP else kind
    expected = {
        fqn: block_kind
        for _, blocks in containers
        for index, (fqn, _) in enumerate(blocks)
        if kind is not CheckpointType.BLOCK_SKIP or index % n_layer == 0
    }
    if got != expected:
        missing = sorted(expected.keys() - got.keys())
        extra = sorted(got.keys() - expected.keys())
        wrong = sorted(f for f in expected.keys() & got.keys() if got[f] is not expected[f])
        problems.append(
            f"{policy} (n_layer={n_layer}) checkpointed the wrong blocks: missing {missing}, unexpected {extra}, "
            f"wrong policy on {wrong}"
        )

    declared_blocks = [block for _, blocks in containers for _, block in blocks]
    classes = block_classes(model, subject, declared_blocks)
    known = {fqn for fqn, _ in containers} | set(excluded)
    others = _other_containers(model, known)
    # Static: a container whose elements are block classes.
    reported: set[str] = set()
    for fqn, container in others.items():
        for name, child in container.named_children():
            cls = _is_block(child, classes)
            if cls is not None:
                problems.append(
                    f"{fqn!r} holds blocks ({cls} at {fqn}.{name}) but is neither a declared container nor declared "
                    "excluded: add it to the ModelSpec's containers, or to excluded with the reason"
                )
                reported.add(fqn)
                break
    # Dynamic: a container whose elements run attention outside the declared blocks.
    hooked: dict[str, nn.Module] = {fqn: block for _, blocks in containers for fqn, block in blocks}
    for blocks in excluded.values():
        hooked.update(blocks)
    element_of: dict[str, str] = {}
    for fqn, container in others.items():
        for name, child in container.named_children():
            hooked[f"{fqn}.{name}"] = child
            element_of[f"{fqn}.{name}"] = fqn
    fresh = build(subject)
    fresh_modules = dict(fresh.model.named_modules())
    with torch.no_grad(), attribute_ops({f: fresh_modules[f] for f in hooked}, is_attention_like) as counts:
        fresh.run()
    flagged = sorted({element_of[f] for f, n in counts.items() if f in element_of and n})
    for fqn in flagged:
        if fqn not in reported:
            problems.append(
                f"{fqn!r} runs attention in its elements outside the declared blocks but is neither a declared "
                "container nor declared excluded"
            )

    if problems:
        raise AssertionError(f"{subject.id} coverage under {policy}:\n  - " + "\n  - ".join(problems))
    return CoverageReport(got, classes)


def _matches_pattern(fqn: str, path: str) -> bool:
    parts, pattern = fqn.split("."), path.split(".")
    return len(parts) == len(pattern) and all(p == "*" or p == q for p, q in zip(pattern, parts, strict=True))


__all__ = ["CoverageReport", "block_classes", "check_coverage"]
