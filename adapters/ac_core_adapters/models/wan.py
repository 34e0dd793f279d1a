"""The Wan adapter's tiny models, real-width presets and token count (named by ``ac_core_adapters.wan``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ac_core import ModelCase
from ac_core.libraries.diffusers import preset_token_grid, sample_loss
from ac_core.testing import make_case

_TEXT_TOKENS = 512  # umT5 prompts are padded to 512 tokens
_TINY: dict[str, Any] = {
    "out_channels": 4,
    "num_layers": 3,
    "rope_max_seq_len": 32,
    "num_attention_heads": 2,
    "attention_head_dim": 8,
    "text_dim": 16,
    "freq_dim": 16,
    "ffn_dim": 32,
}


def tiny_wan() -> ModelCase:
    """WanTransformer3DModel, text-to-video (2 attention calls per block), 3 blocks, 2x4x4 tokens."""
    from diffusers import WanTransformer3DModel

    return make_case(
        lambda: WanTransformer3DModel(in_channels=4, **_TINY),
        lambda: {
            "hidden_states": torch.randn(1, 4, 2, 8, 8),
            "timestep": torch.tensor([500]),
            "encoder_hidden_states": torch.randn(1, 6, 16),
        },
        sample_loss,
    )


def tiny_vace() -> ModelCase:
    """WanVACETransformer3DModel with 3 blocks and 3 VACE blocks (one per main block), control video given."""
    from diffusers import WanVACETransformer3DModel

    return make_case(
        lambda: WanVACETransformer3DModel(in_channels=4, vace_layers=[0, 1, 2], vace_in_channels=6, **_TINY),
        lambda: {
            "hidden_states": torch.randn(1, 4, 2, 8, 8),
            "timestep": torch.tensor([500]),
            "encoder_hidden_states": torch.randn(1, 6, 16),
            "control_hidden_states": torch.randn(1, 6, 2, 8, 8),
        },
        sample_loss,
    )


def tiny_animate() -> ModelCase:
    """WanAnimateTransformer3DModel as the real one is configured (image cross-attention on), 3 blocks.

    A face adapter follows every block (3), the motion encoder has 3 residual conv blocks at 32x32 face
    crops, and its 8 face frames go through it in 2 batches of 4, so each of those blocks runs twice.
    The processor splits 512 text tokens off the image tokens, so the text has exactly 512.
    """
    from diffusers import WanAnimateTransformer3DModel

    return make_case(
        lambda: WanAnimateTransformer3DModel(
            in_channels=None,
            latent_channels=4,
            image_dim=8,
            added_kv_proj_dim=16,
            motion_encoder_channel_sizes={"4": 8, "8": 8, "16": 8, "32": 8},
            motion_encoder_size=32,
            motion_style_dim=8,
            motion_dim=4,
            motion_encoder_dim=8,
            face_encoder_hidden_dim=8,
            face_encoder_num_heads=2,
            inject_face_latents_blocks=1,
            motion_encoder_batch_size=4,
            **_TINY,
        ),
        lambda: {
            "hidden_states": torch.randn(1, 12, 3, 8, 8),
            "timestep": torch.tensor([500]),
            "encoder_hidden_states": torch.randn(1, _TEXT_TOKENS, 16),
            "encoder_hidden_states_image": torch.randn(1, 4, 8),
            "pose_hidden_states": torch.randn(1, 4, 2, 8, 8),
            "face_pixel_values": torch.randn(1, 3, 8, 32, 32),
        },
        sample_loss,
    )


def _mean_square_of_samples(output: Any) -> torch.Tensor:
    """Mean square over every sample of a list output (WanAnimate2 returns one tensor per sample)."""
    return torch.cat([sample.float().flatten() for sample in output.sample]).pow(2).mean()


def tiny_animate_2() -> ModelCase:
    """WanAnimate2Transformer3DModel's reference pass (``kv_cache_mode="extract"``), 2 blocks, 2x4x4 tokens.

    The reference pass is the one that trains on CPU: its self-attention runs the model's backend and writes the
    keys and values to the cache; the generation pass runs flex attention, which has no backward on CPU. Its
    image cross-attention is on, as in the real model; the image projection is 1280 wide (CLIP's) at any size.
    Latents are lists with one (channels, frames, height, width) tensor per sample.
    """
    from diffusers.models.transformers.transformer_wan_animate_2 import (
        WanAnimate2KVCache,
        WanAnimate2Transformer3DModel,
    )

    frames, height, width = 2, 8, 8
    return make_case(
        lambda: WanAnimate2Transformer3DModel(
            in_dim=8,
            dim=16,
            ffn_dim=32,
            freq_dim=16,
            text_dim=16,
            out_dim=4,
            num_heads=2,
            num_layers=2,
            text_len=8,
        ),
        lambda: {
            "hidden_states": [torch.randn(4, frames, height, width)],
            "timestep": torch.tensor([500]),
            "encoder_hidden_states": [torch.randn(6, 16)],
            "condition_latents": [torch.randn(4, frames, height, width)],
            "kv_cache": WanAnimate2KVCache(2),
            "kv_cache_mode": "extract",
            "seq_len": frames * (height // 2) * (width // 2),
            "encoder_hidden_states_image": torch.randn(1, 4, 1280),
            # refer_offset_w=-1 places the reference's RoPE width offset at its grid width, read from here.
            "offset_grid_sizes": torch.tensor([[frames, height // 2, width // 2]]),
        },
        _mean_square_of_samples,
    )


def _wan_at_width(
    heads: int, ffn_dim: int, layers: int, seq: int | None, grid: tuple[int, int, int] | None
) -> ModelCase:
    """``layers`` WanTransformer3DModel blocks with ``heads`` heads of 128 and FFN ``ffn_dim``, float32 on CPU.

    ``grid`` is the video as (frames, height, width) in tokens, exactly (latents of twice the height and width:
    2x2 patches); without it, ``seq`` video tokens (default 6240 = 4 latent frames of 480x832) map to frames of
    30x52 tokens (60x104 latents), or to one smaller frame near that aspect below 1560 tokens; 81 frames at 480p
    is seq=32760 (21 latent frames). 512 text tokens of width 4096.
    """
    from diffusers import WanTransformer3DModel

    frames, height, width = preset_token_grid(seq, grid)
    return make_case(
        lambda: WanTransformer3DModel(
            num_attention_heads=heads,
            attention_head_dim=128,
            in_channels=16,
            out_channels=16,
            text_dim=4096,
            ffn_dim=ffn_dim,
            num_layers=layers,
        ),
        lambda: {
            "hidden_states": torch.randn(1, 16, frames, 2 * height, 2 * width),
            "timestep": torch.tensor([500]),
            "encoder_hidden_states": torch.randn(1, _TEXT_TOKENS, 4096),
        },
        sample_loss,
        seed=None,
    )


def preset_wan21_1_3b(
    *, layers: int = 4, seq: int | None = None, grid: tuple[int, int, int] | None = None
) -> ModelCase:
    """Wan2.1-1.3B: ``layers`` blocks at its width (12 heads of 128, FFN 8960), ``seq`` video tokens (default 6240)
    or a (frames, height, width) token ``grid``."""
    return _wan_at_width(12, 8960, layers, seq, grid)


def preset_wan21_14b(*, layers: int = 4, seq: int | None = None, grid: tuple[int, int, int] | None = None) -> ModelCase:
    """Wan2.1-14B: ``layers`` blocks at its width (40 heads of 128, FFN 13824), ``seq`` video tokens (default 6240)
    or a (frames, height, width) token ``grid``."""
    return _wan_at_width(40, 13824, layers, seq, grid)


def token_count(model: nn.Module, inputs: Mapping[str, Any]) -> int:
    """Video tokens of the batch: latent frames x height x width / patch volume (text tokens not counted).

    ``hidden_states`` is a (batch, channels, frames, height, width) tensor, or (WanAnimate2) a list of one
    (channels, frames, height, width) tensor per sample. WanAnimate2's generation pass also attends to the cached
    reference tokens; they are keys only and not counted.
    """
    latents = inputs["hidden_states"]
    grids = (
        [x.shape[-3:] for x in latents] if isinstance(latents, (list, tuple)) else [latents.shape[-3:]] * len(latents)
    )
    p_t, p_h, p_w = model.config.patch_size
    return sum((frames // p_t) * (height // p_h) * (width // p_w) for frames, height, width in grids)
