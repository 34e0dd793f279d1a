"""ac_core.compile: the graph route end to end on the toy stack, with both backends and dynamic shapes."""

from __future__ import annotations

import dataclasses
import logging
from typing import ClassVar

import pytest
import torch

import ac_core
from ac_core import CheckpointType, GraphRoute, checkpointed_blocks
from ac_core.measure import CompiledOpCounter, OpCounter
from ac_core.policies import unregister_policy
from ac_core.testing import toy_case

from ..core.helpers import assert_same_training, loss_and_grads

CPU_ATTENTION = ["aten::_scaled_dot_product_flash_attention_for_cpu"]


@pytest.fixture
def eager_only_full():
    """A policy registered with a reason instead of graph decisions: ac_core.compile checkpoints it eagerly."""

    @dataclasses.dataclass(frozen=True)
    class EagerFull(ac_core.PolicyConfig):
        name: ClassVar[str] = "eager_full"

    ac_core.register_policy(EagerFull, graph="checkpointed eagerly by choice, for this test")(
        lambda config, blocks: [ac_core.BlockSelection(b, ac_core.BlockMode.FULL) for b in blocks]
    )
    yield EagerFull
    unregister_policy(EagerFull)


def _pass_runs(caplog) -> int:
    return sum("graph SAC pass" in r.getMessage() for r in caplog.records)


def test_aot_eager_route_trains_like_eager_and_keeps_attention(caplog):
    expected = loss_and_grads(toy_case(depth=3))
    case = toy_case(depth=3)
    with caplog.at_level(logging.INFO, logger="ac_core"):
        case.model = ac_core.compile(case.model, backend="aot_eager")
        got = loss_and_grads(case)
    assert _pass_runs(caplog) == 1
    assert_same_training(got, expected)
    with CompiledOpCounter() as ops:
        case.run().backward()
    assert ops.count(CPU_ATTENTION) == 3
    assert ops.count(CPU_ATTENTION, "backward") == 0
    # The compiled code ran: backward recomputes the unsaved matmuls (qkv and mlp.0 of each block).
    assert ops.count(["aten::addmm"], "backward") == 2 * 3
    # A plain OpCounter makes torch.compile fall back to eager, which recomputes nothing.
    with OpCounter() as eager_ops:
        case.run().backward()
    assert eager_ops.count(["aten::addmm"], "backward") == 0


def _train_on_lengths(compiled, lengths, atol: float = 0.0) -> None:
    """Train ``compiled`` (the toy, depth 2) on each token count like eager; attention never re-runs."""
    for tokens in lengths:
        expected = loss_and_grads(toy_case(depth=2, tokens=tokens))
        compiled.zero_grad(set_to_none=True)
        case = toy_case(depth=2, tokens=tokens)
        case.model = compiled
        assert_same_training(loss_and_grads(case), expected, atol=atol)  # compiles outside the counter
        with CompiledOpCounter() as ops:
            case.run().backward()
        assert ops.count(CPU_ATTENTION) == 2
        assert ops.count(CPU_ATTENTION, "backward") == 0


