"""ac-core's adapter for the Wan video transformers of diffusers: T2V/I2V, VACE and Wan-Animate.

Layouts read from diffusers 0.42.1 and checked identical in 0.41.0 and 0.42.0 (the model files are
byte-identical). ``WanAnimate2Transformer3DModel`` (new in 0.42) is not served: its blocks write a
reference KV cache during forward and its self-attention runs only on the flex backend.

The tiny models, presets and token count are in :mod:`ac_core_adapters.models.wan`; neither module
imports diffusers until a factory is called.
"""

from __future__ import annotations

from ac_core import AdapterSpec, ExcludedContainer, ModelSpec
from ac_core.libraries.diffusers import adapter_fields

from .models.wan import token_count

VERSIONS = "diffusers>=0.41,<0.43"
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
            tiny="ac_core_adapters.models.wan:tiny_wan",
            presets={
                "wan2.1-1.3b": "ac_core_adapters.models.wan:preset_wan21_1_3b",
                "wan2.1-14b": "ac_core_adapters.models.wan:preset_wan21_14b",
            },
        ),
        ModelSpec(
            cls="diffusers.WanVACETransformer3DModel",
            containers=("blocks", "vace_blocks"),
            attention_calls={_BLOCK: 2, "WanVACETransformerBlock": 2},
            versions=VERSIONS,
            tiny="ac_core_adapters.models.wan:tiny_vace",
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
            tiny="ac_core_adapters.models.wan:tiny_animate",
            compile_unsupported=(
                "diffusers 0.42's face encoder: backward under torch.compile raises 'view size is not compatible "
                "with input tensor's size and stride', with or without checkpointing"
            ),
        ),
    ),
    **adapter_fields(),
    token_count=token_count,
)
"""The ``wan`` adapter, registered under the ``ac_core.adapters`` entry point ``wan``."""
