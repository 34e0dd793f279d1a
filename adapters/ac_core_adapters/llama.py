"""ac-core's adapter for Llama in transformers: LlamaModel and LlamaForCausalLM.

Layout read from transformers 5.24.0 and checked in the 5.0.0 sources (same ``layers`` of
``LlamaDecoderLayer``; 5.0 names the cache argument ``past_key_values``, later versions ``cache``).

The tiny models, preset and token count are in :mod:`ac_core_adapters.models.llama`; neither module
imports transformers until a factory is called.
"""

from __future__ import annotations

from ac_core import AdapterSpec, ModelSpec
from ac_core.libraries.transformers import BACKENDS, set_attn_implementation, train_without_kv_cache

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
        ),
    ),
    backends=BACKENDS,
    default_backend="sdpa",
    requirements=(
        "training forwards run without the KV cache: a recomputed decoder layer would append its keys and values "
        "again. prepare() hooks the model so that such forwards get use_cache=False (also over an explicit "
        "use_cache=True, with a warning) and rejects an explicit cache object; forwards without gradients keep it",
        "transformers' own gradient checkpointing off (ac-core turns it off and says so, also where "
        "gradient_checkpointing_enable() or the Trainer's gradient_checkpointing=True comes after ac-core: at the next "
        "forward)",
    ),
    prepare=train_without_kv_cache,
    set_backend=set_attn_implementation,
    token_count=token_count,
)
"""The ``llama`` adapter, registered under the ``ac_core.adapters`` entry point ``llama``."""
