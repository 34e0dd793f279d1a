"""The forward chain: layers added and removed in any order leave the others working and the model plain."""

from __future__ import annotations

import copy
import functools
import itertools
import logging
from typing import Any

import pytest
import torch

from ac_core import (
    OffloadConfig,
    apply_activation_checkpointing,
    apply_activation_offload,
    checkpointed_blocks,
    remove_activation_checkpointing,
    remove_activation_offload,
)
from ac_core._chain import ForwardLayer, add, get, remove
from ac_core.measure import OpCounter
from ac_core.testing import TOY_ADAPTER, toy_case

from .helpers import assert_same_training, loss_and_grads

ATTENTION = ["aten::_scaled_dot_product_flash_attention_for_cpu"]


class _Counting(ForwardLayer):
    kind = "counting"

    def __init__(self) -> None:
        self.calls = 0

    def forward(self, module, call_next, args: tuple, kwargs: dict[str, Any]):
        self.calls += 1
        return call_next(*args, **kwargs)


def _recomputed_attention(case) -> int:
    case.model.zero_grad(set_to_none=True)
    with OpCounter() as ops:
        case.run().backward()
    case.model.zero_grad(set_to_none=True)
    return ops.count(ATTENTION, "backward")


@pytest.mark.parametrize("order", list(itertools.permutations(["checkpoint", "counting", "offload"])))
def test_removing_layers_in_any_order_leaves_the_rest_working(order):
    expected = loss_and_grads(toy_case(depth=2))
    case = toy_case(depth=2)
    block = case.model.layers[0]
    counting = _Counting()
    add(block, counting)
    apply_activation_checkpointing(case.model, "full", adapter=TOY_ADAPTER)
    apply_activation_offload(case.model, OffloadConfig(min_tokens=1), adapter=TOY_ADAPTER)
    present = {"checkpoint", "counting", "offload"}
    for kind in order:
        {
            "checkpoint": lambda: remove_activation_offload(remove_activation_checkpointing(case.model)),
            "counting": lambda: remove(block, "counting"),
            "offload": lambda: remove_activation_offload(case.model),
        }[kind]()
        present.discard(kind)
        if kind == "checkpoint":
            present.discard("offload")  # removing checkpointing removes ac-core's offload too
        counting.calls = 0
        case.model.zero_grad(set_to_none=True)
        assert_same_training(loss_and_grads(case), expected)
        assert (counting.calls > 0) == ("counting" in present), (order, kind)
        assert bool(checkpointed_blocks(case.model)) == ("checkpoint" in present)
        assert _recomputed_attention(case) == (2 if "checkpoint" in present else 0)
    assert "forward" not in block.__dict__ and "forward" not in case.model.__dict__
    assert "_ac_core_chain" not in block.__dict__


def test_a_layer_of_the_same_kind_is_replaced_in_place():
    block = toy_case().model.layers[0]
    first, second = _Counting(), _Counting()
    add(block, first)
    add(block, second)
    assert get(block, "counting") is second
    block(torch.randn(1, 4, 64))
    assert (first.calls, second.calls) == (0, 1)
    assert remove(block, "counting") is second and remove(block, "counting") is None


def test_an_earlier_instance_forward_runs_below_the_chain_and_comes_back():
    block = toy_case().model.layers[0]
    seen = []
    plain = block.forward

    def mine(x):
        seen.append("mine")
        return plain(x)

    block.forward = mine
    add(block, _Counting())
    block(torch.randn(1, 4, 64))
    assert seen == ["mine"] and get(block, "counting").calls == 1
    remove(block, "counting")
    assert block.forward is mine


def test_deepcopy_copies_the_chain_bound_to_the_copy():
    case = toy_case(depth=2)
    apply_activation_checkpointing(case.model, "ops", adapter=TOY_ADAPTER)
    copied = toy_case(depth=2)
    copied.model = copy.deepcopy(case.model)
    assert copied.model.layers[0].forward.__self__ is copied.model.layers[0]
    assert checkpointed_blocks(copied.model) == checkpointed_blocks(case.model)
    assert_same_training(loss_and_grads(copied), loss_and_grads(toy_case(depth=2)))


def test_pickle_round_trip_comes_back_checkpointed_with_equal_gradients():
    import io
    import pickle

    case = toy_case(depth=2)
    apply_activation_checkpointing(case.model, "ops", adapter=TOY_ADAPTER)
    for load in (
        lambda m: pickle.loads(pickle.dumps(m)),
        lambda m: torch.load(io.BytesIO(_saved(m)), weights_only=False),
    ):
        loaded = toy_case(depth=2)
        loaded.model = load(case.model)
        assert checkpointed_blocks(loaded.model) == checkpointed_blocks(case.model) != {}
        assert loaded.model.layers[0].forward.__self__ is loaded.model.layers[0]
        assert _recomputed_attention(loaded) == 0  # still 'ops': attention kept, not re-run
        assert_same_training(loss_and_grads(loaded), loss_and_grads(toy_case(depth=2)))


def _saved(model) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(model, buffer)
    return buffer.getvalue()


def _set_foreign_forward(block: torch.nn.Module, calls: list[int]) -> None:
    """What a library applied after ac-core does: an instance forward over ac-core's, calling it (kept in
    ``__wrapped__``)."""
    inner = block.forward

    @functools.wraps(inner)
    def foreign(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    block.forward = foreign


def test_a_forward_set_over_ac_core_s_runs_inside_the_checkpoint_from_the_model_s_first_call(caplog):
    case = toy_case(depth=2)
    apply_activation_checkpointing(case.model, "full", adapter=TOY_ADAPTER)
    calls: list[int] = []
    for block in case.model.layers:
        _set_foreign_forward(block, calls)
    with caplog.at_level(logging.INFO, logger="ac_core"):
        assert _recomputed_attention(case) == 2  # the first call of both blocks is checkpointed ...
    assert len(calls) == 4  # ... above the foreign forward, which the recompute runs again
    assert not [r for r in caplog.records if "sat out" in r.getMessage()]
    assert_same_training(loss_and_grads(case), loss_and_grads(toy_case(depth=2)))
    remove_activation_checkpointing(case.model)
    assert not case.model._forward_pre_hooks and _recomputed_attention(case) == 0


def test_a_block_called_on_its_own_under_a_forward_set_after_ac_core_sits_out_that_one_call(caplog):
    case = toy_case(depth=2)
    apply_activation_checkpointing(case.model, "full", adapter=TOY_ADAPTER)
    block = case.model.layers[0]
    calls: list[int] = []
    _set_foreign_forward(block, calls)
    x = torch.randn(1, 4, 64)
    recomputed = []
    with caplog.at_level(logging.INFO, logger="ac_core"):
        for _ in range(2):
            with OpCounter() as ops:
                block(x).sum().backward()
            recomputed.append(ops.count(ATTENTION, "backward"))
    # Found only from inside the foreign forward: that call runs unchecked, the next one is checkpointed.
    assert recomputed == [0, 1] and len(calls) == 3
    (found,) = [r.getMessage() for r in caplog.records if "sat out" in r.getMessage()]
    assert "layers.0 (ToyBlock)" in found and "not through the model" in found
