"""An adapter's attention op, named as a string in its spec, is saved by the graph route."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ac_core
from ac_core import AdapterSpec, AttentionBackend, ModelSpec
from ac_core.measure import CompiledOpCounter
from ac_core.testing import ToyBlock, toy_case

from ..core.helpers import assert_same_training, loss_and_grads

OP = "ac_core_test::toy_attention"


def _math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v)


@torch.library.custom_op(OP, mutates_args=())
def toy_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A kernel the partitioner cannot see into, as a backend's fused attention is."""
    return _math_attention(q, k, v)


@toy_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad: torch.Tensor):
    _, vjp = torch.func.vjp(_math_attention, *ctx.saved_tensors)
    return vjp(grad)


toy_attention.register_autograd(_backward, setup_context=_setup_context)


class _CustomAttentionBlock(ToyBlock):
    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return toy_attention(q, k, v)


ADAPTER = AdapterSpec(
    name="custom_attention_toy",
    models=(ModelSpec(cls="ac_core.testing.ToyTransformer", containers=("layers",)),),
    backends=(AttentionBackend("custom", ops=(OP,)),),
)


def _case():
    case = toy_case(depth=2)
    for block in case.model.layers:
        block.__class__ = _CustomAttentionBlock
    return case


@pytest.mark.parametrize(("adapter", "recomputed"), [(ADAPTER, 0), (None, 2)], ids=["named", "unnamed"])
def test_the_adapters_op_is_not_rerun_in_backward(adapter, recomputed):
    expected = loss_and_grads(_case())
    case = _case()
    case.model = ac_core.compile(case.model, adapter=adapter, backend="aot_eager")
    assert_same_training(loss_and_grads(case), expected)  # compiles outside the counter
    with CompiledOpCounter() as ops:
        case.run().backward()
    assert ops.count([OP]) == 2
    # Named by the adapter, its output is saved; otherwise the partitioner recomputes it.
    assert ops.count([OP], "backward") == recomputed
