"""ac-core's adapter for Llama in transformers: LlamaModel and LlamaForCausalLM.

Importing this module imports nothing of transformers: the factories import it when called.
Layout read from transformers 5.24.0 and checked in the 5.0.0 sources (same ``layers`` of
``LlamaDecoderLayer``; 5.0 names the cache argument ``past_key_values``, later versions ``cache``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ac_core import AdapterSpec, ModelCase, ModelSpec
from ac_core.libraries.transformers import BACKENDS, set_attn_implementation, train_without_kv_cache

VERSIONS = "transformers>=5.0,<5.25"

_TINY = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query attention, as Llama 3
    "max_position_embeddings": 64,
}


def _tiny(model_cls_name: str) -> tuple[nn.Module, dict[str, Any]]:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**_TINY)
    config._attn_implementation = "sdpa"
    model = getattr(transformers, model_cls_name)(config).train()
    input_ids = torch.randint(0, _TINY["vocab_size"], (2, 16))
    return model, {"input_ids": input_ids}


def _hidden_loss(output: Any) -> torch.Tensor:
    return output.last_hidden_state.float().pow(2).mean()


def _lm_loss(output: Any) -> torch.Tensor:
    return output.loss


def tiny_llama_model() -> ModelCase:
    """LlamaModel, 3 decoder layers, SDPA attention, batch 2 x 16 tokens; ``use_cache`` left at its default (True)."""
    model, inputs = _tiny("LlamaModel")
    return ModelCase(model, inputs, _hidden_loss)


def tiny_llama_for_causal_lm() -> ModelCase:
    """LlamaForCausalLM, 3 decoder layers, SDPA attention, batch 2 x 16 tokens, language-model loss."""
    model, inputs = _tiny("LlamaForCausalLM")
    return ModelCase(model, {**inputs, "labels": inputs["input_ids"]}, _lm_loss)


def preset_llama3_8b(*, layers: int = 4, seq: int | None = None) -> ModelCase:
    """Llama-3-8B: ``layers`` decoder layers at its width (4096 hidden, 32 query and 8 key/value heads, MLP 14336,
    RoPE theta 500000), SDPA attention, float32 on CPU, one sequence of ``seq`` tokens (default 4096).

    The vocabulary is cut to 16384 (Llama 3 has 128256) so that the embedding, head and logits do not
    dwarf the decoder layers whose activations are being measured.
    """
    import transformers

    seq = 4096 if seq is None else seq
    if seq < 1:
        raise ValueError(f"seq must be a positive token count, got {seq}")
    config = transformers.LlamaConfig(
        vocab_size=16384,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
    )
    config._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(config).train()
    input_ids = torch.randint(0, config.vocab_size, (1, seq))
    return ModelCase(model, {"input_ids": input_ids, "labels": input_ids}, _lm_loss)


def token_count(model: nn.Module, inputs: Mapping[str, Any]) -> int:
    """Tokens of the batch: batch x sequence length."""
    tokens = inputs.get("input_ids")
    if tokens is None:
        tokens = inputs["inputs_embeds"]
    return tokens.shape[0] * tokens.shape[1]


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
            tiny=tiny_llama_model,
        ),
        ModelSpec(
            cls="transformers.LlamaForCausalLM",
            containers=("model.layers",),
            attention_calls=_LAYER,
            versions=VERSIONS,
            tiny=tiny_llama_for_causal_lm,
            presets={"llama-3-8b": preset_llama3_8b},
        ),
    ),
    backends=BACKENDS,
    default_backend="sdpa",
    requirements=(
        "training forwards run without the KV cache: a recomputed decoder layer would append its keys and values "
        "again. prepare() hooks the model so that such forwards get use_cache=False (also over an explicit "
        "use_cache=True, with a warning) and rejects an explicit cache object; forwards without gradients keep it",
        "transformers' own gradient checkpointing off (ac-core turns it off and says so)",
    ),
    prepare=train_without_kv_cache,
    set_backend=set_attn_implementation,
    token_count=token_count,
)
"""The ``llama`` adapter, registered under the ``ac_core.adapters`` entry point ``llama``."""
