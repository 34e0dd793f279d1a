"""What WanAnimate2 needs to train under ac-core's checkpointing: the ``prepare`` of the ``wan`` adapter.

In the reference pass (``kv_cache_mode="extract"``) each block stores its keys and values in the cache layer it
is given, for the generation pass to attend to. A checkpointed block's recompute in backward runs its forward again
with the same arguments and would store the recomputed keys and values over the forward's: equal values, but
tensors of the recompute's graph, which keeps that graph's saved activations alive until the next reference pass
overwrites them (the plain model keeps none after backward). So the forward's store is kept and the recompute's
dropped. The cache cannot be turned off instead: the generation pass reads nothing else.

diffusers' own gradient checkpointing cannot run this model (it passes ``kv_cache=`` by keyword to a checkpoint
function taking positions only: TypeError), and the model's forward calls it before any block runs, where ac-core
would turn it off when it is switched on after ac-core: the model's forward turns it off instead.

Nothing here imports diffusers: the classes are matched by name.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from ac_core import checkpointed_blocks, is_activation_checkpointed
from ac_core.libraries.checkpointing import FLAG, keep_ours

logger = logging.getLogger("ac_core")

_MODEL = "WanAnimate2Transformer3DModel"
_BLOCK = "WanAnimate2TransformerBlock"

REQUIREMENTS = (
    "WanAnimate2's reference pass stores each block's keys and values once per forward: prepare() makes a "
    "checkpointed block's recompute keep the forward's instead of storing its own",
)


class _StoreOnce:
    """One block call's reference-cache layer: the forward's store goes through, a recompute's is dropped."""

    __slots__ = ("layer", "stored")

    def __init__(self, layer: Any) -> None:
        self.layer = layer
        self.stored = False

    def store(self, key: torch.Tensor, value: torch.Tensor) -> None:
        if not self.stored:
            self.stored = True
            self.layer.store(key, value)

    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layer.get()


def _store_once(block: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
    # Without gradients a checkpointed block runs plain: nothing recomputes. The model passes kv_cache by keyword.
    layer = kwargs.get("kv_cache")
    if layer is None or not (torch.is_grad_enabled() and is_activation_checkpointed(block)):
        return None
    return args, {**kwargs, "kv_cache": _StoreOnce(layer)}


def _library_checkpointing_off(model: nn.Module, args: tuple) -> None:
    if model.__dict__.get(FLAG) is True:
        modes = checkpointed_blocks(model)
        if modes:
            keep_ours(model, model, "", str(next(iter(modes.values()))))


def _hooked(module: nn.Module, hook: Any) -> bool:
    return any(h is hook for h in module._forward_pre_hooks.values())


def prepare(model: nn.Module) -> None:
    """Hook a WanAnimate2 model for training under checkpointing, as the module docstring says; other models,
    and a model prepared already, are left as they are."""
    if type(model).__name__ != _MODEL or _hooked(model, _library_checkpointing_off):
        return
    model.register_forward_pre_hook(_library_checkpointing_off)
    blocks = [m for m in model.modules() if type(m).__name__ == _BLOCK]
    for block in blocks:
        block.register_forward_pre_hook(_store_once, with_kwargs=True)
    logger.info(
        "ac-core: %s's %d blocks keep the reference keys and values their forward stores when recomputed, and "
        "diffusers' gradient checkpointing is turned off at its forward",
        _MODEL,
        len(blocks),
    )
