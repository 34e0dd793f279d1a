"""The Llama adapter's tiny models, real-width preset and token count (named by ``ac_core_adapters.llama``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ac_core import ModelCase
from ac_core.testing import make_case

if TYPE_CHECKING:
    from transformers import LlamaConfig

_TINY: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query attention, as Llama 3
    "max_position_embeddings": 64,
}


def _sdpa_config(**settings: Any) -> LlamaConfig:
    from transformers import LlamaConfig

    config = LlamaConfig(**settings)
    config._attn_implementation = "sdpa"
    return config


def _lm_inputs(vocab: int, shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    # The language-model loss predicts the input tokens themselves: labels are the input ids.
    input_ids = torch.randint(0, vocab, shape)
    return {"input_ids": input_ids, "labels": input_ids}


def _hidden_loss(output: Any) -> torch.Tensor:
    return output.last_hidden_state.float().pow(2).mean()


def _lm_loss(output: Any) -> torch.Tensor:
    return output.loss


def tiny_llama_model() -> ModelCase:
    """LlamaModel, 3 decoder layers, SDPA attention, batch 2 x 16 tokens; ``use_cache`` left at its default (True)."""
    from transformers import LlamaModel

    return make_case(
        lambda: LlamaModel(_sdpa_config(**_TINY)),
        lambda: {"input_ids": torch.randint(0, _TINY["vocab_size"], (2, 16))},
        _hidden_loss,
    )


def tiny_llama_for_causal_lm() -> ModelCase:
    """LlamaForCausalLM, 3 decoder layers, SDPA attention, batch 2 x 16 tokens, language-model loss."""
    from transformers import LlamaForCausalLM

    return make_case(
        lambda: LlamaForCausalLM(_sdpa_config(**_TINY)), lambda: _lm_inputs(_TINY["vocab_size"], (2, 16)), _lm_loss
    )


def preset_llama3_8b(*, layers: int = 4, seq: int | None = None, vocab: int = 16384) -> ModelCase:
    """Llama-3-8B: ``layers`` decoder layers at its width (4096 hidden, 32 query and 8 key/value heads, MLP 14336,
    RoPE theta 500000), SDPA attention, float32 on CPU, one sequence of ``seq`` tokens (default 4096).

    The vocabulary is cut to ``vocab`` = 16384 by default (Llama 3 has 128256) so that the embedding, head and
    logits do not dwarf the decoder layers whose activations are being measured; a step budget plans the real
    one (the adapter's ``depths``): its embedding, head and logits are part of the step's peak.
    """
    from transformers import LlamaForCausalLM

    seq = 4096 if seq is None else seq
    if seq < 1:
        raise ValueError(f"seq must be a positive token count, got {seq}")
    config = _sdpa_config(
        vocab_size=vocab,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
    )
    return make_case(
        lambda: LlamaForCausalLM(config), lambda: _lm_inputs(config.vocab_size, (1, seq)), _lm_loss, seed=None
    )


def token_count(model: nn.Module, inputs: Mapping[str, Any]) -> int:
    """Tokens of the batch: batch x sequence length."""
    tokens = inputs.get("input_ids")
    if tokens is None:
        tokens = inputs["inputs_embeds"]
    return tokens.shape[0] * tokens.shape[1]
