"""Names stay those of the plain model; apply, re-apply and remove round-trip."""

from __future__ import annotations

import copy

import pytest
import torch

from ac_core import (
    DEFAULT_RETAINED_OPS,
    BlockSkip,
    CheckpointType,
    Full,
    Ops,
    apply_activation_checkpointing,
    checkpointed_blocks,
    is_activation_checkpointed,
    remove_activation_checkpointing,
)
from ac_core.measure import OpCounter
from ac_core.testing import toy_case

from .helpers import assert_same_training, loss_and_grads, structure


@pytest.mark.parametrize("kind", [Full(), Ops(), BlockSkip(every=2)], ids=["full", "ops", "block_skip"])
def test_names_and_state_dict_keys_unchanged(kind):
    case = toy_case()
    plain_modules = [n for n, _ in case.model.named_modules()]
    plain_params = [n for n, _ in case.model.named_parameters()]
    plain_keys = list(case.model.state_dict())
    apply_activation_checkpointing(case.model, kind, blocks=["layers"])
    assert [n for n, _ in case.model.named_modules()] == plain_modules
    assert [n for n, _ in case.model.named_parameters()] == plain_params
    assert list(case.model.state_dict()) == plain_keys
    assert not any("_checkpoint_wrapped_module" in n for n in plain_keys)
    # A state_dict saved from the checkpointed model loads strictly into a plain one.
    fresh = toy_case(seed=1).model
    fresh.load_state_dict(case.model.state_dict(), strict=True)


def _backward_attention_calls(case) -> int:
    with OpCounter() as ops:
        case.run().backward()
    return ops.count(DEFAULT_RETAINED_OPS, "backward")


def test_applying_twice_does_not_checkpoint_twice():
    case = toy_case(depth=3)
    apply_activation_checkpointing(case.model, "full", blocks=["layers"])
    apply_activation_checkpointing(case.model, "full", blocks=["layers"])
    assert _backward_attention_calls(case) == 3
    for block in case.model.layers:
        assert block.forward.__self__ is block
        assert block.__dict__["_ac_core_chain"].previous_forward is None  # the class forward below


def test_applying_another_type_replaces_the_first():
    case = toy_case(depth=4)
    apply_activation_checkpointing(case.model, "full", blocks=["layers"])
    apply_activation_checkpointing(case.model, "block_skip", 2, blocks=["layers"])
    assert checkpointed_blocks(case.model) == {
        "layers.0": CheckpointType.FULL,
        "layers.2": CheckpointType.FULL,
    }
    assert _backward_attention_calls(case) == 2
    apply_activation_checkpointing(case.model, "ops", blocks=["layers"])
    assert set(checkpointed_blocks(case.model).values()) == {CheckpointType.OPS}
    assert _backward_attention_calls(case) == 0


def test_remove_restores_plain_forward():
    case = toy_case(depth=3)
    before = structure(case.model)
    apply_activation_checkpointing(case.model, "ops", blocks=["layers"])
    assert is_activation_checkpointed(case.model) and is_activation_checkpointed(case.model.layers[0])
    assert not is_activation_checkpointed(case.model.embed)
    assert remove_activation_checkpointing(case.model) is case.model
    assert structure(case.model) == before
    assert not is_activation_checkpointed(case.model)
    with OpCounter() as ops:
        case.run().backward()
    assert ops.count(["aten::addmm"], "backward") == 0


def test_an_earlier_instance_forward_is_kept_and_restored():
    case = toy_case(depth=2)
    calls = []
    block = case.model.layers[0]
    plain_forward = block.forward

    def traced_forward(x):
        calls.append(1)
        return plain_forward(x)

    block.forward = traced_forward
    apply_activation_checkpointing(case.model, "full", blocks=["layers"])
    case.run().backward()
    assert len(calls) == 2  # forward, then recompute
    remove_activation_checkpointing(case.model)
    assert block.forward is traced_forward


def test_deepcopy_checkpoints_the_copy_not_the_original():
    case = toy_case(depth=2)
    apply_activation_checkpointing(case.model, "full", blocks=["layers"])
    clone = copy.deepcopy(case.model)
    for original, copied in zip(case.model.layers, clone.layers, strict=True):
        assert copied.forward.__self__ is copied and original.forward.__self__ is original
    with torch.no_grad():
        for p in clone.parameters():
            p.add_(1.0)
    assert not torch.equal(clone(**case.inputs), case.model(**case.inputs))


def test_plain_model_reports_not_checkpointed():
    assert checkpointed_blocks(toy_case().model) == {}
    assert not is_activation_checkpointed(toy_case().model)


def test_state_dict_round_trip_trains_the_same():
    source = toy_case(seed=3)
    apply_activation_checkpointing(source.model, "ops", blocks=["layers"])
    target = toy_case(seed=0)
    target.model.load_state_dict(source.model.state_dict())
    target.inputs = source.inputs
    assert_same_training(loss_and_grads(target), loss_and_grads(source))
