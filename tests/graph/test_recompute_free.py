"""A memory budget's plan on the graph route: what recomputes without FLOPs is left to the partitioner, the rest as
eager checkpointing holds it (that a compiled plan trains like the plain model: test_budget_route.py)."""

from __future__ import annotations

import pytest
import torch

from ac_core import BlockDecision, BlockMode, GraphDecisions
from ac_core.graph import apply_sac_pass
from ac_core.graph.free_by_torch import torch_rules

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


def _three_blocks():
    """An ``ops`` block with a kept matmul, a kept norm and a GELU; an unchecked block; a block recomputed whole."""
    g = GraphBuilder()
    x, w = g.inputs.values()
    embed = g.op(aten.mm.default, x, w, stack=[("embed", "Linear")])
    table = g.op(aten.cat.default, embed, stack=[("rope", "Rotary")])
    mm = g.op(aten.mm.default, table, w, stack=[("layers.0", "Block")])
    norm = g.op(aten.native_layer_norm.default, mm, stack=[("layers.0", "Block")])
    act = g.op(aten.gelu.default, norm, stack=[("layers.0", "Block")])
    out0 = g.op(aten.mm.default, act, w, stack=[("layers.0", "Block")])
    held = g.op(aten.gelu.default, out0, stack=[("layers.1", "Block")])
    whole = g.op(aten.gelu.default, held, stack=[("layers.2", "Block")])
    return g, (embed, table, mm, norm, act, out0, held, whole)


FREE_BY_TORCH = (
    BlockDecision("layers.0", BlockMode.OPS, keep=(("aten::mm", 0), ("aten::native_layer_norm", 0))),
    BlockDecision("layers.1", BlockMode.NONE),
    BlockDecision("layers.2", BlockMode.FULL),
)


def test_free_by_torch_leaves_the_ops_without_flops_untagged_in_ops_blocks_and_outside():
    g, (embed, table, mm, norm, act, out0, held, whole) = _three_blocks()
    apply_sac_pass(g.module(whole), decisions=FREE_BY_TORCH, recompute_free=True, free_by_torch=True)
    assert policy(embed) is SAVE and policy(mm) is SAVE  # matmuls: outside held, the plan's kept one
    assert policy(out0) is SAVE  # layers.1's input: made by a matmul the plan does not keep, so held as a boundary
    assert policy(table) is None and policy(act) is None  # no FLOPs, outside and in the ops block: torch decides
    assert policy(norm) is None  # kept by the plan, but without FLOPs: torch's rules save a norm themselves
    assert policy(held) is SAVE and policy(whole) is RECOMPUTE  # unchecked and whole-recomputed blocks as before


def test_free_by_torch_without_it_tags_every_op():
    g, nodes = _three_blocks()
    apply_sac_pass(g.module(nodes[-1]), decisions=FREE_BY_TORCH, recompute_free=True)
    assert all(policy(node) is not None for node in nodes)


def test_free_by_torch_goes_with_a_plans_decisions():
    g, nodes = _three_blocks()
    with pytest.raises(ValueError, match="free_by_torch=True goes with recompute_free=True and decisions="):
        apply_sac_pass(g.module(nodes[-1]), decisions=FREE_BY_TORCH, free_by_torch=True)
    with pytest.raises(ValueError, match="per-block decisions"):
        GraphDecisions(recompute_free=True, free_by_torch=True)


def test_torch_rules_lift_the_bans_torchs_budget_lifts_and_restore_them():
    from torch._functorch import config

    before = (config.ban_recompute_used_far_apart, config.ban_recompute_materialized_backward)
    with torch_rules():
        assert not config.ban_recompute_used_far_apart and not config.ban_recompute_long_fusible_chains
        assert not config.ban_recompute_materialized_backward and config.ban_recompute_not_in_allowlist
    assert (config.ban_recompute_used_far_apart, config.ban_recompute_materialized_backward) == before


def test_recompute_block_inputs_leaves_the_boundaries_to_the_partitioner():
    g, (embed, _, kept, _, _, out1, head) = _graph()
    apply_sac_pass(g.module(head), decisions=DECISIONS, recompute_free=True, recompute_block_inputs=True)
    assert policy(out1) is RECOMPUTE  # the head's input, made by layers.1's unkept matmul: no longer held as such
    assert policy(embed) is SAVE and policy(kept) is SAVE  # the code outside and the plan's keeps as before
    with pytest.raises(ValueError, match="recompute_block_inputs=True goes with recompute_free=True"):
        apply_sac_pass(_graph()[0].module(head), decisions=DECISIONS, recompute_block_inputs=True)
    with pytest.raises(ValueError, match="recompute_block_inputs=True goes with recompute_free=True"):
        GraphDecisions(recompute_block_inputs=True)
