"""ac-core's adapter for Llama in transformers: LlamaModel and LlamaForCausalLM.

Layout read from transformers 5.24.0 and checked in the 5.0.0 sources (same ``layers`` of
``LlamaDecoderLayer``; 5.0 names the cache argument ``past_key_values``, later versions ``cache``).

The tiny models, preset and token count are in :mod:`ac_core_adapters.models.llama`; neither module
imports transformers until a factory is called.
"""

from __future__ import annotations

from ac_core import AdapterSpec, ModelSpec
from ac_core.libraries.transformers import adapter_fields

from .models.llama import token_count

VERSIONS = "transformers>=5.0,<5.25"

_LAYER = {"LlamaDecoderLayer": 1}

SPEC = AdapterSpec(
    name="llama",
    library="transformers",
    extra="llama",
    models=(
        ModelSpec(
            cls="transformers.LlamaModel",
            containers=("layers",),
            attention_calls=_LAYER,
            versions=VERSIONS,
            tiny="ac_core_adapters.models.llama:tiny_llama_model",
        ),
        ModelSpec(
            cls="transformers.LlamaForCausalLM",
            containers=("model.layers",),
            attention_calls=_LAYER,
            versions=VERSIONS,
            tiny="ac_core_adapters.models.llama:tiny_llama_for_causal_lm",
            presets={"llama-3-8b": "ac_core_adapters.models.llama:preset_llama3_8b"},
            # num_hidden_layers of meta-llama/Meta-Llama-3-8B's config.json (also LlamaConfig's default).
            depths={"llama-3-8b": {"layers": 32, "vocab": 128256}},
        ),
    ),
    **adapter_fields(),
    token_count=token_count,
)
"""The ``llama`` adapter, registered under the ``ac_core.adapters`` entry point ``llama``."""
