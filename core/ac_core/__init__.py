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
    "checkpointed_blocks",
    "get_adapter",
    "is_activation_checkpointed",
    "model_blocks",
    "register_adapter",
    "registered_adapters",
    "remove_activation_checkpointing",
    "resolve_checkpointing_type",
    "unregister_adapter",
]
