"""ac-core's adapter for the Wan video transformers of diffusers: T2V/I2V, VACE, Wan-Animate and Wan-Animate-2.

Layouts read from diffusers 0.42.1 and checked identical in 0.41.0 and 0.42.0 (the model files are
byte-identical); ``WanAnimate2Transformer3DModel`` is new in 0.42, so its spec declares 0.42 alone.

WanAnimate2 runs in two passes (read from ``transformer_wan_animate_2.py``). The reference pass
(``kv_cache_mode="extract"``) attends on the model's backend and stores each block's keys and values in the cache
it is given; the generation pass (``"cached"``) reads them, and its self-attention runs flex attention whatever
the backend (its in-context mask is a flex ``BlockMask``), its cross-attention the backend.

- The cache: a recompute would store its own keys and values over the forward's, equal values on tensors that keep
  the recompute's activations alive until the next reference pass, so ``prepare`` drops a recompute's store
  (:mod:`ac_core_adapters.models.wan_training`). It cannot be turned off for training: the generation pass needs it.
- flex has no backward on CPU (torch raises), so the tiny model, and the suite on CPU, run the reference pass.
  ``ops`` keeps the ``flex_attention`` higher-order op and does not rerun it (shown on CPU with inputs needing no
  gradient); the generation pass itself trains only on CUDA, not run here.
- diffusers' own gradient checkpointing raises TypeError on this model (it passes ``kv_cache=`` to a checkpoint
  function taking positions only) before any block runs, so ``prepare`` also turns it off at the model's forward
  where it is switched on after ac-core.

The tiny models, presets and token count are in :mod:`ac_core_adapters.models.wan`; neither module
imports diffusers until a factory is called.
"""

from __future__ import annotations

from ac_core import AdapterSpec, ExcludedContainer, ModelSpec
from ac_core.libraries.diffusers import adapter_fields
from ac_core.libraries.diffusers_parallel import CONTEXT_PARALLEL
from ac_core.spec import VideoGeometry

from .models.wan import token_count
from .models.wan_training import REQUIREMENTS, prepare

VERSIONS = "diffusers>=0.41,<0.43"
_BLOCK = "WanTransformerBlock"
_DIFFUSERS = adapter_fields()

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
            # Wan-VAE: 4x in time after the lone first frame, 8x in space; the transformer's patch_size (1, 2, 2).
            geometry=VideoGeometry(vae_temporal=4, vae_spatial=8, patch=(1, 2, 2)),
            # num_layers of the released transformer configs (Wan-AI/Wan2.1-T2V-{1.3B,14B}-Diffusers); 40 is also
            # WanTransformer3DModel's default in diffusers 0.42 (its defaults are the 14B's).
            depths={"wan2.1-1.3b": {"layers": 30}, "wan2.1-14b": {"layers": 40}},
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
        ModelSpec(
            cls="diffusers.WanAnimate2Transformer3DModel",
            containers=("blocks",),
            # Self-, text and image cross-attention on the model's backend: the reference pass, as the tiny model
            # runs. In the generation pass the self-attention runs flex whatever the backend: 2 calls and 1 flex.
            attention_calls={"WanAnimate2TransformerBlock": 3},
            versions="diffusers>=0.42,<0.43",  # the class is new in 0.42
            tiny="ac_core_adapters.models.wan:tiny_animate_2",
            meta_unsupported="diffusers 0.42's forward reads the patch grids' values (grid_sizes.tolist() for the "
            "rotary embedding, offset_grid_sizes[0][axis].item() for a refer_offset of -1)",
        ),
    ),
    **{**_DIFFUSERS, "requirements": (*_DIFFUSERS["requirements"], *REQUIREMENTS)},
    prepare=prepare,
    token_count=token_count,
    # Ulysses through diffusers' enable_parallelism: WanTransformer3DModel declares a _cp_plan, the others none.
    context_parallel=CONTEXT_PARALLEL,
)
"""The ``wan`` adapter, registered under the ``ac_core.adapters`` entry point ``wan``."""
