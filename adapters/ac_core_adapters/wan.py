"""ac-core's adapter for the Wan video transformers of diffusers: T2V/I2V, VACE and Wan-Animate.

Importing this module imports nothing of diffusers: the factories import it when called.
Layouts read from diffusers 0.42.1 and checked identical in 0.41.0 and 0.42.0 (the model files are
byte-identical). ``WanAnimate2Transformer3DModel`` (new in 0.42) is not served: its blocks write a
reference KV cache during forward and its self-attention runs only on the flex backend.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ac_core import AdapterSpec, ExcludedContainer, ModelCase, ModelSpec
from ac_core.libraries.diffusers import attention_backends, sample_loss, set_attention_backend, video_token_grid

VERSIONS = "diffusers>=0.41,<0.43"

_TEXT_TOKENS = 512  # umT5 prompts are padded to 512 tokens
_TINY = {"num_attention_heads": 2, "attention_head_dim": 8, "text_dim": 16, "freq_dim": 16, "ffn_dim": 32}


def tiny_wan() -> ModelCase:
    """WanTransformer3DModel, text-to-video (2 attention calls per block), 3 blocks, 2x4x4 tokens."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(in_channels=4, out_channels=4, num_layers=3, rope_max_seq_len=32, **_TINY)
    inputs = {
        "hidden_states": torch.randn(1, 4, 2, 8, 8),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": torch.randn(1, 6, 16),
    }
    return ModelCase(model.train(), inputs, sample_loss)


def tiny_vace() -> ModelCase:
    """WanVACETransformer3DModel with 3 blocks and 3 VACE blocks (one per main block), control video given."""
    from diffusers import WanVACETransformer3DModel

    torch.manual_seed(0)
    model = WanVACETransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_layers=3,
        rope_max_seq_len=32,
        vace_layers=[0, 1, 2],
        vace_in_channels=6,
        **_TINY,
    )
    inputs = {
        "hidden_states": torch.randn(1, 4, 2, 8, 8),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": torch.randn(1, 6, 16),
        "control_hidden_states": torch.randn(1, 6, 2, 8, 8),
    }
    return ModelCase(model.train(), inputs, sample_loss)


def tiny_animate() -> ModelCase:
    """WanAnimateTransformer3DModel as the real one is configured (image cross-attention on), 3 blocks.

    A face adapter follows every block (3), the motion encoder has 3 residual conv blocks at 32x32 face
    crops, and its 8 face frames go through it in 2 batches of 4, so each of those blocks runs twice.
    The processor splits 512 text tokens off the image tokens, so the text has exactly 512.
    """
    from diffusers import WanAnimateTransformer3DModel

    torch.manual_seed(0)
    model = WanAnimateTransformer3DModel(
        in_channels=None,
        latent_channels=4,
        out_channels=4,
        num_layers=3,
        rope_max_seq_len=32,
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
    )
    inputs = {
        "hidden_states": torch.randn(1, 12, 3, 8, 8),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": torch.randn(1, _TEXT_TOKENS, 16),
        "encoder_hidden_states_image": torch.randn(1, 4, 8),
        "pose_hidden_states": torch.randn(1, 4, 2, 8, 8),
        "face_pixel_values": torch.randn(1, 3, 8, 32, 32),
    }
    return ModelCase(model.train(), inputs, sample_loss)


@dataclass(frozen=True)
class _Width:
    heads: int
    ffn_dim: int


def _wan_preset(width: _Width, *, layers: int = 4, seq: int | None = None) -> ModelCase:
    from diffusers import WanTransformer3DModel

    frames, height, width_tokens = video_token_grid(6240 if seq is None else seq)
    model = WanTransformer3DModel(
        num_attention_heads=width.heads,
        attention_head_dim=128,
        in_channels=16,
        out_channels=16,
        text_dim=4096,
        ffn_dim=width.ffn_dim,
        num_layers=layers,
    )
    inputs = {
        "hidden_states": torch.randn(1, 16, frames, 2 * height, 2 * width_tokens),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": torch.randn(1, _TEXT_TOKENS, 4096),
    }
    return ModelCase(model.train(), inputs, sample_loss)


def _preset(width: _Width, name: str):
    factory = functools.partial(_wan_preset, width)
    factory.__doc__ = (
        f"{name}: ``layers`` WanTransformer3DModel blocks at its width ({width.heads} heads of 128, FFN "
        f"{width.ffn_dim}), float32 on CPU. ``seq`` video tokens (default 6240 = 4 latent frames of 480x832) map "
        "to frames of 30x52 tokens (60x104 latents), or to one smaller frame near that aspect below 1560 tokens; "
        "81 frames at 480p is seq=32760 (21 latent frames). 512 text tokens of width 4096."
    )
    return factory


def token_count(model: nn.Module, inputs: Mapping[str, Any]) -> int:
    """Video tokens of the batch: latent frames x height x width / patch volume (text tokens not counted)."""
    batch, _, frames, height, width = inputs["hidden_states"].shape
    p_t, p_h, p_w = model.config.patch_size
    return batch * (frames // p_t) * (height // p_h) * (width // p_w)


_BLOCK = "WanTransformerBlock"

SPEC = AdapterSpec(
    name="wan",
    library="diffusers",
    extra="wan",
    models=(
        ModelSpec(
            cls="diffusers.WanTransformer3DModel",
            containers=("blocks",),
            # Self- and text cross-attention. An image-to-video config (added_kv_proj_dim set) adds an image
            # cross-attention: 3 calls.
            attention_calls={_BLOCK: 2},
            versions=VERSIONS,
            tiny=tiny_wan,
            presets={
                "wan2.1-1.3b": _preset(_Width(heads=12, ffn_dim=8960), "Wan2.1-1.3B"),
                "wan2.1-14b": _preset(_Width(heads=40, ffn_dim=13824), "Wan2.1-14B"),
            },
        ),
        ModelSpec(
            cls="diffusers.WanVACETransformer3DModel",
            containers=("blocks", "vace_blocks"),
            attention_calls={_BLOCK: 2, "WanVACETransformerBlock": 2},
            versions=VERSIONS,
            tiny=tiny_vace,
        ),
        ModelSpec(
            cls="diffusers.WanAnimateTransformer3DModel",
            # The face adapters cross-attend from every video token, so their activations grow with the video
            # like a block's. The motion encoder's conv blocks run on every 512x512 face frame and hold 315 MiB
            # per frame in float32 (measured): at 77 frames in bf16, about what 40 fully checkpointed 14B
            # blocks keep at 480p.
            containers=("blocks", "face_adapter", "motion_encoder.res_blocks"),
            excluded=(
                ExcludedContainer(
                    "motion_encoder.motion_network",
                    "five linear layers on one 512-wide vector per face frame: a few KiB of activations",
                ),
            ),
            attention_calls={_BLOCK: 3, "WanAnimateFaceBlockCrossAttention": 1, "MotionEncoderResBlock": 0},
            versions=VERSIONS,
            tiny=tiny_animate,
            compile_unsupported=(
                "diffusers 0.42's face encoder: backward under torch.compile raises 'view size is not compatible "
                "with input tensor's size and stride', with or without checkpointing"
            ),
        ),
    ),
    backends=attention_backends(),
    default_backend="native",
    requirements=(
        "an attention backend with a backward: diffusers' sage backends and _flash_3 cannot train",
        "diffusers' own gradient checkpointing off (ac-core turns it off and says so)",
    ),
    set_backend=set_attention_backend,
    token_count=token_count,
)
"""The ``wan`` adapter, registered under the ``ac_core.adapters`` entry point ``wan``."""
