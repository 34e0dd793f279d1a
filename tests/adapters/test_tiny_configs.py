"""Tiny transformers configs derived from a class's defaults: every size scaled, sub-configs too, every kind of
layer kept, and a multimodal model type's causal LM built from its text config."""

from __future__ import annotations

import pytest
import torch

from ac_core.libraries.configs import HEAD_DIM, HEADS, LAYERS, VOCAB, WIDTH, build_model, derived_config

transformers = pytest.importorskip("transformers")


def _params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("model_type", "cls_name"),
    [("gpt2", "GPT2LMHeadModel"), ("deepseek_v3", "DeepseekV3ForCausalLM"), ("mixtral", "MixtralForCausalLM")],
)
def test_every_size_is_scaled(model_type: str, cls_name: str):
    cls = getattr(transformers, cls_name)
    config_class = transformers.CONFIG_MAPPING[model_type]
    config = derived_config(cls, config_class)
    with torch.device("meta"):
        model = build_model(cls, config, config_class)
    built = model.config
    assert built.vocab_size <= VOCAB and built.num_hidden_layers == LAYERS and built.use_cache is False
    assert built.num_attention_heads == HEADS
    assert _params(model) < 200_000  # full size: 124 M (GPT-2), 671 B (DeepSeek-V3), 47 B (Mixtral)


def test_multimodal_sub_configs_are_scaled_and_the_causal_lm_gets_the_text_config():
    config_class = transformers.CONFIG_MAPPING["llama4"]
    config = derived_config(transformers.Llama4ForCausalLM, config_class)
    assert config["text_config"]["hidden_size"] == WIDTH
    assert config["vision_config"]["hidden_size"] == WIDTH
    with torch.device("meta"):
        model = build_model(transformers.Llama4ForCausalLM, config, config_class)
    assert type(model.config) is transformers.Llama4TextConfig
    assert model.config.hidden_size == WIDTH and model.config.vocab_size <= VOCAB


def test_a_hybrid_model_keeps_one_layer_of_each_kind():
    config_class = transformers.CONFIG_MAPPING["qwen3_next"]
    defaults = config_class().layer_types
    config = derived_config(transformers.Qwen3NextForCausalLM, config_class)
    assert set(config["layer_types"]) == set(defaults) and len(set(defaults)) == 2
    assert config["num_hidden_layers"] == len(config["layer_types"]) == LAYERS
    assert config["layer_types"][-1] == defaults[-1]  # the last kind stays last (some models need full last)


def test_a_missing_head_dim_is_set_to_the_tiny_one():
    config = derived_config(transformers.MinistralForCausalLM, transformers.CONFIG_MAPPING["ministral"])
    assert config["head_dim"] == HEAD_DIM
