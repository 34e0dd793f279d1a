"""Checkpointing policies: small frozen configs, one registry that every route asks, one block-mode enum.

A new policy is one config and one :func:`register_policy` call; the verbs do not change.
"""

from __future__ import annotations

from .fixed import BlockSkip, Full, Ops, retained_ops
from .modes import BlockDecision, BlockMode, CheckpointType, resolve_checkpointing_type
from .registry import (
    BlockSelection,
    GraphDecisions,
    GraphRequest,
    PolicyConfig,
    PolicyTraits,
    containers_for,
    graph_decisions,
    graph_route_refusal,
    policy_config,
    policy_traits,
    register_policy,
    registered_policies,
    select,
    unregister_policy,
)

__all__ = [
    "BlockDecision",
    "BlockMode",
    "BlockSelection",
    "BlockSkip",
    "CheckpointType",
    "Full",
    "GraphDecisions",
    "GraphRequest",
    "Ops",
    "PolicyConfig",
    "PolicyTraits",
    "containers_for",
    "graph_decisions",
    "graph_route_refusal",
    "policy_config",
    "policy_traits",
    "register_policy",
    "registered_policies",
    "resolve_checkpointing_type",
    "retained_ops",
    "select",
    "unregister_policy",
]
