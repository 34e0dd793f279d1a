"""peft LoRA on a tiny Llama and a tiny Flux, with ac-core applied before or after LoRA: LoRA gradients equal plain
LoRA's and the PEFT state-dict keys are unchanged."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from ac_core import apply_activation_checkpointing, checkpointed_blocks

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")
pytest.importorskip("diffusers")
llama = pytest.importorskip("ac_core_adapters.models.llama")
flux = pytest.importorskip("ac_core_adapters.models.flux")

LLAMA_TARGETS = ["q_proj", "v_proj", "down_proj"]
FLUX_TARGETS = ["to_q", "to_k", "to_v", "proj_out"]


def _llama_lora(model: nn.Module) -> nn.Module:
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=LLAMA_TARGETS, task_type="CAUSAL_LM", init_lora_weights=False
    )
    torch.manual_seed(1)
    return peft.get_peft_model(model, config)


def _flux_lora(model: nn.Module) -> nn.Module:
    # diffusers' own peft integration: LoRA layers injected into the model, no wrapper.
    torch.manual_seed(1)
    model.add_adapter(peft.LoraConfig(r=4, lora_alpha=8, target_modules=FLUX_TARGETS, init_lora_weights=False))
    return model


def _flux_peft_model(model: nn.Module) -> nn.Module:
    # peft's wrapper around a diffusers model.
    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=FLUX_TARGETS, init_lora_weights=False))


def _run(make: Callable, lora: Callable, ac_core_when: str | None, policy: str = "ops") -> tuple:
    """Loss, LoRA gradients and PEFT state-dict keys of one step; ac-core applied "before"/"after" LoRA or not."""
    case = make()
    model = case.model
    if ac_core_when == "before":
        apply_activation_checkpointing(model, policy)
    model = lora(model)
    if ac_core_when == "after":
        apply_activation_checkpointing(model, policy)
    loss = case.loss(model(**case.inputs))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all("lora_" in n for n in grads)
    keys = sorted(peft.get_peft_model_state_dict(model))
    if ac_core_when is not None:
        assert len(checkpointed_blocks(model)) == (6 if make is flux.tiny_flux else 3)
    return loss.detach(), grads, keys


def _assert_same(got: tuple, expected: tuple) -> None:
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    assert got[1].keys() == expected[1].keys()
    for name, grad in expected[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=0, atol=0, msg=f"gradient of {name}")
    assert got[2] == expected[2]


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("policy", ["ops", "full"])
def test_llama_lora(when, policy):
    expected = _run(llama.tiny_llama_for_causal_lm, _llama_lora, None)
    got = _run(llama.tiny_llama_for_causal_lm, _llama_lora, when, policy)
    _assert_same(got, expected)
    assert any(key.startswith("base_model.model.model.layers.0.") for key in got[2])


@pytest.mark.parametrize("lora", [_flux_lora, _flux_peft_model], ids=["add_adapter", "get_peft_model"])
@pytest.mark.parametrize("when", ["before", "after"])
def test_flux_lora(lora, when):
    expected = _run(flux.tiny_flux, lora, None)
    got = _run(flux.tiny_flux, lora, when)
    _assert_same(got, expected)


def test_llama_lora_after_ac_core_names_blocks_by_the_peft_models_fqns():
    case = llama.tiny_llama_for_causal_lm()
    model = _llama_lora(case.model)
    apply_activation_checkpointing(model, "ops")
    assert list(checkpointed_blocks(model)) == [f"base_model.model.model.layers.{i}" for i in range(3)]
    # The KV-cache guard reaches the model inside the wrapper: generation keeps its cache.
    with torch.no_grad():
        output = model(input_ids=case.inputs["input_ids"])
    assert output.cache.get_seq_length() == case.inputs["input_ids"].shape[1]
