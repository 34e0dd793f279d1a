"""The policies the checks run under: ac-core's registered policy configs, none named here."""

from __future__ import annotations

import dataclasses

from ac_core import Ops, PolicyConfig, registered_policies

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


def recomputes_attention(policy: PolicyConfig) -> bool:
    """Whether backward reruns the attention of the blocks ``policy`` checkpoints: every policy but ``Ops``."""
    return not isinstance(policy, Ops)


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


__all__ = ["Policy", "as_policy", "default_policies", "label", "recomputes_attention"]
