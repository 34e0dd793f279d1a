"""Policy names as FastVideo spells them (``CheckpointType``), and which one a training role asks for."""

from __future__ import annotations

from enum import Enum
from typing import Any


class CheckpointType(str, Enum):
    """Activation checkpointing policies.

    ``FULL`` recomputes every block; ``OPS`` keeps the outputs of the retained ops (attention)
    and recomputes the rest of each block; ``BLOCK_SKIP`` fully checkpoints every n-th block.
    """

    FULL = "full"
    OPS = "ops"
    BLOCK_SKIP = "block_skip"

    def __str__(self) -> str:
        return self.value


def resolve_checkpointing_type(checkpointing_type: str | None, training_config: Any) -> str | None:
    """Return a role's own checkpointing type, else ``training_config.model.enable_gradient_checkpointing_type``.

    Returns None when neither is set, so that a trainer can skip checkpointing for that role.
    """
    if checkpointing_type:
        return checkpointing_type
    model_config = getattr(training_config, "model", None)
    return getattr(model_config, "enable_gradient_checkpointing_type", None)
