"""ac-core: activation checkpointing for video diffusion transformers and LLMs, per block and per op.

``import ac_core`` imports torch and nothing of diffusers, transformers or any adapter.
"""

from __future__ import annotations

from .checkpointing import (
    apply_activation_checkpointing,
    checkpointed_blocks,
    is_activation_checkpointed,
    remove_activation_checkpointing,
)
from .errors import AdapterError, ConflictingCheckpointError, UnsupportedVersionError
from .graph import DEFAULT_SAC_SAVE_OPS, apply_sac_pass, compile, sac_aot_eager, sac_inductor_options, sac_partition
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
    "ModelCase",
    "ModelSpec",
    "UnsupportedVersionError",
    "apply_activation_checkpointing",
    "apply_sac_pass",
    "checkpointed_blocks",
    "compile",
    "get_adapter",
    "is_activation_checkpointed",
    "register_adapter",
    "registered_adapters",
    "remove_activation_checkpointing",
    "resolve_checkpointing_type",
    "sac_aot_eager",
    "sac_inductor_options",
    "sac_partition",
    "unregister_adapter",
]
