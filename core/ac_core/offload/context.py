"""Offloading a region of code: the seed-compatible context and the configurable one."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ._session import OffloadSession, alive_storages
from ._transport import can_offload
from .config import OffloadConfig


def offload_activations(
    config: OffloadConfig,
    token_count: int | None = None,
    *,
    model: nn.Module | None = None,
    inputs: Iterable[Any] = (),
) -> OffloadSession | contextlib.nullcontext:
    """A context that offloads the activations saved for backward inside it, as ``config`` says.

    Active when ``config.min_tokens > 0``, grad mode is on, and ``token_count`` (the forward's tokens)
    reaches ``config.min_tokens``; ``token_count=None`` means the caller has already decided.
    Otherwise, and on a machine without a CUDA device (said once, at debug level), it is a null context.
    ``model`` and ``inputs`` name tensors that outlive the forward anyway (buffers, the batch), which
    then stay put. The active context is an :class:`OffloadSession`; its ``stats`` say what moved.
    Works in eager code: inside a region torch.compile traces, pass the compiled callable's call here instead.
    """
    if not isinstance(config, OffloadConfig):
        raise TypeError(f"offload_activations takes an OffloadConfig, got {type(config).__name__}")
    if not config.enabled or not torch.is_grad_enabled():
        return contextlib.nullcontext()
    if token_count is not None and not config.applies_to(token_count):
        return contextlib.nullcontext()
    if not can_offload():
        return contextlib.nullcontext()
    return OffloadSession(config, alive_storages(model, inputs))


def activation_offload_context(token_count: int, min_tokens: int) -> OffloadSession | contextlib.nullcontext:
    """Offload the activations saved inside this context when ``token_count >= min_tokens`` and grad is on.

    ``min_tokens < 0`` raises ValueError; ``0`` turns offload off. Unlike a synchronous
    ``save_on_cpu``, copies overlap compute (see :class:`OffloadConfig` for the defaults it uses).
    """
    if isinstance(min_tokens, int) and not isinstance(min_tokens, bool) and min_tokens < 0:
        raise ValueError(f"activation offload needs min_tokens >= 0 (0 turns it off), got {min_tokens}")
    return offload_activations(OffloadConfig(min_tokens=min_tokens), token_count)
