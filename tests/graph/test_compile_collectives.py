"""The graph route keeps the collectives that move activations, as eager ``ops`` does: under ``ac_core.compile(model,
Ops())`` a Ulysses toy's backward runs none of its forward's all-to-alls again; a parameter's all-to-all is never
saved where an activation's is; without the partitioner's static inputs nothing is saved by name.

Counted on the partitioned graphs of one compiled step (``aot_eager``), on 2 stand-in ranks (torch's fake process
group: collectives return at once with the right shapes, so what is partitioned is what 2 real ranks partition).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import CheckpointPolicy

from ac_core import Full, ModelCase, Ops, apply_sac_pass
from ac_core.graph.forward_part import forward_ops
from ac_core.measure.captured import capture_joint_graphs
from ac_core.measure.compiled import compiled_activations
from ac_core.testing import TOY_ADAPTER, TOY_CONTEXT_PARALLEL, toy_case, ulysses_attention

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built")

A2A = "_c10d_functional::all_to_all_single"
GATHER = "_c10d_functional::all_gather_into_tensor"
WAIT = "_c10d_functional::wait_tensor"
WORLD, DEPTH, TOKENS, BATCH, DIM, HEADS = 2, 2, 16, 2, 32, 4
SHARE = BATCH * (TOKENS // WORLD) * DIM * 4  # one all-to-all's output on a rank, float32


@pytest.fixture
def stand_in_ranks() -> Iterator[None]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _parallel(mode: str):
    case = toy_case(dim=DIM, heads=HEADS, depth=DEPTH, tokens=TOKENS, batch=BATCH)
    TOY_CONTEXT_PARALLEL.enable(case.model, mode)
    case.inputs = TOY_CONTEXT_PARALLEL.shard(case.inputs)
    return case


def _collectives(recomputed: Mapping[str, int]) -> dict[str, int]:
    return {op: n for op, n in recomputed.items() if op.startswith("_c10d_functional::")}


def test_ops_keeps_ulysses_all_to_alls_and_full_runs_them_again(stand_in_ranks):
    kept = compiled_activations(_parallel("ulysses"), sac=True, policy=Ops(), adapter=TOY_ADAPTER)
    assert _collectives(kept.recomputed) == {}
    refused = compiled_activations(_parallel("ulysses"), sac=True, policy=Ops(collectives=False), adapter=TOY_ADAPTER)
    assert _collectives(refused.recomputed) == {A2A: 4 * DEPTH, WAIT: 4 * DEPTH}
    # What keeping them costs: the four outputs of each block's all-to-alls, one rank's share each.
    assert kept.saved_bytes - refused.saved_bytes == 4 * DEPTH * SHARE
    full = compiled_activations(_parallel("ulysses"), sac=True, policy=Full(), adapter=TOY_ADAPTER)
    assert _collectives(full.recomputed) == {A2A: 4 * DEPTH, WAIT: 4 * DEPTH}


def test_the_ring_gather_is_kept_only_where_named(stand_in_ranks):
    # The toy declares Ulysses' all-to-all alone: the ring's key-value gather is recomputed unless retain names it.
    default = compiled_activations(_parallel("ring"), sac=True, policy=Ops(), adapter=TOY_ADAPTER)
    assert _collectives(default.recomputed) == {GATHER: DEPTH, WAIT: DEPTH}
    named = compiled_activations(_parallel("ring"), sac=True, policy=Ops(retain={GATHER}), adapter=TOY_ADAPTER)
    assert _collectives(named.recomputed) == {}


class _ShardedWeightBlock(torch.nn.Module):
    """Trades its weight's shards with an all-to-all (a parameter collective), then attends with Ulysses (whose
    all-to-alls move activations): one op, two kinds of data."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(DIM, DIM) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed import _functional_collectives as funcol

        weight = funcol.wait_tensor(funcol.all_to_all_single(self.weight, None, None, dist.group.WORLD))
        b, n, d = x.shape
        heads = (x @ weight.t()).view(b, n, HEADS, d // HEADS).transpose(1, 2)
        return x + ulysses_attention(heads, heads, heads).transpose(1, 2).reshape(b, n, d)


class _ShardedWeightModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_ShardedWeightBlock() for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _a2a_tags(static: bool) -> list[tuple[bool, bool]]:
    """Per forward all-to-all of the sharded-weight model's joint graph, after the pass with the all-to-all as an
    activation collective: (whether it moves the weight, whether it is saved)."""
    torch.manual_seed(0)
    case = ModelCase(_ShardedWeightModel(), {"x": torch.randn(BATCH, TOKENS // WORLD, DIM)}, lambda y: y.pow(2).mean())
    (joint,) = capture_joint_graphs(case, blocks=["layers"]).joints
    indices = joint.kwargs["static_lifetime_input_indices"] if static else None
    apply_sac_pass(joint.graph, blocks=["layers.0", "layers.1"], activation_collectives={A2A}, static_inputs=indices)
    placeholders = [n for n in joint.graph.graph.nodes if n.op == "placeholder"]
    weights = {placeholders[i] for i in joint.kwargs["static_lifetime_input_indices"]}
    return [
        (node.args[0] in weights, node.meta.get("recompute") == CheckpointPolicy.MUST_SAVE)
        for node in forward_ops(joint.graph.graph)
        if node.target is torch.ops._c10d_functional.all_to_all_single.default
    ]


def test_a_parameter_all_to_all_is_never_saved_where_the_activation_ones_are(stand_in_ranks):
    # Per block: the weight's all-to-all, then q, k, v and the output's.
    assert _a2a_tags(static=True) == [(True, False), *[(False, True)] * 4] * DEPTH


def test_without_static_inputs_no_collective_is_saved_by_name(stand_in_ranks):
    assert _a2a_tags(static=False) == [(True, False), *[(False, False)] * 4] * DEPTH
