"""ac-core's adapter for the HunyuanVideo transformers of diffusers: HunyuanVideo (both block variants), 1.5, FramePack.

Layouts read from diffusers 0.42.1 and checked identical in 0.41.0 and 0.42.0 (byte-identical model files).

The tiny models, preset and token count are in :mod:`ac_core_adapters.models.hunyuan`; neither module
imports diffusers until a factory is called.
"""

from __future__ import annotations

from dataclasses import replace

from ac_core import AdapterSpec, ExcludedContainer, ModelSpec
from ac_core.libraries.diffusers import adapter_fields
from ac_core.spec import VideoGeometry

from .models.hunyuan import token_count

VERSIONS = "diffusers>=0.41,<0.43"

# diffusers' own gradient checkpointing leaves the refiner out too (HunyuanVideo*Transformer3DModel.forward
# checkpoints only transformer_blocks and single_transformer_blocks).
_REFINER = ExcludedContainer(
    "context_embedder.token_refiner.refiner_blocks",
    "2 token-refiner blocks over the text tokens only (256 for HunyuanVideo): 512 block-tokens against the "
    "60 x 6496 of the video blocks at 6240 video tokens (0.13%), so checkpointing them would save next to nothing",
)

_CONTAINERS = ("transformer_blocks", "single_transformer_blocks")
_HV_CALLS = {
    "HunyuanVideoTransformerBlock": 1,
    "HunyuanVideoSingleTransformerBlock": 1,
    "HunyuanVideoTokenReplaceTransformerBlock": 1,
    "HunyuanVideoTokenReplaceSingleTransformerBlock": 1,
}

_HUNYUAN_VIDEO = ModelSpec(
    cls="diffusers.HunyuanVideoTransformer3DModel",
    containers=_CONTAINERS,
    excluded=(_REFINER,),
    attention_calls=_HV_CALLS,
    versions=VERSIONS,
    tiny="ac_core_adapters.models.hunyuan:tiny_hunyuan_video",
    presets={"hunyuanvideo": "ac_core_adapters.models.hunyuan:preset_hunyuan_video"},
    # AutoencoderKLHunyuanVideo: 4x in time after the lone first frame, 8x in space; patch_size_t 1, patch_size 2.
    geometry=VideoGeometry(vae_temporal=4, vae_spatial=8, patch=(1, 2, 2)),
    # HunyuanVideoTransformer3DModel's defaults in diffusers 0.42, the released model's (hunyuanvideo-community/
    # HunyuanVideo transformer config): num_layers 20, num_single_layers 40.
    depths={"hunyuanvideo": {"layers": 20, "single_layers": 40}},
)

SPEC = AdapterSpec(
    name="hunyuan",
    library="diffusers",
    extra="hunyuan",
    models=(
        _HUNYUAN_VIDEO,
        # The same class again, so that the token-replace variant's blocks go through every check too;
        # both entries declare the same containers, so either serves a model of this class.
        replace(
            _HUNYUAN_VIDEO,
            tiny="ac_core_adapters.models.hunyuan:tiny_hunyuan_video_token_replace",
            presets={},
            depths={},
        ),
        ModelSpec(
            cls="diffusers.HunyuanVideo15Transformer3DModel",
            containers=("transformer_blocks",),
            excluded=(_REFINER,),
            attention_calls={"HunyuanVideo15TransformerBlock": 1},
            versions=VERSIONS,
            tiny="ac_core_adapters.models.hunyuan:tiny_hunyuan_video_15",
            meta_unsupported="diffusers 0.42's forward branches on torch.all(image_embeds == 0)",
        ),
        ModelSpec(
            cls="diffusers.HunyuanVideoFramepackTransformer3DModel",
            containers=_CONTAINERS,
            excluded=(_REFINER,),
            attention_calls={"HunyuanVideoTransformerBlock": 1, "HunyuanVideoSingleTransformerBlock": 1},
            versions=VERSIONS,
            tiny="ac_core_adapters.models.hunyuan:tiny_framepack",
            meta_unsupported="diffusers 0.42's forward slices the text by a length read from the attention mask",
        ),
    ),
    # HunyuanVideo and 1.5 always pass a text padding mask (FramePack does for batches above 1).
    **adapter_fields(attention_mask=True),
    token_count=token_count,
)
"""The ``hunyuan`` adapter, registered under the ``ac_core.adapters`` entry point ``hunyuan``."""
