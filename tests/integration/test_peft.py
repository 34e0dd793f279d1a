"""peft LoRA on a tiny Llama and a tiny Flux, and on the library route's tiny Qwen3 and QwenImage, with ac-core applied
before or after LoRA: LoRA gradients equal plain LoRA's and the PEFT state-dict keys are unchanged."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from ac_core import ModelCase, apply_activation_checkpointing, checkpointed_blocks, resolve_blocks

from . import route_models

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")
pytest.importorskip("diffusers")
llama = pytest.importorskip("ac_core_adapters.models.llama")
flux = pytest.importorskip("ac_core_adapters.models.flux")

LLAMA_TARGETS = ["q_proj", "v_proj", "down_proj"]
FLUX_TARGETS = ["to_q", "to_k", "to_v", "proj_out"]

# (factory, adapter serving it, checkpointed blocks): the curated models and the library route's.
LMS = [
    pytest.param(llama.tiny_llama_for_causal_lm, "llama", 3, id="llama"),
    pytest.param(route_models.tiny_qwen3_for_causal_lm, "transformers-route", 3, id="qwen3-route"),
]
DITS = [
    pytest.param(flux.tiny_flux, "flux", 6, id="flux"),
    pytest.param(route_models.tiny_qwen_image, "diffusers-route", 3, id="qwen_image-route"),
]


def _llama_lora(model: nn.Module) -> nn.Module:
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=LLAMA_TARGETS, task_type="CAUSAL_LM", init_lora_weights=False
    )
    torch.manual_seed(1)
    return peft.get_peft_model(model, config)


def _flux_lora(model: Any) -> nn.Module:
    # diffusers' own peft integration: LoRA layers injected into the model, no wrapper.
    torch.manual_seed(1)
    model.add_adapter(peft.LoraConfig(r=4, lora_alpha=8, target_modules=FLUX_TARGETS, init_lora_weights=False))
    return model


def _flux_peft_model(model: nn.Module) -> nn.Module:
    # peft's wrapper around a diffusers model.
    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=FLUX_TARGETS, init_lora_weights=False))


def _run(
    make: Callable[[], ModelCase],
    lora: Callable,
    ac_core_when: str | None,
    policy: str = "ops",
    *,
    adapter: str = "",
    blocks: int = 0,
) -> tuple:
    """Loss, LoRA gradients and PEFT state-dict keys of one step; ac-core applied "before"/"after" LoRA or not, and
    then served by ``adapter``, checkpointing ``blocks`` blocks."""
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
        resolved = resolve_blocks(model)
        assert resolved.adapter is not None and resolved.adapter.name == adapter
        assert len(checkpointed_blocks(model)) == blocks
    return loss.detach(), grads, keys


def _assert_same(got: tuple, expected: tuple) -> None:
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    assert got[1].keys() == expected[1].keys()
    for name, grad in expected[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=0, atol=0, msg=f"gradient of {name}")
    assert got[2] == expected[2]


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("policy", ["ops", "full"])
@pytest.mark.parametrize(("make", "adapter", "blocks"), LMS)
def test_causal_lm_lora(make, adapter, blocks, when, policy):
    expected = _run(make, _llama_lora, None)
    got = _run(make, _llama_lora, when, policy, adapter=adapter, blocks=blocks)
    _assert_same(got, expected)
    assert any(key.startswith("base_model.model.model.layers.0.") for key in got[2])


@pytest.mark.parametrize("lora", [_flux_lora, _flux_peft_model], ids=["add_adapter", "get_peft_model"])
@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize(("make", "adapter", "blocks"), DITS)
def test_diffusers_lora(make, adapter, blocks, lora, when):
    expected = _run(make, lora, None)
    got = _run(make, lora, when, adapter=adapter, blocks=blocks)
    _assert_same(got, expected)


@pytest.mark.parametrize(("make", "adapter", "blocks"), LMS)
def test_causal_lm_lora_after_ac_core_names_blocks_by_the_peft_models_fqns(make, adapter, blocks):
    case = make()
    model = _llama_lora(case.model)
    apply_activation_checkpointing(model, "ops")
    assert list(checkpointed_blocks(model)) == [f"base_model.model.model.layers.{i}" for i in range(blocks)]
    assert resolve_blocks(model).source == (
        "adapter 'llama'" if adapter == "llama" else "the transformers library route"
    )
    # The KV-cache guard reaches the model inside the wrapper: generation keeps its cache.
    with torch.no_grad():
        output = model(input_ids=case.inputs["input_ids"])
    assert output.cache.get_seq_length() == case.inputs["input_ids"].shape[1]
