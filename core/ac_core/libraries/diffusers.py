"""diffusers' attention dispatcher, as adapters of diffusers models declare it: backends, their ops, switching.

Read from diffusers 0.42 (``diffusers/models/attention_dispatch.py``, ``AttentionBackendName``). Every
name of that enum is either a trainable backend in :data:`BACKENDS` or listed in :data:`INFERENCE_ONLY`
with the reason, so a backend diffusers adds later is noticed (a test compares the two with the
installed enum). Nothing here imports diffusers.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from ..ops import DEFAULT_RETAINED_OPS
from ..spec import AttentionBackend

_HUB_OPS_UNNAMED = (
    "the kernel is downloaded from the Hugging Face Hub by the `kernels` package, whose builds register their ops "
    "under a namespace carrying the build hash (e.g. `_flash_attn2_<hash>::fwd`), so no fixed name can be declared; "
    "name your build's op with apply_activation_checkpointing(..., retain_ops={...})"
)

BACKENDS: tuple[AttentionBackend, ...] = (
    # torch's SDPA picks flash, efficient or cuDNN on CUDA and its CPU flash kernel on CPU; when it falls
    # back to the math kernel nothing is retained and ac-core says so once.
    AttentionBackend("native", ops=tuple(sorted(DEFAULT_RETAINED_OPS)), devices=("cpu", "cuda")),
    AttentionBackend(
        "_native_flash",
        ops=("aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_flash_attention_for_cpu"),
        devices=("cpu", "cuda"),
    ),
    # On CPU torch has no efficient or cuDNN kernel: SDPA raises "No viable backend" (checked on torch 2.13).
    AttentionBackend("_native_efficient", ops=("aten::_scaled_dot_product_efficient_attention",), devices=("cuda",)),
    AttentionBackend("_native_cudnn", ops=("aten::_scaled_dot_product_cudnn_attention",), devices=("cuda",)),
    AttentionBackend(
        "_native_math",
        not_retainable="SDPA's math kernel decomposes into bmm, softmax and bmm before a policy sees it: "
        "no single op carries the attention output",
        devices=("cpu", "cuda"),
    ),
    # flash-attn >= 2.7 runs its kernels through the torch custom ops flash_attn::_flash_attn_forward and
    # flash_attn::_flash_attn_varlen_forward (flash_attn_interface.py); 2.6.x calls the C extension directly,
    # so nothing is retained there and ac-core warns once.
    AttentionBackend("flash", ops=("flash_attn::_flash_attn_forward",), devices=("cuda",), requires=("flash_attn",)),
    AttentionBackend(
        "flash_varlen", ops=("flash_attn::_flash_attn_varlen_forward",), devices=("cuda",), requires=("flash_attn",)
    ),
    # FlashAttention-3 (hopper/flash_attn_interface.py) registers flash_attn_3::_flash_attn_forward for
    # fixed and variable lengths; builds from before its rename (Aug 2025) used flash_attn::_flash_attn_forward.
    AttentionBackend(
        "_flash_varlen_3",
        ops=("flash_attn_3::_flash_attn_forward", "flash_attn::_flash_attn_forward"),
        devices=("cuda",),
        requires=("flash_attn_interface", "flash_attn_3"),
    ),
    # diffusers calls flex_attention uncompiled; torch routes the flex_attention higher-order op to the
    # selective-checkpoint modes, whose policy sees it as "flex_attention". flex has no backward on CPU.
    AttentionBackend("flex", ops=("flex_attention",), devices=("cuda",)),
    # xformers picks its kernel per input: its flash custom ops, or CUTLASS through aten's
    # _efficient_attention_forward (xformers 0.0.29-0.0.35 and mslk sources). Its Blackwell and CK kernels are
    # not named here.
    AttentionBackend(
        "xformers",
        ops=("xformers_flash::flash_fwd", "xformers_flash3::flash_fwd", "aten::_efficient_attention_forward"),
        devices=("cuda",),
        requires=("xformers",),
    ),
    # Not verified here (no torch_npu): torch_npu exposes npu_fusion_attention as the dispatcher op below.
    AttentionBackend("_native_npu", ops=("npu::npu_fusion_attention",), devices=("npu",), requires=("torch_npu",)),
    AttentionBackend(
        "_native_xla",
        not_retainable="torch_xla's Pallas flash attention is traced lazily into an XLA custom call, which "
        "torch's selective-checkpoint policy never sees (not verified here: no torch_xla)",
        devices=("xla",),
        requires=("torch_xla",),
    ),
    AttentionBackend("flash_hub", not_retainable=_HUB_OPS_UNNAMED, devices=("cuda",), requires=("kernels",)),
    AttentionBackend("flash_varlen_hub", not_retainable=_HUB_OPS_UNNAMED, devices=("cuda",), requires=("kernels",)),
    AttentionBackend("_flash_3_hub", not_retainable=_HUB_OPS_UNNAMED, devices=("cuda",), requires=("kernels",)),
    AttentionBackend("_flash_3_varlen_hub", not_retainable=_HUB_OPS_UNNAMED, devices=("cuda",), requires=("kernels",)),
    AttentionBackend("flash_4_hub", not_retainable=_HUB_OPS_UNNAMED, devices=("cuda",), requires=("kernels",)),
    AttentionBackend("aiter_fa2_hub", not_retainable=_HUB_OPS_UNNAMED, devices=("cuda",), requires=("kernels",)),
)
"""The dispatcher backends a diffusers model can train with, and which ops carry their attention output."""

_SAGE_NO_BACKWARD = (
    "sageattention has no backward: its kernels are custom ops writing into a preallocated output with no "
    "autograd formula (SageAttention sources, Jan 2026)"
)

INFERENCE_ONLY: Mapping[str, str] = MappingProxyType(
    {
        # diffusers wraps FA3 in its own custom op without register_autograd; backward through such an op
        # raises "no autograd formula was registered".
        "_flash_3": "diffusers wraps FlashAttention-3 in the custom op _diffusers_flash_attn_3::_flash_attn_forward "
        "with no autograd formula, so backward raises; train with _flash_varlen_3 instead",
        "sage": _SAGE_NO_BACKWARD,
        "sage_hub": _SAGE_NO_BACKWARD,
        "sage_blackwell_hub": _SAGE_NO_BACKWARD,
        "sage_varlen": _SAGE_NO_BACKWARD,
        "_sage_qk_int8_pv_fp8_cuda": _SAGE_NO_BACKWARD,
        "_sage_qk_int8_pv_fp8_cuda_sm90": _SAGE_NO_BACKWARD,
        "_sage_qk_int8_pv_fp16_cuda": _SAGE_NO_BACKWARD,
        "_sage_qk_int8_pv_fp16_triton": _SAGE_NO_BACKWARD,
    }
)
"""Dispatcher backends that cannot train, by name, with the reason; adapters do not declare them."""

# These raise ValueError on any attention mask, so a model that always passes one (HunyuanVideo's
# text padding mask) cannot run them.
_REJECT_MASK = frozenset(
    {"_native_flash", "flash", "flash_hub", "_flash_3_hub", "flash_4_hub", "aiter_fa2_hub", "_native_xla"}
)


def attention_backends(*, attention_mask: bool = False) -> tuple[AttentionBackend, ...]:
    """The trainable dispatcher backends; with ``attention_mask=True`` only those that accept a mask."""
    if not attention_mask:
        return BACKENDS
    return tuple(b for b in BACKENDS if b.name not in _REJECT_MASK)


def _dispatch_registry() -> Any:
    # The model being switched is a diffusers model, so its dispatcher module is already loaded.
    module = sys.modules.get("diffusers.models.attention_dispatch")
    return getattr(module, "_AttentionBackendRegistry", None)


def set_attention_backend(model: nn.Module, name: str) -> None:
    """Switch ``model``'s attention processors to the dispatcher backend ``name``, and only this model's.

    diffusers' ``set_attention_backend`` also makes ``name`` the process-wide default of every processor
    that has no backend of its own, i.e. of every other model built afterwards; that global is restored here.
    """
    setter = getattr(model, "set_attention_backend", None)
    if not callable(setter):
        raise TypeError(
            f"{type(model).__name__} has no set_attention_backend(): it is not a diffusers ModelMixin of a version "
            "with attention backends"
        )
    registry = _dispatch_registry()
    previous = getattr(registry, "_active_backend", None)
    try:
        setter(name)
    finally:
        if previous is not None:
            registry._active_backend = previous


def sample_loss(output: Any) -> torch.Tensor:
    """Mean square of a diffusers model output's ``sample`` (or of its first element): a loss for tests."""
    sample = output.sample if hasattr(output, "sample") else output[0]
    return sample.float().pow(2).mean()


