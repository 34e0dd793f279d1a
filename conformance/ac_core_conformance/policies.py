"""The policies the checks run under: ac-core's registered policy configs, none named here."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from ac_core import BlockSelection, ModelBlocks, PolicyConfig, op_matches, registered_policies, select

Policy = PolicyConfig | str
"""A policy as the checks accept it: a config, or a registered name (its config at its defaults)."""


def default_policies() -> tuple[PolicyConfig, ...]:
    """Every registered policy at its config's defaults: ``Full()``, ``Ops()``, ``BlockSkip(every=2)``, then others."""
    return tuple(config_type() for config_type in registered_policies().values())


def as_policy(policy: Policy) -> PolicyConfig:
    """``policy`` as a config: a config as is, a registered name as its config at its defaults."""
    if isinstance(policy, PolicyConfig):
        return policy
    types = registered_policies()
    if policy not in types:
        raise ValueError(f"no policy named {policy!r}; registered policies are {sorted(types)}")
    return types[policy]()


def selections(policy: PolicyConfig, blocks: ModelBlocks) -> dict[str, BlockSelection]:
    """The blocks ``policy`` checkpoints among ``blocks``, by path, as ac-core's policy registry selects them."""
    return {selection.block.path: selection for selection in select(policy, blocks)}


def reruns(selection: BlockSelection, op: str) -> bool:
    """Whether backward reruns dispatcher op ``op`` (as it ran, ``"aten::mm.default"``) of the block ``selection``
    checkpoints: every op of a ``full`` block, those an ``ops`` block does not keep. (A block no selection names is
    not checkpointed: backward reruns none of its ops.)"""
    return selection.kind.value == "full" or not op_matches(op, selection.retained)


def kept_ops(chosen: Iterable[BlockSelection]) -> frozenset[str]:
    """The op names the ``ops`` blocks among ``chosen`` keep (empty where every block is recomputed whole)."""
    return frozenset(op for s in chosen if s.kind.value == "ops" for op in s.retained)


def _is_set(value: object, default: object) -> bool:
    return value is not default if isinstance(value, bool) else bool(value)


def label(policy: PolicyConfig) -> str:
    """``full``, ``block_skip(every=2)``, ``full(preserve_rng_state=False)``: the name with the fields that are set
    (a switch where it is off its default), for messages."""
    fields = ", ".join(
        f"{field.name}={getattr(policy, field.name)!r}"
        for field in dataclasses.fields(policy)  # type: ignore[arg-type]  # configs are dataclasses
        if _is_set(getattr(policy, field.name), field.default)
    )
    return f"{policy.name}({fields})" if fields else policy.name


__all__ = ["Policy", "as_policy", "default_policies", "kept_ops", "label", "reruns", "selections"]
