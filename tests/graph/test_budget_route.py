"""ac_core.compile with a checkpoint plan or a memory budget: the plan's decisions on the graph, or torch's budget."""

from __future__ import annotations

import dataclasses
import logging
import operator

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.utils.checkpoint import CheckpointPolicy

import ac_core
from ac_core import BlockDecision
from ac_core.budget import Budget, plan_activation_checkpointing
from ac_core.experiments import compare_budgets
from ac_core.graph.keep_planned import keep_planned
from ac_core.measure import CompiledOpCounter
from ac_core.measure.compiled import compiled_activations
from ac_core.testing import toy_case

from ..core.helpers import assert_same_training, loss_and_grads

BLOCKS = ["layers"]
CPU_ATTENTION = ["aten::_scaled_dot_product_flash_attention_for_cpu"]
# What compiling recomputes beyond the plan's prediction: the partitioner also saves the RNG state of each
# attention call it recomputes (a CPU generator state: 5,056 bytes), which eager does not need.
RNG_STATE_BYTES = 5056


def _plan(fraction: float, **toy):
    case = toy_case(**toy)
    return case, plan_activation_checkpointing(case.model, case.inputs, fraction, blocks=BLOCKS)


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_plan_on_the_graph_holds_what_it_planned_and_trains_like_eager(caplog, fraction):
    case, plan = _plan(fraction)
    with caplog.at_level(logging.WARNING, logger="ac_core"):
        measured = compiled_activations(case, sac=True, policy=plan, blocks=BLOCKS)
    assert not caplog.records  # every planned occurrence found a node
    recomputed_attention = sum(b.mode != "none" and ("aten::_scaled_dot_product_flash_attention_for_cpu", 0)
                               not in b.keep for b in plan.blocks)  # fmt: skip
    assert measured.saved_bytes <= plan.held_bytes + recomputed_attention * RNG_STATE_BYTES
    assert measured.saved_bytes <= plan.budget_bytes * 1.05
    assert measured.recompute_flops <= plan.recompute_flops
    assert (measured.recompute_flops == 0) == (plan.recompute_flops == 0)
    case.model.zero_grad(set_to_none=True)
    expected = loss_and_grads(toy_case())
    case = toy_case()
    case.model = ac_core.compile(case.model, plan, blocks=BLOCKS, backend="aot_eager")
    assert_same_training(loss_and_grads(case), expected)


def test_attention_is_recomputed_exactly_where_the_plan_says():
    case, plan = _plan(0.25)
    kept = [("aten::_scaled_dot_product_flash_attention_for_cpu", 0) in b.keep for b in plan.blocks]
    assert kept.count(False) >= 2, plan  # the test needs blocks that recompute attention
    model = ac_core.compile(case.model, plan, blocks=BLOCKS, backend="aot_eager")
    case.loss(model(**case.inputs)).backward()  # compiled outside the counter
    with CompiledOpCounter() as ops:
        case.loss(model(**case.inputs)).backward()
    assert ops.count(CPU_ATTENTION, "backward") == kept.count(False)


def test_torch_solver_sets_its_budget_for_this_compile_only():
    plain = compiled_activations(toy_case())
    case = toy_case()
    measured = compiled_activations(
        case, sac=True, policy=Budget(0.25, example_inputs=case.inputs), solver="torch", blocks=BLOCKS
    )
    assert measured.saved_bytes < plain.saved_bytes / 2
    assert measured.recompute_flops > 0
    assert torch._functorch.config.activation_memory_budget == 1.0  # set around the partitioner, then restored
    expected = loss_and_grads(toy_case())
    case = toy_case()
    case.model = ac_core.compile(
        case.model, Budget(0.25, example_inputs=case.inputs), solver="torch", blocks=BLOCKS, backend="aot_eager"
    )
    assert_same_training(loss_and_grads(case), expected)


def test_budget_is_planned_then_compiled():
    case = toy_case()
    plan = plan_activation_checkpointing(case.model, case.inputs, 0.5, blocks=BLOCKS)
    case.model = ac_core.compile(
        case.model, Budget(0.5, example_inputs=case.inputs), blocks=BLOCKS, backend="aot_eager"
    )
    with CompiledOpCounter() as ops:
        case.loss(case.model(**case.inputs)).backward()
    recomputes = sum(b.mode != "none" for b in plan.blocks)
    assert recomputes and ops.count(["aten::addmm"], "backward") > 0


def test_compare_budgets_puts_both_solvers_side_by_side():
    (result,) = compare_budgets(lambda: toy_case(depth=2, dim=32, tokens=16), [0.3], blocks=BLOCKS)
    assert result.plan.budget_bytes == int(0.3 * result.plan.none_bytes)
    assert result.ours.recompute_flops <= result.plan.recompute_flops
    assert result.torch.recompute_flops > 0
    assert result.recompute_ratio == result.ours.recompute_flops / result.torch.recompute_flops


def test_bad_combinations_are_refused_before_the_model_changes():
    case, plan = _plan(0.5)
    with pytest.raises(ValueError, match="solver='torch'"):
        ac_core.compile(case.model, plan, blocks=BLOCKS, solver="torch")
    with pytest.raises(ValueError, match="choose one of 'ac-core', 'torch'"):
        ac_core.compile(case.model, plan, blocks=BLOCKS, solver="scipy")
    with pytest.raises(ValueError, match=r"ac_core\.Budget"):
        ac_core.compile(case.model, "ops", blocks=BLOCKS, solver="torch")
    with pytest.raises(ValueError, match="eager mode only"):
        ac_core.compile(case.model, Budget(0.5, example_inputs=case.inputs, offload=True), blocks=BLOCKS)
    shallower = toy_case(depth=3)
    with pytest.raises(ValueError, match="4 blocks and the model has 3"):
        ac_core.compile(shallower.model, plan, blocks=BLOCKS)