def video_token_grid(seq: int, frame: tuple[int, int] = (30, 52)) -> tuple[int, int, int]:
    """(frames, height, width) in tokens whose product is as close to ``seq`` as whole frames allow.

    Frames are ``frame`` tokens (30x52: a 480x832 video after 8x VAE and 2x2 patches) when ``seq`` holds
    at least one; below that, a single frame of about that aspect. 6240 tokens are 4 frames of 30x52.
    """
    if seq < 1:
        raise ValueError(f"seq must be a positive token count, got {seq}")
    frames = max(1, round(seq / (frame[0] * frame[1])))
    per_frame = seq / frames
    height = max(1, min(frame[0], round(math.sqrt(per_frame * frame[0] / frame[1]))))
    return frames, height, max(1, round(per_frame / height))


def preset_token_grid(
    seq: int | None, grid: tuple[int, int, int] | None, *, default: int = 6240
) -> tuple[int, int, int]:
    """A video preset's (frames, height, width) in tokens: ``grid`` exactly where given, else ``seq`` (``default``
    where None) laid out by :func:`video_token_grid`; ValueError for both, or a grid that is not 3 ints >= 1."""
    if grid is None:
        return video_token_grid(default if seq is None else seq)
    if seq is not None:
        raise ValueError(f"give seq or grid, not both: seq={seq}, grid={grid}")
    if len(grid) != 3 or not all(type(n) is int and n >= 1 for n in grid):
        raise ValueError(f"grid must be (frames, height, width) in tokens, 3 ints >= 1; got {grid!r}")
    return grid[0], grid[1], grid[2]


_NO_OWN_CHECKPOINTING = "diffusers' own gradient checkpointing off (ac-core turns it off and says so)"


def adapter_fields(*, attention_mask: bool = False) -> dict[str, Any]:
    """What every diffusers transformer's adapter declares the same way, as ``AdapterSpec`` keyword arguments: the
    dispatcher's trainable backends (with ``attention_mask=True`` those that take a mask), ``native`` by default,
    how to switch them, and what training needs."""
    attention = (
        "an attention backend that accepts an attention mask and has a backward"
        if attention_mask
        else "an attention backend with a backward: diffusers' sage backends and _flash_3 cannot train"
    )
    return {
        "backends": attention_backends(attention_mask=attention_mask),
        "default_backend": "native",
        "requirements": (attention, _NO_OWN_CHECKPOINTING),
        "set_backend": set_attention_backend,
    }
