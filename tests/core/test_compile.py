"""Checkpointed models compile, keep their names, and train like eager."""

from __future__ import annotations

import pytest
import torch

from ac_core import BlockSkip, Full, Ops, apply_activation_checkpointing
from ac_core.measure import CompiledOpCounter
from ac_core.testing import ToyBlock, toy_case

from .helpers import assert_same_training, loss_and_grads


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("kind", [Full(), Ops(), BlockSkip(every=2)], ids=["full", "ops", "block_skip"])
def test_compiled_matches_eager(kind, backend):
    eager = toy_case(depth=3)
    apply_activation_checkpointing(eager.model, kind, blocks=["layers"])
    expected = loss_and_grads(eager)

    case = toy_case(depth=3)
    apply_activation_checkpointing(case.model, kind, blocks=["layers"])
    plain_names = [n for n, _ in case.model.named_parameters()]
    case.model = torch.compile(case.model, backend=backend)
    got = loss_and_grads(case)
    assert list(got[1]) == plain_names
    assert_same_training(got, expected, atol=1e-5 if backend == "inductor" else 0.0)


def test_compiled_ops_does_not_rerun_attention_in_backward():
    case = toy_case(depth=3)
    apply_activation_checkpointing(case.model, "ops", blocks=["layers"])
    case.model = torch.compile(case.model, backend="aot_eager")
    case.run().backward()  # compile outside the counter
    # A plain OpCounter would make torch.compile fall back to eager while it is active.
    with CompiledOpCounter() as ops:
        case.run().backward()
    assert ops.count(["aten::_scaled_dot_product_flash_attention_for_cpu"]) == 3
    assert ops.count(["aten::_scaled_dot_product_flash_attention_for_cpu"], "backward") == 0
    assert ops.count(["aten::addmm"], "backward") > 0


class _AllowedInGraphBlock(ToyBlock):
    """A block class marked allow_in_graph, as diffusers marks its transformer blocks."""


torch._dynamo.allow_in_graph(_AllowedInGraphBlock)


@pytest.mark.parametrize("kind", ["full", "ops"])
def test_blocks_allowed_in_graph_compile_without_a_graph_break(kind):
    case = toy_case(depth=2)
    for block in case.model.layers:
        block.__class__ = _AllowedInGraphBlock
    expected = loss_and_grads(case)
    case.model.zero_grad(set_to_none=True)
    apply_activation_checkpointing(case.model, kind, blocks=["layers"])
    case.model = torch.compile(case.model, backend="aot_eager", fullgraph=True)  # a graph break raises
    assert_same_training(loss_and_grads(case), expected)
