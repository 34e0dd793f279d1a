"""Checkpointing that something other than ac-core already put on a model."""

from __future__ import annotations

from torch import nn

from .errors import ConflictingCheckpointError


def _composable_checkpointed(module: nn.Module) -> bool:
    try:
        from torch.distributed._composable.contract import _get_registry
    except ImportError:  # builds without torch.distributed
        return False
    return "checkpoint" in (_get_registry(module) or {})


def check_foreign_wrappers(model: nn.Module) -> None:
    """Raise if torch's checkpoint_wrapper or composable checkpoint is on any module of ``model``."""
    for name, module in model.named_modules():
        if hasattr(module, "_checkpoint_wrapped_module"):
            raise ConflictingCheckpointError(
                f"{name or 'the model'} is wrapped by torch's checkpoint_wrapper (CheckpointWrapper), which also "
                "renames every parameter below it. Build the model without checkpoint_wrapper / "
                "apply_activation_checkpointing from torch.distributed, then apply ac-core's instead."
            )
        if _composable_checkpointed(module):
            raise ConflictingCheckpointError(
                f"{name or 'the model'} is checkpointed by torch.distributed._composable.checkpoint, which cannot "
                "be undone in place. Build the model without it, then apply ac-core's checkpointing."
            )
