"""Checkpointing that something other than ac-core already put on a model."""

from __future__ import annotations

import logging

from torch import nn

from .errors import ConflictingCheckpointError

logger = logging.getLogger("ac_core")


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


def library_checkpointing(model: nn.Module) -> list[str]:
    """FQNs of modules on which the model library's own gradient checkpointing is on."""
    return [name for name, m in model.named_modules() if getattr(m, "gradient_checkpointing", False) is True]


def _library_name(model: nn.Module) -> str:
    top = type(model).__module__.split(".")[0]
    return {"diffusers": "diffusers", "transformers": "transformers"}.get(top, "the model's own")


def disable_library_checkpointing(model: nn.Module, level: int = logging.WARNING) -> None:
    """Turn off diffusers'/transformers' gradient checkpointing on ``model``, and say so at ``level``."""
    modules = library_checkpointing(model)
    if not modules:
        return
    library = _library_name(model)
    if callable(getattr(model, "disable_gradient_checkpointing", None)):  # diffusers ModelMixin
        model.disable_gradient_checkpointing()
        how = "model.disable_gradient_checkpointing()"
    elif callable(getattr(model, "activation_checkpointing_disable", None)):  # transformers >= 5.x
        model.activation_checkpointing_disable()
        how = "model.activation_checkpointing_disable()"
    elif callable(getattr(model, "gradient_checkpointing_disable", None)):  # transformers before it (deprecated)
        model.gradient_checkpointing_disable()
        how = "model.gradient_checkpointing_disable()"
    else:
        how = "setting gradient_checkpointing = False on those modules"
    for m in model.modules():
        if getattr(m, "gradient_checkpointing", False) is True:
            m.gradient_checkpointing = False
    logger.log(
        level,
        "ac-core: %s gradient checkpointing was on for %s (%d modules, e.g. %r); turned it off with %s so that "
        "blocks are not checkpointed twice. Call that yourself before applying ac-core to avoid this message.",
        library,
        type(model).__name__,
        len(modules),
        modules[0] or type(model).__name__,
        how,
    )
