"""ac-core: activation checkpointing for video diffusion transformers and LLMs, per block and per op.

``import ac_core`` imports torch and nothing of diffusers, transformers or any adapter.
"""

from __future__ import annotations

from .blocks import model_blocks
from .checkpointing import (
    apply_activation_checkpointing,
    checkpointed_blocks,
    is_activation_checkpointed,
    remove_activation_checkpointing,
)
from .errors import AdapterError, ConflictingCheckpointError, UnsupportedVersionError
from .graph import DEFAULT_SAC_SAVE_OPS, apply_sac_pass, compile, sac_aot_eager, sac_inductor_options, sac_partition
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
from .ops import DEFAULT_RETAINED_OPS
from .policy import CheckpointType, resolve_checkpointing_type
from .registry import (
    ENTRY_POINT_GROUP,
    get_adapter,
    register_adapter,
    registered_adapters,
    unregister_adapter,
)
from .spec import AdapterSpec, AttentionBackend, ExcludedContainer, ModelCase, ModelSpec

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_RETAINED_OPS",
    "DEFAULT_SAC_SAVE_OPS",
    "ENTRY_POINT_GROUP",
    "AdapterError",
    "AdapterSpec",
    "AttentionBackend",
    "CheckpointType",
    "ConflictingCheckpointError",
    "ExcludedContainer",
    "Kept",
    "ModelCase",
    "ModelSpec",
    "OffloadConfig",
    "OffloadSession",
    "OffloadStats",
    "OffloadTransport",
    "UnsupportedVersionError",
    "activation_offload_context",
    "apply_activation_checkpointing",
    "apply_activation_offload",
    "apply_sac_pass",
    "checkpointed_blocks",
    "compile",
    "get_adapter",
    "is_activation_checkpointed",
    "last_offload_stats",
    "model_blocks",
    "no_offload",
    "offload_activations",
    "register_adapter",
    "registered_adapters",
    "remove_activation_checkpointing",
    "remove_activation_offload",
    "resolve_checkpointing_type",
    "sac_aot_eager",
    "sac_inductor_options",
    "sac_partition",
    "unregister_adapter",
    "use_offload_transport",
]
