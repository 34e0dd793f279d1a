"""ac-core: activation checkpointing for video diffusion transformers and LLMs, per block and per op.

``import ac_core`` imports torch and nothing of diffusers, transformers or any adapter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .blocks import Block, Container, ExcludedModules, ModelBlocks, model_blocks, modules_at, resolve_blocks
from .checkpointing import (
    apply_activation_checkpointing,
    checkpointed_blocks,
    is_activation_checkpointed,
    remove_activation_checkpointing,
)
from .errors import AdapterError, ConflictingCheckpointError, UnsupportedVersionError
from .graph import DEFAULT_SAC_SAVE_OPS, GraphRoute, apply_sac_pass, compile, prepare_graph_route
from .offload import (
    Kept,
    OffloadConfig,
    OffloadSession,
    OffloadStats,
    OffloadTransport,
    activation_offload_context,
    apply_activation_offload,
    last_offload_stats,
    no_offload,
    offload_activations,
    remove_activation_offload,
    use_offload_transport,
)
from .op_names import op_matches
from .ops import DEFAULT_RETAINED_OPS, RetainedOutput, RetentionLog, observe_retention
from .policies import (
    BlockDecision,
    BlockMode,
    BlockSelection,
    BlockSkip,
    CheckpointType,
    Full,
    GraphDecisions,
    GraphRequest,
    Ops,
    PolicyConfig,
    PolicyTraits,
    graph_decisions,
    graph_route_refusal,
    policy_config,
    policy_traits,
    register_policy,
    registered_policies,
    resolve_checkpointing_type,
    select,
)
from .refs import is_ref, load_ref
from .registry import (
    ENTRY_POINT_GROUP,
    get_adapter,
    register_adapter,
    registered_adapters,
)
from .spec import AdapterSpec, AttentionBackend, ContextParallel, ExcludedContainer, ModelCase, ModelSpec
from .warnings import reset_warnings

__version__ = "0.1.0"

if TYPE_CHECKING:
    from .budget import Budget, CheckpointPlan, StepBudget, plan_activation_checkpointing, predict_step, profile_step

# The memory-budget policy profiles with the measurement tools: imported (and registered) on first use.
_LAZY = {
    "Budget": "budget",
    "CheckpointPlan": "budget",
    "plan_activation_checkpointing": "budget",
    "predict_step": "budget",
    "profile_step": "budget",
    "StepBudget": "budget",
}


# Old public names, still served with a DeprecationWarning naming the new one.
_RENAMED = {"BlockPlan": "ModelBlocks"}
# Old wrappers of the graph pass, now spelled through GraphRoute.
_GRAPH_WRAPPERS = {
    "sac_aot_eager": "ac_core.GraphRoute(retain, blocks, outside_modules).aot_eager()",
    "sac_inductor_options": "ac_core.GraphRoute(retain, blocks, outside_modules).inductor_options(options)",
    "sac_partition": "ac_core.GraphRoute(...).partition_fn()",
}


# Public names that only tests used, moved off the root: still served from their module, with a DeprecationWarning.
_MOVED = {"unregister_adapter": "ac_core.registry", "unregister_policy": "ac_core.policies"}


def __getattr__(name: str) -> object:
    if name in _MOVED:
        import importlib

        from ._deprecated import old_attribute

        home = _MOVED[name]
        return old_attribute(__name__, name, f"{home}.{name}", getattr(importlib.import_module(home), name))
    if name in _RENAMED:
        from ._deprecated import old_attribute

        return old_attribute(__name__, name, f"ac_core.{_RENAMED[name]}", globals()[_RENAMED[name]])
    if name in _GRAPH_WRAPPERS:
        from ._deprecated import old_attribute
        from .graph import wrappers

        return old_attribute(__name__, name, _GRAPH_WRAPPERS[name], getattr(wrappers, name))
    if name not in _LAZY:
        raise AttributeError(f"module 'ac_core' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


__all__ = [  # noqa: RUF022  # the lazy names first
    "Budget",
    "CheckpointPlan",
    "StepBudget",
    "plan_activation_checkpointing",
    "predict_step",
    "profile_step",
    "DEFAULT_RETAINED_OPS",
    "DEFAULT_SAC_SAVE_OPS",
    "ENTRY_POINT_GROUP",
    "AdapterError",
    "AdapterSpec",
    "AttentionBackend",
    "Block",
    "BlockDecision",
    "BlockMode",
    "BlockSelection",
    "BlockSkip",
    "CheckpointType",
    "ConflictingCheckpointError",
    "Container",
    "ContextParallel",
    "ExcludedContainer",
    "ExcludedModules",
    "Full",
    "GraphDecisions",
    "GraphRequest",
    "GraphRoute",
    "Kept",
    "ModelBlocks",
    "ModelCase",
    "ModelSpec",
    "OffloadConfig",
    "OffloadSession",
    "OffloadStats",
    "OffloadTransport",
    "Ops",
    "PolicyConfig",
    "PolicyTraits",
    "RetainedOutput",
    "RetentionLog",
    "UnsupportedVersionError",
    "activation_offload_context",
    "apply_activation_checkpointing",
    "apply_activation_offload",
    "apply_sac_pass",
    "checkpointed_blocks",
    "compile",
    "get_adapter",
    "graph_decisions",
    "graph_route_refusal",
    "is_activation_checkpointed",
    "is_ref",
    "last_offload_stats",
    "load_ref",
    "model_blocks",
    "modules_at",
    "no_offload",
    "observe_retention",
    "offload_activations",
    "op_matches",
    "policy_config",
    "policy_traits",
    "prepare_graph_route",
    "register_adapter",
    "register_policy",
    "registered_adapters",
    "registered_policies",
    "remove_activation_checkpointing",
    "remove_activation_offload",
    "reset_warnings",
    "resolve_blocks",
    "resolve_checkpointing_type",
    "select",
    "use_offload_transport",
]
