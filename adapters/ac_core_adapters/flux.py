"""ac-core's adapter for the Flux image transformers of diffusers: FLUX.1, FLUX.2 and FLUX.3.

Layouts read from diffusers 0.42.1; FLUX.1 and FLUX.2 checked identical in 0.41.0 and 0.42.0 (byte-identical
model files), FLUX.3 in 0.42.0 (it is new in 0.42).

The tiny models, preset and token count are in :mod:`ac_core_adapters.models.flux`; neither module
imports diffusers until a factory is called.
"""

from __future__ import annotations

from ac_core import AdapterSpec, ModelSpec
from ac_core.libraries.diffusers import adapter_fields
from ac_core.libraries.diffusers_parallel import CONTEXT_PARALLEL
from ac_core.spec import VideoGeometry

from .models.flux import token_count

VERSIONS = "diffusers>=0.41,<0.43"

SPEC = AdapterSpec(
    name="flux",
    library="diffusers",
    extra="flux",
    models=(
        ModelSpec(
            cls="diffusers.FluxTransformer2DModel",
            containers=("transformer_blocks", "single_transformer_blocks"),
            attention_calls={"FluxTransformerBlock": 1, "FluxSingleTransformerBlock": 1},
            versions=VERSIONS,
            tiny="ac_core_adapters.models.flux:tiny_flux",
            presets={"flux.1-dev": "ac_core_adapters.models.flux:preset_flux1_dev"},
            # An 8x VAE, then FluxPipeline packs 2x2 latents into one token (in_channels 64 = 16 latent x 4).
            geometry=VideoGeometry(vae_temporal=1, vae_spatial=8, patch=(1, 2, 2), video=False),
            # FluxTransformer2DModel's defaults in diffusers 0.42, FLUX.1-dev's transformer config:
            # num_layers 19, num_single_layers 38.
            depths={"flux.1-dev": {"layers": 19, "single_layers": 38}},
        ),
        ModelSpec(
            cls="diffusers.Flux2Transformer2DModel",
            containers=("transformer_blocks", "single_transformer_blocks"),
            attention_calls={"Flux2TransformerBlock": 1, "Flux2SingleTransformerBlock": 1},
            versions=VERSIONS,
            tiny="ac_core_adapters.models.flux:tiny_flux2",
        ),
        ModelSpec(
            cls="diffusers.Flux3Transformer2DModel",
            # mode_blocks is a ModuleDict of per-mode ModuleLists ("image", "image_cond").
            containers=("mode_blocks.*", "txt_mode_blocks", "single_transformer_blocks"),
            attention_calls={"Flux3ModeTransformerBlock": 1, "Flux3SingleTransformerBlock": 1},
            versions="diffusers>=0.42,<0.43",
            tiny="ac_core_adapters.models.flux:tiny_flux3",
        ),
    ),
    **adapter_fields(),
    token_count=token_count,
    # Ulysses through diffusers' enable_parallelism: FLUX.1 and FLUX.2 declare a _cp_plan, FLUX.3 none.
    context_parallel=CONTEXT_PARALLEL,
)
"""The ``flux`` adapter, registered under the ``ac_core.adapters`` entry point ``flux``."""
