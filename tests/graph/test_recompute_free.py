"""A memory budget's plan on the graph route: what recomputes without FLOPs is left to the partitioner, the rest as
eager checkpointing holds it (that a compiled plan trains like the plain model: test_budget_route.py)."""

from __future__ import annotations

import torch

from ac_core import BlockDecision, BlockMode
from ac_core.graph import apply_sac_pass

from .graphs import RECOMPUTE, SAVE, GraphBuilder, policy

aten = torch.ops.aten
DECISIONS = (
    BlockDecision("layers.0", BlockMode.OPS, keep=(("aten::mm", 0),)),
    BlockDecision("layers.1", BlockMode.FULL),
)


def _graph():
    g = GraphBuilder()
    x, w = g.inputs.values()
    embed = g.op(aten.mm.default, x, w, stack=[("embed", "Linear")])
    act = g.op(aten.gelu.default, embed, stack=[("act", "GELU")])
    kept = g.op(aten.mm.default, act, w, stack=[("layers.0", "Block")])
    out0 = g.op(aten.add.Tensor, kept, act, stack=[("layers.0", "Block")])
    inner = g.op(aten.mm.default, out0, w, stack=[("layers.1", "Block")])
    out1 = g.op(aten.add.Tensor, inner, out0, stack=[("layers.1", "Block")])
    head = g.op(aten.mul.Tensor, out1, w, stack=[("head", "Linear")])
    return g, (embed, act, kept, out0, inner, out1, head)


def test_what_recomputes_without_flops_is_left_recomputable():
    g, (embed, act, kept, out0, inner, out1, head) = _graph()
    apply_sac_pass(g.module(head), decisions=DECISIONS, recompute_free=True)
    assert policy(embed) is SAVE  # outside, a matmul: recomputing it costs FLOPs
    assert policy(act) is RECOMPUTE and policy(head) is RECOMPUTE  # outside, no FLOPs
    assert policy(kept) is SAVE and policy(inner) is RECOMPUTE  # the plan's decisions
    assert policy(out0) is RECOMPUTE  # layers.1's input: the kept matmul plus the GELU, summed again for free
    assert policy(out1) is SAVE  # the head's input needs layers.1's unkept matmul


def test_eager_checkpointing_holds_every_boundary_and_the_code_outside():
    g, (embed, act, kept, out0, inner, out1, head) = _graph()
    apply_sac_pass(g.module(head), decisions=DECISIONS)
    assert [policy(n) for n in (embed, act, kept, out0, inner, out1, head)] == [SAVE] * 4 + [RECOMPUTE] + [SAVE] * 2
