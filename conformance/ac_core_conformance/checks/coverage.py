"""Check 1: every declared block is checkpointed, and no container of blocks is silently missed."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ac_core import AdapterError, PolicyConfig, apply_activation_checkpointing, checkpointed_blocks
from ac_core.coverage import block_classes, undeclared_containers
from ac_core.measure import attribute_ops
from ac_core.ops import is_attention_like
from ac_core.policies import BlockMode, select

from ..base import AdapterTests
from ..policies import Policy, as_policy, label
from ..subjects import Subject
from ..training import build


@dataclass(frozen=True)
class CoverageReport:
    """What the coverage check saw: checkpointed block FQNs by policy, and the block classes it looked for."""

    checkpointed: dict[str, BlockMode]
    block_classes: frozenset[str]


def _inside(fqn: str, prefixes: set[str]) -> bool:
    return any(fqn == p or fqn.startswith(p + ".") for p in prefixes)


def check_coverage(subject: Subject, policy: Policy) -> CoverageReport:
    """Fail unless exactly the declared blocks are checkpointed and every container of blocks is declared.

    ``policy`` checkpoints exactly the blocks it selects from the declared containers (``full``/``ops``
    every block, ``block_skip`` positions 0, n, 2n, ... of each); nothing else is checkpointed, excluded
    containers included. A ModuleList (ModuleDict, Sequential) holding the model's block classes, or whose
    elements run attention outside the declared blocks, must be declared (or declared excluded): an upstream
    rename or a new container fails here, by name.
    """
    config = as_policy(policy)
    case = build(subject)
    model = case.model
    problems: list[str] = []

    try:
        resolved = subject.blocks(model)
    except AdapterError as exc:
        raise AssertionError(f"{subject.id}: a declared container is missing (renamed upstream?): {exc}") from None
    for path in subject.model.containers:
        if not any(c.blocks for c in resolved.containers if c.path == path or _matches_pattern(c.path, path)):
            problems.append(f"declared container {path!r} has no block in the tiny model, so nothing checks it")

    excluded: dict[str, list[tuple[str, nn.Module]]] = {}
    for entry in resolved.excluded:
        if not entry.found:
            problems.append(f"excluded container {entry.path!r} does not exist in {type(model).__name__} (renamed?)")
        for fqn, container in entry.modules:
            excluded[fqn] = [(f"{fqn}.{name}", child) for name, child in container.named_children()]

    apply_activation_checkpointing(model, config, adapter=subject.adapter)
    got = checkpointed_blocks(model)
    expected = {choice.block.path: choice.kind for choice in select(config, resolved)}
    if got != expected:
        missing = sorted(expected.keys() - got.keys())
        extra = sorted(got.keys() - expected.keys())
        wrong = sorted(f for f in expected.keys() & got.keys() if got[f] is not expected[f])
        problems.append(
            f"{label(config)} checkpointed the wrong blocks: missing {missing}, unexpected {extra}, "
            f"wrong policy on {wrong}"
        )

    classes = block_classes(resolved)
    known = {c.path for c in resolved.containers} | set(excluded)
    others = {
        fqn: module
        for fqn, module in model.named_modules()
        if fqn and isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Sequential)) and not _inside(fqn, known)
    }
    # Static: a container whose elements are block classes.
    undeclared = undeclared_containers(resolved)
    for fqn, where in undeclared.items():
        problems.append(
            f"{fqn!r} holds blocks ({where}) but is neither a declared container nor declared excluded: add it to "
            "the ModelSpec's containers, or to excluded with the reason"
        )
    reported = set(undeclared)
    # Dynamic: a container whose elements run attention outside the declared blocks.
    hooked: dict[str, nn.Module] = {block.path: block.module for block in resolved}
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
        raise AssertionError(f"{subject.id} coverage under {label(config)}:\n  - " + "\n  - ".join(problems))
    return CoverageReport(got, classes)


def _matches_pattern(fqn: str, path: str) -> bool:
    parts, pattern = fqn.split("."), path.split(".")
    return len(parts) == len(pattern) and all(p == "*" or p == q for p, q in zip(pattern, parts, strict=True))


class CoverageTests(AdapterTests):
    """Check 1: exactly the declared blocks are checkpointed; no container of blocks goes unnoticed."""

    def test_coverage(self, subject: Subject, policy: PolicyConfig) -> None:
        check_coverage(subject, policy)


__all__ = ["CoverageReport", "CoverageTests", "check_coverage"]