def test_inductor_options_carry_torch_budget_in_the_cache_key():
    route = ac_core.GraphRoute(memory_budget=0.4)
    options = route.inductor_options()
    partitioner = options["custom_partitioner_fn"]
    assert (
        partitioner.uuid() != ac_core.GraphRoute(memory_budget=0.5).inductor_options()["custom_partitioner_fn"].uuid()
    )
    with pytest.raises(ValueError, match="custom_partitioner_fn"):
        route.inductor_options({"custom_partitioner_fn": partitioner})
    with pytest.raises(ValueError, match=r"fraction in \[0, 1\]"):
        ac_core.GraphRoute(memory_budget=1.5)


def test_inductor_follows_the_plan():
    case, plan = _plan(0.25, depth=2, dim=32, tokens=16)
    expected = loss_and_grads(toy_case(depth=2, dim=32, tokens=16))
    case.model = ac_core.compile(case.model, plan, blocks=BLOCKS, backend="inductor")
    # CPU inductor cannot replay a recomputed attention kernel's RNG state, so attention is kept there.
    assert_same_training(loss_and_grads(case), expected, atol=1e-6)


class _Twice(torch.nn.Module):
    """One block called twice in a forward (a chunked encoder): dynamo marks the second call ``@1``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[0](self.layers[0](x).relu())


def test_occurrences_count_per_call_of_a_block():
    tags: dict[str, object] = {}

    def partition(gm, joint_inputs, **kwargs):
        found = keep_planned(gm.graph, [BlockDecision("layers.0", "ops", (("aten::addmm", 1),))])
        tags["found"] = found
        tags["kept"] = [
            n.name for n in gm.graph.nodes if n.meta.get("recompute") is CheckpointPolicy.MUST_SAVE
            and n.target is not operator.getitem
        ]  # fmt: skip
        return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)

    backend = aot_autograd(fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g, partition_fn=partition)
    torch.compile(_Twice(), backend=backend)(torch.randn(2, 8, requires_grad=True)).sum().backward()
    # The second Linear of each call: its second addmm, in both calls.
    assert tags["found"] == (2, 0)
    assert tags["kept"] == ["addmm_1", "addmm_3"]


def test_the_compiled_model_refuses_inputs_of_other_shapes():
    case, plan = _plan(0.5)
    model = ac_core.compile(case.model, plan, blocks=BLOCKS, backend="aot_eager")
    model(case.inputs["x"]).sum().backward()  # by position as well as by keyword
    longer = toy_case(tokens=64)
    with pytest.raises(ValueError, match=r"made for inputs \(x: \[2, 32, 64\] float32\) and got \(0: \[2, 64, 64\]"):
        model(longer.inputs["x"])


@pytest.mark.parametrize(
    ("outside", "free", "inputs"),
    [("held", "torch_rules", "held"), ("recomputed", "fewest_bytes", "held"), ("held", "fewest_bytes", "recomputable")],
)
def test_a_plans_compiled_layout_reaches_the_pass_and_trains_like_eager(outside, free, inputs):
    case, plan = _plan(0.5)
    laid = dataclasses.replace(plan, compile_outside=outside, compile_free=free, compile_block_inputs=inputs)
    assert ac_core.CheckpointPlan.from_json(laid.to_json()) == laid
    default = compiled_activations(toy_case(), sac=True, policy=plan, blocks=BLOCKS)
    measured = compiled_activations(toy_case(), sac=True, policy=laid, blocks=BLOCKS)
    norms = ["aten::native_layer_norm"]
    assert default.recomputes(norms) > 0  # at fewest bytes the partitioner recomputes the blocks' norms
    if free == "torch_rules":
        assert measured.recomputes(norms) == 0  # torch's rules save a norm
        assert measured.saved_bytes > default.saved_bytes
    else:  # the embedding outside the blocks, or the previous block's ops: more FLOPs for fewer bytes
        assert measured.recompute_flops > default.recompute_flops
        assert measured.saved_bytes < default.saved_bytes
    expected = loss_and_grads(toy_case())
    case = toy_case()
    case.model = ac_core.compile(case.model, laid, blocks=BLOCKS, backend="aot_eager")
    assert_same_training(loss_and_grads(case), expected)


def test_a_plans_layout_is_one_of_the_named_ones_and_keys_inductors_cache():
    _, plan = _plan(0.5)
    with pytest.raises(ValueError, match="compile_free='torch': choose one of 'fewest_bytes', 'torch_rules'"):
        dataclasses.replace(plan, compile_free="torch")
    with pytest.raises(ValueError, match="compile_outside='none': choose one of 'held', 'recomputed'"):
        dataclasses.replace(plan, compile_outside="none")
    with pytest.raises(ValueError, match="compile_block_inputs='free': choose one of 'held', 'recomputable'"):
        dataclasses.replace(plan, compile_block_inputs="free")
    decisions = [BlockDecision(b.path, b.mode, keep=b.keep) for b in plan.blocks]
    uuids = {
        ac_core.GraphRoute(
            decisions=tuple(decisions), recompute_free=True, free_by_torch=free, recompute_block_inputs=r
        )
        .inductor_options()["custom_partitioner_fn"]
        .uuid()
        for free in (False, True)
        for r in (False, True)
    }
    assert len(uuids) == 4
