"""The Flux adapter's tiny models, real-width preset and token count (named by ``ac_core_adapters.flux``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ac_core import ModelCase
from ac_core.libraries.diffusers import sample_loss
from ac_core.testing import make_case

_TINY: dict[str, Any] = {
    "in_channels": 8,
    "num_layers": 3,
    "num_single_layers": 3,
    "num_attention_heads": 2,
    "attention_head_dim": 8,
    "joint_attention_dim": 16,
}


def _ids(tokens: int, axes: int) -> torch.Tensor:
    # Position ids only feed the rotary embedding; their values do not change which ops run.
    return torch.arange(tokens * axes, dtype=torch.float32).reshape(tokens, axes) % 4


def _image_and_text() -> dict[str, torch.Tensor]:
    # FLUX.2's and FLUX.3's inputs: 16 image and 6 text tokens, positions on 4 rotary axes.
    return {
        "hidden_states": torch.randn(1, 16, 8),
        "encoder_hidden_states": torch.randn(1, 6, 16),
        "timestep": torch.tensor([0.5]),
        "img_ids": _ids(16, 4),
        "txt_ids": _ids(6, 4),
    }


def _batched_ids(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {**inputs, "img_ids": inputs["img_ids"][None], "txt_ids": inputs["txt_ids"][None]}


def tiny_flux() -> ModelCase:
    """FluxTransformer2DModel, guidance-distilled as FLUX.1-dev: 3 double, 3 single blocks, 16 image + 6 text tokens."""
    from diffusers import FluxTransformer2DModel

    return make_case(
        lambda: FluxTransformer2DModel(
            pooled_projection_dim=8, guidance_embeds=True, axes_dims_rope=(2, 2, 4), **_TINY
        ),
        lambda: {
            "hidden_states": torch.randn(1, 16, 8),
            "encoder_hidden_states": torch.randn(1, 6, 16),
            "pooled_projections": torch.randn(1, 8),
            "timestep": torch.tensor([0.5]),
            "img_ids": _ids(16, 3),
            "txt_ids": _ids(6, 3),
            "guidance": torch.tensor([3.5]),
        },
        sample_loss,
    )


def tiny_flux2() -> ModelCase:
    """Flux2Transformer2DModel: 3 double, 3 single blocks, 16 image + 6 text tokens, no reference KV cache."""
    from diffusers import Flux2Transformer2DModel

    return make_case(
        lambda: Flux2Transformer2DModel(timestep_guidance_channels=16, axes_dims_rope=(2, 2, 2, 2), **_TINY),
        # Positions batched as Flux2Pipeline passes them: diffusers' context-parallel plan splits 3-dim ids only.
        lambda: {**_batched_ids(_image_and_text()), "guidance": torch.tensor([3.5])},
        sample_loss,
    )


def tiny_flux3() -> ModelCase:
    """Flux3Transformer2DModel: 3 blocks per mode and 3 single blocks; one forward runs every mode.

    A reference image (``image_cond_hidden_states``) is given, so the image, image_cond and text mode
    blocks all run before the single blocks.
    """
    from diffusers import Flux3Transformer2DModel

    return make_case(
        lambda: Flux3Transformer2DModel(cond_in_channels=8, timestep_channels=16, axes_dims_rope=(2, 2, 2, 2), **_TINY),
        lambda: {
            **_image_and_text(),
            "image_cond_hidden_states": torch.randn(1, 8, 8),
            "image_cond_ids": _ids(8, 4),
        },
        sample_loss,
    )


def _grid_ids(height: int, width: int) -> torch.Tensor:
    # FLUX.1's image positions: (0, row, column) per latent patch, row-major.
    rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    return torch.stack([torch.zeros(height * width), rows.flatten(), cols.flatten()], dim=1).float()


def preset_flux1_dev(
    *,
    layers: int = 4,
    seq: int | None = None,
    grid: tuple[int, int, int] | None = None,
    single_layers: int | None = None,
) -> ModelCase:
    """FLUX.1-dev: ``layers`` double-stream and ``single_layers`` (default ``layers``) single-stream blocks at its
    width (24 heads of 128, MLP ratio 4), guidance embedding on, float32 on CPU.

    ``grid`` is the image as (1, height, width) in tokens, exactly; without it, ``seq`` image tokens (default 4096:
    a 1024x1024 image is 128x128 latents, packed 2x2) form the ``h x w`` grid with ``h = floor(sqrt(seq))`` and
    ``w = seq // h``. 512 text tokens of width 4096.
    """
    from diffusers import FluxTransformer2DModel

    if grid is not None:
        if seq is not None:
            raise ValueError(f"give seq or grid, not both: seq={seq}, grid={grid}")
        if len(grid) != 3 or grid[0] != 1 or not all(type(n) is int and n >= 1 for n in grid):
            raise ValueError(f"grid must be (1, height, width) in tokens (an image: one frame), got {grid!r}")
        height, width = grid[1], grid[2]
    else:
        seq = 4096 if seq is None else seq
        if seq < 1:
            raise ValueError(f"seq must be a positive token count, got {seq}")
        height = math.isqrt(seq)
        width = seq // height
    singles = layers if single_layers is None else single_layers
    return make_case(
        lambda: FluxTransformer2DModel(guidance_embeds=True, num_layers=layers, num_single_layers=singles),
        lambda: {
            "hidden_states": torch.randn(1, height * width, 64),
            "encoder_hidden_states": torch.randn(1, 512, 4096),
            "pooled_projections": torch.randn(1, 768),
            "timestep": torch.tensor([0.5]),
            "img_ids": _grid_ids(height, width),
            "txt_ids": torch.zeros(512, 3),
            "guidance": torch.tensor([3.5]),
        },
        sample_loss,
        seed=None,
    )


def token_count(model: nn.Module, inputs: Mapping[str, Any]) -> int:
    """Tokens of the batch's joint sequence: image, text and (FLUX.3) reference-image tokens."""
    batch, image, _ = inputs["hidden_states"].shape
    tokens = image + inputs["encoder_hidden_states"].shape[1]
    if inputs.get("image_cond_hidden_states") is not None:
        tokens += inputs["image_cond_hidden_states"].shape[1]
    return batch * tokens
