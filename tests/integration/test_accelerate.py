"""accelerate: an ac-core model prepared with bf16 mixed precision (on CPU) trains like the plain one, and a
save_state/load_state round trip keeps ac-core's checkpointing; on a tiny Llama (its adapter) and a tiny Qwen3 (the
transformers library route)."""

from __future__ import annotations

import pytest
import torch

from ac_core import (
    DEFAULT_RETAINED_OPS,
    apply_activation_checkpointing,
    checkpointed_blocks,
    get_adapter,
    resolve_blocks,
)
from ac_core.measure import OpCounter

from . import route_models

accelerate = pytest.importorskip("accelerate")
pytest.importorskip("transformers")
llama = pytest.importorskip("ac_core_adapters.models.llama")

LAYERS = [f"model.layers.{i}" for i in range(3)]  # in both models
# (factory, the adapter serving it)
MODELS = [
    pytest.param(llama.tiny_llama_for_causal_lm, "llama", id="llama"),
    pytest.param(route_models.tiny_qwen3_for_causal_lm, "transformers-route", id="qwen3-route"),
]


def _mixed_precision() -> str:
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _ = torch.ones(2, 2) @ torch.ones(2, 2)
    except RuntimeError:
        return "no"
    return "bf16"


@pytest.fixture
def accelerator():
    from accelerate.state import AcceleratorState

    made = []

    def make():
        made.append(accelerate.Accelerator(mixed_precision=_mixed_precision(), cpu=True))
        return made[-1]

    yield make
    AcceleratorState._reset_state(reset_partial_state=True)  # the state is per process: leave none to later tests


def _prepared(accelerator, make, when: str | None):
    case = make()
    if when == "before":
        apply_activation_checkpointing(case.model, "ops")
    optimizer = torch.optim.SGD(case.model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(case.model, optimizer)
    if when == "after":
        apply_activation_checkpointing(model, "ops")
    return model, optimizer, case.inputs


def _step(accelerator, model, optimizer, inputs) -> tuple[torch.Tensor, int]:
    """One optimizer step: (loss, attention calls during backward)."""
    with OpCounter() as counter:
        loss = model(**inputs).loss
        accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    assert counter.count(DEFAULT_RETAINED_OPS) == 3  # one attention per layer in forward
    return loss.detach(), counter.count(DEFAULT_RETAINED_OPS, "backward")


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize(("make", "adapter"), MODELS)
def test_prepared_ac_core_model_trains_like_the_plain_one(accelerator, make, adapter, when):
    plain = accelerator()
    assert plain.mixed_precision == _mixed_precision()
    expected = _prepared(plain, make, None)
    ours = accelerator()
    model, optimizer, inputs = _prepared(ours, make, when)
    resolved = resolve_blocks(model)
    assert resolved.paths == frozenset(LAYERS)
    assert resolved.adapter is not None and resolved.adapter.name == adapter
    for _ in range(2):
        loss, reruns = _step(ours, model, optimizer, inputs)
        torch.testing.assert_close(loss, _step(plain, *expected)[0], rtol=0, atol=0)
        assert reruns == 0
    for (name, got), want in zip(model.named_parameters(), expected[0].parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(("make", "adapter"), MODELS)
def test_save_state_load_state_round_trip_keeps_ac_core_checkpointing(accelerator, make, adapter, tmp_path):
    acc = accelerator()
    model, optimizer, inputs = _prepared(acc, make, "before")
    assert get_adapter(model).name == adapter
    _step(acc, model, optimizer, inputs)
    acc.save_state(str(tmp_path / "state"))
    after_save, _ = _step(acc, model, optimizer, inputs)
    _step(acc, model, optimizer, inputs)  # move on, then go back
    acc.load_state(str(tmp_path / "state"))
    assert list(checkpointed_blocks(model)) == LAYERS
    again, reruns = _step(acc, model, optimizer, inputs)
    torch.testing.assert_close(again, after_save, rtol=0, atol=0)
    assert reruns == 0  # still ops: attention kept, not re-run

    # A fresh ac-core model loading that state trains the same step too.
    fresh_acc = accelerator()
    fresh, fresh_optimizer, _ = _prepared(fresh_acc, make, "before")
    fresh_acc.load_state(str(tmp_path / "state"))
    assert list(checkpointed_blocks(fresh)) == LAYERS
    torch.testing.assert_close(_step(fresh_acc, fresh, fresh_optimizer, inputs)[0], after_save, rtol=0, atol=0)
