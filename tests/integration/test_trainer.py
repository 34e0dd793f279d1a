"""transformers' Trainer on an ac-core model, and the libraries' own checkpointing switched on after ac-core's
(`gradient_checkpointing_enable()`, the Trainer's `gradient_checkpointing=True`, diffusers'
`enable_gradient_checkpointing()`): ac-core keeps its own, turns the library's off and says so once; gradients stay
the plain model's and attention is not re-run. On the curated tiny Llama and Flux and on the library route's tiny Qwen3
and QwenImage."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import ac_core
from ac_core import DEFAULT_RETAINED_OPS, apply_activation_checkpointing, checkpointed_blocks, get_adapter
from ac_core.libraries.checkpointing import library_checkpointing
from ac_core.measure import OpCounter
from ac_core.testing import LibraryCheckpointingToy

from ..adapters.cases import assert_same_training, loss_and_grads
from . import route_models

transformers = pytest.importorskip("transformers")
llama = pytest.importorskip("ac_core_adapters.models.llama")
flux = pytest.importorskip("ac_core_adapters.models.flux")

# (factory, the adapter serving it, the class named in messages); each has 3 blocks at model.layers (LMS)
LMS = [
    pytest.param(llama.tiny_llama_for_causal_lm, "llama", "LlamaForCausalLM", id="llama"),
    pytest.param(route_models.tiny_qwen3_for_causal_lm, "transformers-route", "Qwen3ForCausalLM", id="qwen3-route"),
]
DITS = [
    pytest.param(flux.tiny_flux, "flux", "FluxTransformer2DModel", id="flux"),
    pytest.param(route_models.tiny_qwen_image, "diffusers-route", "QwenImageTransformer2DModel", id="qwen_image-route"),
]

FOUND = "was switched on for"


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ac_core" and FOUND in r.getMessage()]


def _step(case) -> tuple[tuple, int]:
    """(loss and gradients, attention calls during backward) of one step; gradients are cleared after."""
    with OpCounter() as counter:
        result = loss_and_grads(case)
    case.model.zero_grad(set_to_none=True)
    return result, counter.count(DEFAULT_RETAINED_OPS, "backward")


# --- the library's checkpointing switched on after ac-core's -------------------------------------------------------


@pytest.mark.parametrize("enable", ["gradient_checkpointing_enable", "activation_checkpointing_enable"])
@pytest.mark.parametrize(("make", "adapter", "class_name"), LMS)
def test_transformers_checkpointing_after_ac_core_is_turned_off_at_the_next_forward(
    make, adapter, class_name, enable, caplog
):
    expected = loss_and_grads(make())
    case = make()
    apply_activation_checkpointing(case.model, "ops")
    assert get_adapter(case.model).name == adapter
    assert _step(case)[1] == 0  # ops keeps attention: nothing to re-run
    with caplog.at_level(logging.WARNING, logger="ac_core"):
        getattr(case.model, enable)()
        assert library_checkpointing(case.model)  # on until the next forward
        for _ in range(2):
            got, reruns = _step(case)
            assert_same_training(got, expected)
            assert reruns == 0  # 3 of 3 blocks before ac-core detected it
        getattr(case.model, enable)()  # again: turned off again, said once
        _step(case)
    assert library_checkpointing(case.model) == []
    assert list(checkpointed_blocks(case.model)) == [f"model.layers.{i}" for i in range(3)]
    (message,) = _messages(caplog)
    assert "transformers gradient checkpointing" in message and class_name in message
    assert "'model.layers.0'" in message and "Kept ac-core's 'ops' checkpointing" in message


@pytest.mark.parametrize(("make", "adapter", "class_name"), DITS)
def test_diffusers_checkpointing_after_ac_core_is_turned_off_at_the_next_forward(make, adapter, class_name, caplog):
    pytest.importorskip("diffusers")
    expected = loss_and_grads(make())
    case = make()
    apply_activation_checkpointing(case.model, "ops")
    assert get_adapter(case.model).name == adapter
    with OpCounter() as counter:
        loss_and_grads(case)
    case.model.zero_grad(set_to_none=True)
    ops_only = sum(counter.backward.values())
    with caplog.at_level(logging.WARNING, logger="ac_core"):
        case.model.enable_gradient_checkpointing()
        assert_same_training(_step(case)[0], expected)  # found inside the first block the library checkpointed
        with OpCounter() as counter:
            got = loss_and_grads(case)
    assert_same_training(got, expected)
    assert counter.count(DEFAULT_RETAINED_OPS, "backward") == 0
    assert sum(counter.backward.values()) == ops_only  # one mechanism: backward runs what ops alone runs
    assert not case.model.gradient_checkpointing
    (message,) = _messages(caplog)
    assert "diffusers gradient checkpointing" in message and class_name in message
    assert "the model itself" in message and "disable_gradient_checkpointing()" in message


def test_a_model_level_switch_is_found_through_blocks_and_wrappers(caplog):
    # The duck-typed toy checkpoints its layers from its own forward, as diffusers does; here inside a wrapper.
    torch.manual_seed(0)
    model = LibraryCheckpointingToy(dim=32, depth=3)
    x = torch.randn(2, 8, 32)
    case = ac_core.ModelCase(model, {"x": x}, lambda out: out.pow(2).mean())
    expected = loss_and_grads(case)
    model.zero_grad(set_to_none=True)
    wrapper = torch.nn.Sequential(model)
    apply_activation_checkpointing(wrapper, "full", blocks=["0.layers"])
    model.enable_gradient_checkpointing()
    with caplog.at_level(logging.WARNING, logger="ac_core"):
        assert_same_training(loss_and_grads(case), expected)
    assert model.gradient_checkpointing is False
    assert len(_messages(caplog)) == 1 and "'0'" in _messages(caplog)[0]


# --- transformers Trainer ---------------------------------------------------------------------------------------------


def _train(
    tmp_path, make, *, ac_core_policy: str | None, gradient_checkpointing: bool
) -> tuple[list[float], dict, Any]:
    case = make()
    model = case.model
    if ac_core_policy is not None:
        apply_activation_checkpointing(model, ac_core_policy)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (6, 16), generator=generator)
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        gradient_checkpointing=gradient_checkpointing,
        seed=0,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 3
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, model


@pytest.fixture(scope="module", params=[pytest.param(p.values, id=p.id) for p in LMS])
def lm(request):
    """(factory, adapter serving it): one of LMS."""
    return request.param[:2]


@pytest.fixture(scope="module")
def plain_run(lm, tmp_path_factory):
    make, _ = lm
    plain = tmp_path_factory.mktemp("plain")
    losses, params, _ = _train(plain, make, ac_core_policy=None, gradient_checkpointing=False)
    return losses, params


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_trainer_on_an_ac_core_model_trains_like_the_plain_model(
    lm, plain_run, tmp_path, gradient_checkpointing, caplog
):
    make, adapter = lm
    with caplog.at_level(logging.WARNING, logger="ac_core"):
        losses, params, model = _train(
            tmp_path, make, ac_core_policy="ops", gradient_checkpointing=gradient_checkpointing
        )
    assert losses == plain_run[0]
    for name, value in plain_run[1].items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=0, msg=name)
    assert get_adapter(model).name == adapter
    assert len(checkpointed_blocks(model)) == 3 and library_checkpointing(model) == []
    assert len(_messages(caplog)) == (1 if gradient_checkpointing else 0)

    # After training, generate() still uses the KV cache: forwards without gradients keep it.
    model.eval()
    prompt = torch.tensor([[1, 2, 3, 4]])
    output = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False, return_dict_in_generate=True
    )
    assert output.sequences.shape[1] == 7
    assert output.cache is not None and output.cache.get_seq_length() == 6  # prompt + 2 new tokens cached
