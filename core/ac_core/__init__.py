"""ac-core: activation checkpointing for video diffusion transformers and LLMs, per block and per op.

``import ac_core`` imports torch and nothing of diffusers, transformers or any adapter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .checkpointing import (
    apply_activation_checkpointing,
    checkpointed_blocks,
    is_activation_checkpointed,
    remove_activation_checkpointing,
)
from .errors import AdapterError, ConflictingCheckpointError, UnsupportedVersionError
from .graph import (
    DEFAULT_SAC_SAVE_OPS,
    GraphRoute,
    apply_sac_pass,
    compile,
    prepare_graph_route,
    sac_aot_eager,
    sac_inductor_options,
    sac_partition,
)
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
from .ops import DEFAULT_RETAINED_OPS, RetainedOutput, RetentionLog, observe_retention, op_matches
from .plan import Block, BlockPlan, Container, ExcludedModules, model_blocks, modules_at, resolve_blocks
from .policies import (
    BlockSelection,
    BlockSkip,
    Full,
    Ops,
    PolicyConfig,
    policy_config,
    register_policy,
    registered_policies,
    select,
)
from .policy import CheckpointType, resolve_checkpointing_type
from .refs import is_ref, load_ref
from .registry import (
    ENTRY_POINT_GROUP,
    get_adapter,
    register_adapter,
    registered_adapters,
    unregister_adapter,
)
from .spec import AdapterSpec, AttentionBackend, ExcludedContainer, ModelCase, ModelSpec
from .warnings import reset_warnings

__version__ = "0.1.0"

if TYPE_CHECKING:
    from .budget import Budget, CheckpointPlan, plan_activation_checkpointing, profile_step

# The memory-budget policy profiles with the measurement tools: imported (and registered) on first use.
_LAZY = {
    "Budget": "budget",
    "CheckpointPlan": "budget",
    "plan_activation_checkpointing": "budget",
    "profile_step": "budget",
}


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module 'ac_core' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


__all__ = [  # noqa: RUF022  # the lazy names first
    "Budget",
    "CheckpointPlan",
    "plan_activation_checkpointing",
    "profile_step",
    "DEFAULT_RETAINED_OPS",
    "DEFAULT_SAC_SAVE_OPS",
    "ENTRY_POINT_GROUP",
    "AdapterError",
    "AdapterSpec",
    "AttentionBackend",
    "Block",
    "BlockPlan",
    "BlockSelection",
    "BlockSkip",
    "CheckpointType",
    "ConflictingCheckpointError",
    "Container",
    "ExcludedContainer",
    "ExcludedModules",
    "Full",
    "GraphRoute",
    "Kept",
    "ModelCase",
    "ModelSpec",
    "OffloadConfig",
    "OffloadSession",
    "OffloadStats",
    "OffloadTransport",
    "Ops",
    "PolicyConfig",
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
    "sac_aot_eager",
    "sac_inductor_options",
    "sac_partition",
    "select",
    "unregister_adapter",
    "use_offload_transport",
]
