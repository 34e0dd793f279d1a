"""The HunyuanVideo adapter's tiny models, real-width preset and token count (named by ``ac_core_adapters.hunyuan``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ac_core import ModelCase
from ac_core.libraries.diffusers import preset_token_grid, sample_loss
from ac_core.testing import make_case

_TINY: dict[str, Any] = {
    "in_channels": 4,
    "out_channels": 4,
    "num_layers": 3,
    "text_embed_dim": 16,
    "num_attention_heads": 2,
    "attention_head_dim": 8,
    "num_refiner_layers": 2,
    "rope_axes_dim": (2, 2, 4),
}


def _text_mask(tokens: int, padded: int) -> torch.Tensor:
    mask = torch.ones(1, tokens, dtype=torch.bool)
    mask[:, tokens - padded :] = False
    return mask


def _video_and_text(latents: tuple[int, ...], timestep: torch.Tensor) -> dict[str, torch.Tensor]:
    # What every tiny variant's forward takes first: its latents, a timestep, 6 text tokens (the last 2 padding).
    return {
        "hidden_states": torch.randn(latents),
        "timestep": timestep,
        "encoder_hidden_states": torch.randn(1, 6, 16),
        "encoder_attention_mask": _text_mask(6, padded=2),
    }


def _tiny_hunyuan_video(image_condition_type: str | None) -> ModelCase:
    from diffusers import HunyuanVideoTransformer3DModel

    return make_case(
        lambda: HunyuanVideoTransformer3DModel(
            num_single_layers=3, pooled_projection_dim=8, image_condition_type=image_condition_type, **_TINY
        ),
        lambda: {
            **_video_and_text((1, 4, 2, 8, 8), torch.tensor([500])),
            "pooled_projections": torch.randn(1, 8),
            "guidance": torch.tensor([3000.0]),
        },
        sample_loss,
    )


def tiny_hunyuan_video() -> ModelCase:
    """HunyuanVideoTransformer3DModel, plain blocks: 3 double-stream, 3 single-stream, 2 refiner blocks; padded text."""
    return _tiny_hunyuan_video(None)


def tiny_hunyuan_video_token_replace() -> ModelCase:
    """The same with ``image_condition_type="token_replace"`` (HunyuanVideo-I2V), whose blocks are TokenReplace ones."""
    return _tiny_hunyuan_video("token_replace")


def tiny_hunyuan_video_15() -> ModelCase:
    """HunyuanVideo15Transformer3DModel: 3 blocks, 2 refiner blocks; image, ByT5 and padded text tokens."""
    from diffusers import HunyuanVideo15Transformer3DModel

    return make_case(
        lambda: HunyuanVideo15Transformer3DModel(patch_size=1, text_embed_2_dim=8, image_embed_dim=8, **_TINY),
        lambda: {
            **_video_and_text((1, 4, 2, 4, 4), torch.tensor([500.0])),
            "encoder_hidden_states_2": torch.randn(1, 3, 8),
            "encoder_attention_mask_2": _text_mask(3, padded=1),
            "image_embeds": torch.randn(1, 2, 8),
        },
        sample_loss,
    )


def tiny_framepack() -> ModelCase:
    """HunyuanVideoFramepackTransformer3DModel: 3 double, 3 single, 2 refiner blocks; clean, 2x and 4x history."""
    from diffusers import HunyuanVideoFramepackTransformer3DModel

    return make_case(
        lambda: HunyuanVideoFramepackTransformer3DModel(
            num_single_layers=3,
            pooled_projection_dim=8,
            has_image_proj=True,
            image_proj_dim=8,
            has_clean_x_embedder=True,
            **_TINY,
        ),
        # The forward needs every history input: it reads their rotary embeddings unconditionally.
        lambda: {
            **_video_and_text((1, 4, 2, 8, 8), torch.tensor([500])),
            "pooled_projections": torch.randn(1, 8),
            "image_embeds": torch.randn(1, 2, 8),
            "indices_latents": torch.tensor([3, 4]),
            "guidance": torch.tensor([3000.0]),
            "latents_clean": torch.randn(1, 4, 1, 8, 8),
            "indices_latents_clean": torch.tensor([0]),
            "latents_history_2x": torch.randn(1, 4, 2, 8, 8),
            "indices_latents_history_2x": torch.tensor([1, 2]),
            "latents_history_4x": torch.randn(1, 4, 4, 8, 8),
            "indices_latents_history_4x": torch.tensor([5, 6, 7, 8]),
        },
        sample_loss,
    )


def preset_hunyuan_video(
    *,
    layers: int = 4,
    seq: int | None = None,
    grid: tuple[int, int, int] | None = None,
    single_layers: int | None = None,
) -> ModelCase:
    """HunyuanVideo: ``layers`` double-stream and ``single_layers`` (default ``layers``) single-stream blocks at its
    width (24 heads of 128, MLP ratio 4), the 2 refiner blocks, float32 on CPU.

    ``grid`` is the video as (frames, height, width) in tokens, exactly (2x2 patches); without it, ``seq`` video
    tokens (default 6240 = 4 latent frames of 480x832, as the Wan presets) map to latent frames of 30x52 tokens
    (60x104 latents), or to one smaller frame near that aspect below 1560 tokens. 256 text tokens of width 4096,
    the last 56 of them padding.
    """
    from diffusers import HunyuanVideoTransformer3DModel

    frames, height, width = preset_token_grid(seq, grid)
    singles = layers if single_layers is None else single_layers
    return make_case(
        lambda: HunyuanVideoTransformer3DModel(num_layers=layers, num_single_layers=singles),
        lambda: {
            "hidden_states": torch.randn(1, 16, frames, 2 * height, 2 * width),
            "timestep": torch.tensor([500]),
            "encoder_hidden_states": torch.randn(1, 256, 4096),
            "encoder_attention_mask": _text_mask(256, padded=56),
            "pooled_projections": torch.randn(1, 768),
            "guidance": torch.tensor([6000.0]),
        },
        sample_loss,
        seed=None,
    )


def _video_tokens(latents: torch.Tensor, patch: tuple[int, int, int]) -> int:
    _, _, frames, height, width = latents.shape
    return math.prod(-(-size // p) for size, p in zip((frames, height, width), patch, strict=True))


def token_count(model: nn.Module, inputs: Mapping[str, Any]) -> int:
    """Tokens of the batch's joint sequence as the blocks see it: video (with FramePack's history) and text."""
    config = model.config
    patch = (config.patch_size_t, config.patch_size, config.patch_size)
    latents = inputs["hidden_states"]
    batch = latents.shape[0]
    video = _video_tokens(latents, patch)
    text = inputs["encoder_hidden_states"].shape[1]
    if "encoder_hidden_states_2" in inputs:  # 1.5: image, ByT5 and MLLM tokens, padding included
        text += inputs["encoder_hidden_states_2"].shape[1] + inputs["image_embeds"].shape[1]
    if "latents_clean" in inputs:  # FramePack: history latents at 1x, 2x and 4x patches, then image tokens
        for key, scale in (("latents_clean", 1), ("latents_history_2x", 2), ("latents_history_4x", 4)):
            if inputs.get(key) is not None:
                video += _video_tokens(inputs[key], tuple(p * scale for p in patch))
        if batch == 1:  # a single sample's text is cut to its unpadded length
            text = int(inputs["encoder_attention_mask"].sum())
        text += inputs["image_embeds"].shape[1]
    return batch * (video + text)
