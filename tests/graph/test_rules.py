"""Where our pass goes beyond the seed's, each rule on a hand-built or traced graph."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ac_core import DEFAULT_SAC_SAVE_OPS, apply_sac_pass
from ac_core.graph.blocks import block_regions, module_path
from ac_core.graph.save_ops import OpSet
from ac_core.graph.torch_compile import _outside_modules

from .graphs import RECOMPUTE, SAVE, GraphBuilder, policy

aten = torch.ops.aten


def test_addmm_takes_part_in_the_matmul_alternation():
    g = GraphBuilder()
    x, w = g.inputs.values()
    nodes = [
        g.op(target, x, w) for target in (aten.addmm.default, aten.mm.default, aten.addmm.default, aten.addmm.default)
    ]
    apply_sac_pass(g.module(nodes[-1]))
    assert [policy(n) for n in nodes] == [SAVE, RECOMPUTE, SAVE, RECOMPUTE]


def test_cpu_attention_kernel_is_saved_by_default():
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in DEFAULT_SAC_SAVE_OPS
    g = GraphBuilder()
    x, w = g.inputs.values()
    attention = g.op(aten._scaled_dot_product_flash_attention_for_cpu.default, x, w, w)
    out, lse = g.getitem(attention, 0), g.getitem(attention, 1)
    apply_sac_pass(g.module(out, lse))
    assert policy(attention) is SAVE
    assert policy(out) is None and policy(lse) is None


def _joint_graph_targets(fn, *inputs) -> list:
    """The call_function targets of the joint graph AOTAutograd traces for ``fn``."""
    from functorch.compile import aot_function, min_cut_rematerialization_partition, nop

    seen: list = []

    def partition(gm, joint_inputs, **kwargs):
        seen.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)

    aot_function(fn, fw_compiler=nop, partition_fn=partition)(*inputs).sum().backward()
    return seen


def test_math_attention_never_appears_as_a_node_so_listing_it_protects_nothing():
    assert "aten::_scaled_dot_product_attention_math" not in DEFAULT_SAC_SAVE_OPS
    q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))
    with sdpa_kernel(SDPBackend.MATH):
        targets = _joint_graph_targets(F.scaled_dot_product_attention, q, k, v)
    math = aten._scaled_dot_product_attention_math.default
    assert math not in targets
    assert aten.bmm.default in targets  # it decomposed into bmm and softmax while tracing
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        assert aten._scaled_dot_product_flash_attention_for_cpu.default in _joint_graph_targets(
            F.scaled_dot_product_attention, q, k, v
        )


def test_ops_are_matched_by_name_overload_packet_or_object():
    ops = OpSet(["aten::add", "aten::mul.Tensor", torch.ops.aten.relu, aten.sub.Tensor, "flex_attention"])
    assert aten.add.Tensor in ops and aten.add.Scalar in ops  # a name without overload: every overload
    assert aten.mul.Tensor in ops and aten.mul.Scalar not in ops
    assert aten.relu.default in ops  # a packet: every overload
    assert aten.sub.Tensor in ops and aten.sub.Scalar not in ops
    assert torch._higher_order_ops.flex_attention in ops  # a higher-order op by its name
    assert aten.mm.default not in ops and operator.getitem not in ops


@pytest.mark.parametrize(
    ("ops", "error"),
    [("aten::mm", TypeError), ([42], TypeError), ([""], ValueError)],
)
def test_malformed_save_sets_are_rejected(ops, error):
    g = GraphBuilder()
    x, w = g.inputs.values()
    gm = g.module(g.op(aten.mm.default, x, w))
    with pytest.raises(error, match="op"):
        apply_sac_pass(gm, ops)


@torch.library.custom_op("ac_core_test::named_attention", mutates_args=())
def _named_attention(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return q * k


def test_an_adapters_op_is_saved_by_its_name():
    g = GraphBuilder()
    x, w = g.inputs.values()
    node = g.op(torch.ops.ac_core_test.named_attention.default, x, w)
    apply_sac_pass(g.module(node), DEFAULT_SAC_SAVE_OPS | {"ac_core_test::named_attention"})
    assert policy(node) is SAVE


def test_only_the_forward_part_is_tagged():
    g = GraphBuilder(("primals_1", "primals_2", "tangents_1"))
    x, w, tangent = g.inputs.values()
    first = g.op(aten.mm.default, x, w)
    hidden = g.op(aten.relu.default, first)
    grad = g.op(aten.mul.Tensor, tangent, hidden)
    grad_mm = g.op(aten.mm.default, grad, w)  # a backward matmul: must not shift the alternation
    weight_t = g.op(aten.t.default, w)  # traced for backward, though it needs no tangent
    weight_t.meta["partitioner_tag"] = "is_backward"
    grad_in = g.op(aten.mm.default, grad_mm, weight_t)
    second = g.op(aten.mm.default, hidden, w)
    third = g.op(aten.mm.default, second, w)
    apply_sac_pass(g.module(third, grad_in))
    for node in (grad, grad_mm, weight_t, grad_in):
        assert "recompute" not in node.meta and "ac_graph_id" not in node.meta, node.name
    assert [policy(n) for n in (first, hidden, second, third)] == [SAVE, RECOMPUTE, RECOMPUTE, SAVE]


@pytest.mark.parametrize("target", [aten.rand_like.default, aten.native_dropout.default, aten.bernoulli.p])
def test_random_ops_are_never_recomputed(target):
    assert torch.Tag.nondeterministic_seeded in target.tags
    g = GraphBuilder()
    node = g.op(target, g.inputs["primals_1"])
    apply_sac_pass(g.module(node), retain=set())
    assert policy(node) is SAVE


def _toy_block_graph(g: GraphBuilder):
    """embed -> layers.0 (two ops) -> layers.1 (a multi-output op, then one op) -> head."""
    x, w = g.inputs.values()
    embed = g.op(aten.mul.Tensor, x, w, stack=[("embed", "Linear")])
    inner = g.op(aten.relu.default, embed, stack=[("layers.0", "Block"), ("layers.0.act", "ReLU")])
    out0 = g.op(aten.add.Tensor, inner, embed, stack=[("layers.0", "Block")])
    norm = g.op(aten.native_layer_norm.default, out0, stack=[("layers.1", "Block"), ("layers.1.norm", "LayerNorm")])
    normed = g.getitem(norm, 0)
    out1 = g.op(aten.add.Tensor, normed, out0, stack=[("layers.1", "Block")])
    head = g.op(aten.mul.Tensor, out1, w, stack=[("head", "Linear")])
    return embed, inner, out0, norm, normed, out1, head


def test_values_crossing_a_block_boundary_are_saved():
    g = GraphBuilder()
    embed, inner, out0, norm, normed, out1, head = _toy_block_graph(g)
    apply_sac_pass(g.module(head))
    assert policy(embed) is SAVE  # into layers.0 (and layers.0's residual)
    assert policy(inner) is RECOMPUTE  # stays inside layers.0
    assert policy(out0) is SAVE  # into layers.1
    assert policy(norm) is RECOMPUTE and policy(normed) is None
    assert policy(out1) is SAVE  # into the head
    assert policy(head) is SAVE  # outside every block: not checkpointed, as under eager checkpointing


def test_a_graph_without_blocks_is_checkpointed_whole():
    # One block compiled on its own: module stacks, but no container of blocks in them.
    g = GraphBuilder()
    x, w = g.inputs.values()
    norm = g.op(aten.relu.default, x, stack=[("norm", "LayerNorm")])
    proj = g.op(aten.mul.Tensor, norm, w, stack=[("attn", "Attention"), ("attn.to_out.0", "Linear")])
    out = g.op(aten.add.Tensor, proj, x)
    apply_sac_pass(g.module(out))
    assert [policy(n) for n in (norm, proj, out)] == [RECOMPUTE] * 3


def _prelude() -> tuple[GraphBuilder, list[fx.Node]]:
    # The model's own forward before a graph break that comes ahead of its blocks (HunyuanVideo 1.5).
    g = GraphBuilder()
    x, w = g.inputs.values()
    emb = g.op(aten.mul.Tensor, x, w, stack=[("time_embed", "Timesteps"), ("time_embed.linear_1", "Linear")])
    act = g.op(aten.silu.default, emb)
    return g, [emb, act]


def test_a_graph_cut_off_before_the_blocks_is_saved_whole_when_its_modules_are_outside():
    g, nodes = _prelude()
    blocks = {"blocks.0", "blocks.1"}
    apply_sac_pass(g.module(nodes[-1]), blocks=blocks, outside_modules={"time_embed", "time_embed.linear_1"})
    assert [policy(n) for n in nodes] == [SAVE, SAVE]


def test_a_graph_without_blocks_and_no_outside_module_is_still_checkpointed_whole():
    for outside in (None, {"proj_out"}):  # not told, or told of other modules only
        g, nodes = _prelude()
        apply_sac_pass(g.module(nodes[-1]), blocks={"blocks.0"}, outside_modules=outside)
        assert [policy(n) for n in nodes] == [RECOMPUTE, RECOMPUTE]


def test_outside_modules_leave_out_what_a_frame_rooted_in_a_block_could_spell():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj_out = nn.Linear(2, 2)
            self.attn = nn.Sequential(nn.Linear(2, 2))

    model = nn.Module()
    model.time_embed = nn.Sequential(nn.Linear(2, 2))
    model.proj_out = nn.Linear(2, 2)  # also a block's submodule's name: ambiguous, left out
    model.blocks = nn.ModuleList([Block(), Block()])
    outside = _outside_modules(model, frozenset({"blocks.0", "blocks.1"}))
    assert outside == {"time_embed", "time_embed.0", "blocks"}


def test_a_getitem_crossing_a_boundary_saves_its_producer():
    g = GraphBuilder()
    norm = g.op(
        aten.native_layer_norm.default,
        g.inputs["primals_1"],
        stack=[("layers.0", "Block"), ("layers.0.norm", "LayerNorm")],
    )
    normed = g.getitem(norm, 0)
    later = g.op(aten.relu.default, normed, stack=[("layers.1", "Block")])
    apply_sac_pass(g.module(later))
    assert policy(norm) is SAVE and policy(normed) is None


def test_blocks_are_found_as_uniform_items_of_an_indexed_container():
    g = GraphBuilder()
    x, w = g.inputs.values()
    # A FeedForward's ModuleList of a GELU and a Linear is no container of blocks.
    gelu = g.op(aten.gelu.default, x, stack=[("ff", "FeedForward"), ("ff.net.0", "GELU")])
    proj = g.op(aten.mm.default, gelu, w, stack=[("ff", "FeedForward"), ("ff.net.2", "Linear")])
    # A Sequential is called, so it sits on the stack: its items are no blocks either.
    seq = g.op(aten.relu.default, proj, stack=[("mlp", "Sequential"), ("mlp.0", "ReLU")])
    # Nor is a lone item: an attention's to_out.0 beside a dropout that left no node.
    out = g.op(aten.relu.default, seq, stack=[("attn", "Attention"), ("attn.to_out.0", "Linear")])
    first = g.op(aten.relu.default, out, stack=[("blocks.3", "Block"), ("blocks.3.net.0", "GELU")])
    second = g.op(aten.relu.default, first, stack=[("blocks.4", "Block")])
    bare = g.op(aten.relu.default, second)
    regions = block_regions([gelu, proj, seq, out, first, second, bare])
    assert regions == {
        gelu: None,
        proj: None,
        seq: None,
        out: None,
        first: "blocks.3",
        second: "blocks.4",
        bare: None,  # no module stack: the compiled module's own code
    }


def test_named_blocks_are_matched_also_below_a_wrapper():
    g = GraphBuilder()
    inner = g.op(
        aten.relu.default,
        g.inputs["primals_1"],
        stack=[("model", "Llama"), ("model.layers.0", "Layer"), ("model.layers.0.mlp", "MLP")],
    )
    refiner = g.op(aten.relu.default, inner, stack=[("refiner", "Refiner"), ("refiner.blocks.0", "Block")])
    regions = block_regions([inner, refiner], blocks=["layers.0", "layers.1"])
    # An adapter's excluded container (a refiner) is not a block, though the heuristic would take it.
    assert regions == {inner: "model.layers.0", refiner: None}
    with pytest.raises(TypeError, match="collection of block FQNs"):
        apply_sac_pass(g.module(refiner), blocks="layers.0")


@pytest.mark.parametrize(
    ("expression", "path"),
    [
        ("L['self'].layers.0.attn", "layers.0.attn"),
        ("L['self'].__dict__['_modules']['transformer_blocks'].1.attn.to_out.0", "transformer_blocks.1.attn.to_out.0"),
        ("L['self'].model.layers[2]", "model.layers.2"),
        ("getattr(L['self'].blocks, '4').norm", "blocks.4.norm"),
        ("L['self']", ""),
        ("L['args'][0].model.layers.3", "model.layers.3"),  # a module whose forward is wrapped
    ],
)
def test_module_paths_are_read_from_dynamo_expressions(expression, path):
    assert module_path(expression) == path