def test_inductor_route(caplog):
    # Caches off so the pass is seen to run: a warm cache would serve the graph it tagged before.
    with (
        caplog.at_level(logging.INFO, logger="ac_core"),
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        _train_on_lengths(ac_core.compile(toy_case(depth=2).model, backend="inductor"), [16], atol=1e-5)
    assert _pass_runs(caplog) == 1


@pytest.mark.parametrize(("dynamic", "compiles"), [(True, 1), (None, 2)])
def test_dynamic_shapes(caplog, dynamic, compiles):
    # Local PGO off: shapes seen by earlier runs on this machine would make the first compile dynamic.
    with caplog.at_level(logging.INFO, logger="ac_core"), torch._dynamo.config.patch(automatic_dynamic_local_pgo=False):
        compiled = ac_core.compile(toy_case(depth=2).model, backend="aot_eager", dynamic=dynamic)
        _train_on_lengths(compiled, [16, 24, 40])
    # dynamic=True: one graph for all lengths. Automatic dynamic: static for the first length, then
    # one recompile with dynamic shapes that serves the rest.
    assert _pass_runs(caplog) == compiles


def test_dropout_trains_like_eager():
    reference = toy_case(depth=2, dropout=0.1)
    torch.manual_seed(7)
    expected = loss_and_grads(reference)
    case = toy_case(depth=2, dropout=0.1)
    case.model = ac_core.compile(case.model, backend="aot_eager")
    torch.manual_seed(7)
    # The same masks as eager: dropout runs once, in forward, and backward reads what it saved.
    assert_same_training(loss_and_grads(case), expected)


@pytest.mark.parametrize(
    ("kind", "whole"), [(ac_core.Full(), 2), (ac_core.BlockSkip(every=2), 1)], ids=["full", "skip"]
)
def test_every_policy_with_selections_takes_the_graph_route(caplog, kind, whole):
    # Its selections become the pass's decisions: no eager checkpointing, and backward re-runs attention in
    # exactly the blocks it recomputes whole (block_skip: block 0 of 2), where eager checkpointing would too.
    expected = loss_and_grads(toy_case(depth=2))
    case = toy_case(depth=2)
    with caplog.at_level(logging.INFO, logger="ac_core"):
        case.model = ac_core.compile(case.model, kind, blocks=["layers"], backend="aot_eager")
        assert_same_training(loss_and_grads(case), expected)
    assert checkpointed_blocks(case.model) == {} and _pass_runs(caplog) == 1
    with CompiledOpCounter() as ops:
        case.run().backward()
    assert ops.count(CPU_ATTENTION) == 2
    assert ops.count(CPU_ATTENTION, "backward") == whole


def test_bad_backends_and_options_are_rejected_before_the_model_changes():
    case = toy_case(depth=1)
    ac_core.apply_activation_checkpointing(case.model, "full", blocks=["layers"])
    with pytest.raises(ValueError, match="backend='inductor' or 'aot_eager'"):
        ac_core.compile(case.model, backend="eager")
    with pytest.raises(ValueError, match="inductor options"):
        ac_core.compile(case.model, backend="aot_eager", options={"max_autotune": True})
    with pytest.raises(TypeError, match="dispatcher names"):
        ac_core.compile(case.model, backend="aot_eager", retain=[3.5])
    with pytest.raises(ac_core.AdapterError, match="'blocks'"):  # named blocks are checked as for eager
        ac_core.compile(case.model, blocks=["blocks"], backend="aot_eager")
    assert checkpointed_blocks(case.model) == {"layers.0": CheckpointType.FULL}


def test_mode_is_spelled_as_options_for_inductor():
    # torch.compile refuses mode and options together; ours needs options for the pass.
    compiled = ac_core.compile(toy_case(depth=1).model, mode="max-autotune-no-cudagraphs")
    assert isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule)


def test_inductor_options_keep_the_callers_passes_and_partitioner_and_key_the_cache():
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    def theirs(graph: torch.fx.Graph) -> None:
        return None

    class Their(CustomPartitionerFn):
        def __call__(self, gm, joint_inputs, **kwargs):
            raise AssertionError("not run here")

        def uuid(self) -> str:
            return "theirs"

    partitioner = Their()
    options = GraphRoute().inductor_options(
        {"joint_custom_post_pass": theirs, "custom_partitioner_fn": partitioner, "max_autotune": False}
    )
    ours = options["custom_partitioner_fn"]
    # Their joint pass runs as before ours; their partitioner partitions the graph ours tagged.
    assert options["joint_custom_post_pass"] is theirs and ours.inner is partitioner
    assert options["max_autotune"] is False
    same = GraphRoute().inductor_options()["custom_partitioner_fn"]
    other = GraphRoute(ac_core.DEFAULT_SAC_SAVE_OPS | {"mylib::attn"}).inductor_options()["custom_partitioner_fn"]
    kept = GraphRoute(activation_collectives=frozenset({"_c10d_functional::all_to_all_single"}))
    assert len({same.uuid(), other.uuid(), kept.inductor_options()["custom_partitioner_fn"].uuid(), ours.uuid()}) == 4


def test_dynamic_eager_policy_names_the_upstream_failure_and_the_ways_that_work(eager_only_full):
    case = toy_case(depth=2)
    with pytest.raises(ValueError, match=r"193194.*'ops', dynamic=True.*specialize_float = True"):
        ac_core.compile(case.model, eager_only_full(), dynamic=True, backend="aot_eager", blocks=["layers"])
    assert checkpointed_blocks(case.model) == {}  # refused before anything changed
    expected = loss_and_grads(toy_case(depth=2))
    # torch's own config patch: it restores the option (pytest's monkeypatch cannot, on dynamo's config module).
    with torch._dynamo.config.patch(specialize_float=True):
        compiled = ac_core.compile(case.model, eager_only_full(), dynamic=True, backend="aot_eager", blocks=["layers"])
        assert checkpointed_blocks(case.model) == {"layers.0": CheckpointType.FULL, "layers.1": CheckpointType.FULL}
        case.model = compiled
        assert_same_training(loss_and_grads(case), expected)
