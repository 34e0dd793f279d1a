"""On CPU inductor, dropout under the pass partitions without RNG replay: random ops are saved."""

from __future__ import annotations

import pytest
import torch
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomPartitionerFn

import ac_core.graph.sac
from ac_core import GraphRoute
from ac_core.testing import toy_case


class _Stop(Exception):
    """Raised once the joint graph is partitioned: what follows (code generation) is not under test."""


class _PartitionThenStop(CustomPartitionerFn):
    def __init__(self) -> None:
        self.forward_targets: list = []

    def __call__(self, gm, joint_inputs, **kwargs):
        fw, _ = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        self.forward_targets = [n.target for n in fw.graph.nodes if n.op == "call_function"]
        raise _Stop

    def uuid(self) -> None:
        return None


@pytest.mark.parametrize("rule", [True, False], ids=["saved", "recomputed"])
def test_dropout_needs_no_rng_replay(monkeypatch, rule):
    if not rule:  # the seed's behaviour: a random op is as recomputable as any other
        monkeypatch.setattr(ac_core.graph.sac, "save_rng", lambda graph, **_: 0)
    case = toy_case(depth=1, dim=32, tokens=16, dropout=0.1)
    partitioner = _PartitionThenStop()
    options = GraphRoute().inductor_options({"custom_partitioner_fn": partitioner})
    compiled = torch.compile(case.model, backend="inductor", options=options)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="_Stop"):
        case.loss(compiled(**case.inputs)).backward()
    replay = torch.ops.higher_order.run_and_save_rng_state
    # Recomputing a random op needs its RNG state replayed, which CPU inductor cannot lower
    # ("Backend not supported for None" on run_and_save_rng_state); saving it needs no replay.
    assert (replay in partitioner.forward_targets) is not rule
    if rule:  # inductor's seed op runs once, in forward, and its seeds are what backward gets
        assert torch.ops.prims.inductor_seeds.default in partitioner.forward_targets
