"""Llama trains under per-op checkpointing without meeting the KV-cache error, and keeps its cache for generation."""

from __future__ import annotations

import logging

import pytest
import torch

from ac_core import apply_activation_checkpointing, remove_activation_checkpointing
from ac_core.libraries import transformers as transformers_lib

from .cases import assert_same_training, loss_and_grads

transformers = pytest.importorskip("transformers")
llama = pytest.importorskip("ac_core_adapters.models.llama")


def test_without_the_cache_guard_per_op_checkpointing_meets_the_cache_error():
    # The failure the guard exists to prevent, shown by taking it off again. blocks= gets the guard too
    # (tests/integration/test_wrappers.py trains that route).
    case = llama.tiny_llama_for_causal_lm()
    apply_activation_checkpointing(case.model, "ops", blocks=["model.layers"])
    for module in case.model.modules():
        for key, hook in list(module._forward_pre_hooks.items()):
            if transformers_lib._is_guard(hook):
                del module._forward_pre_hooks[key]
    with pytest.raises(RuntimeError, match=r"aten\.slice\.Tensor invocation .* not found in storage"):
        case.run().backward()


@pytest.mark.parametrize("factory", ["tiny_llama_for_causal_lm", "tiny_llama_model"])
@pytest.mark.parametrize("use_cache", [None, True])
def test_with_the_adapter_it_trains_like_the_plain_model(factory, use_cache, caplog):
    make = getattr(llama, factory)
    extra = {} if use_cache is None else {"use_cache": use_cache}
    plain = make()
    plain.inputs = {**plain.inputs, **extra}
    expected = loss_and_grads(plain)
    case = make()
    case.inputs = {**case.inputs, **extra}
    assert case.model.config.use_cache is True
    with caplog.at_level(logging.INFO, logger="ac_core"):
        apply_activation_checkpointing(case.model, "ops")
        output = case.model(**case.inputs)
        case.loss(output).backward()
        case.model.zero_grad(set_to_none=True)
        got = loss_and_grads(case)
    assert_same_training(got, expected)
    assert output.cache is None  # no cache was built
    assert case.model.config.use_cache is True  # the config is left alone
    messages = [r.getMessage() for r in caplog.records if r.name == "ac_core"]
    assert any("without the KV cache" in m for m in messages)
    ignored = [m for m in messages if "use_cache=True ignored" in m]
    assert len(ignored) == (1 if use_cache else 0)  # once per process


def test_an_explicit_cache_in_a_forward_with_gradients_is_refused():
    case = llama.tiny_llama_for_causal_lm()
    apply_activation_checkpointing(case.model, "ops")
    with pytest.raises(ValueError, match="KV cache"):
        case.model(**case.inputs, cache=transformers.DynamicCache(config=case.model.config))


def test_without_gradients_the_cache_is_kept():
    case = llama.tiny_llama_for_causal_lm()
    apply_activation_checkpointing(case.model, "ops")
    with torch.no_grad():
        output = case.model(input_ids=case.inputs["input_ids"])
    assert isinstance(output.cache, transformers.DynamicCache)
    assert output.cache.get_seq_length() == case.inputs["input_ids"].shape[1]


def test_eval_mode_with_gradients_runs_without_the_cache_too():
    case = llama.tiny_llama_for_causal_lm()
    apply_activation_checkpointing(case.model, "ops")
    case.model.eval()
    case.run().backward()


def test_applying_twice_hooks_once_and_removing_checkpointing_restores_the_cache():
    case = llama.tiny_llama_for_causal_lm()
    apply_activation_checkpointing(case.model, "ops")
    apply_activation_checkpointing(case.model, "full")
    guards = {
        type(m).__name__: sum(map(transformers_lib._is_guard, m._forward_pre_hooks.values()))
        for m in case.model.modules()
    }
    assert {name: n for name, n in guards.items() if n} == {"LlamaForCausalLM": 1, "LlamaModel": 1}
    remove_activation_checkpointing(case.model)
    assert case.model(**case.inputs).cache is not None
