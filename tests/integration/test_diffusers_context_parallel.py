"""diffusers' Ulysses context parallelism (``ContextParallelConfig(ulysses_degree=2)``, ``enable_parallelism``)
under ac-core, on the tiny Wan and Flux models over 2 gloo ranks on CPU.

One set of ranks per model runs every setup: the model without checkpointing, and under ``full`` and ``ops``
applied before and after ``enable_parallelism``, two steps each. Against the run without checkpointing, on every rank
and at every step (the first included): gradients bit-equal; every block's first call checkpointed, whichever
was set up first; attention kernels and all-to-alls run again in backward, counted: all of them under
``full``, none beyond the plain backward's under ``ops``.

The models are switched as the adapters declare it (``ac_core.libraries.diffusers_parallel``), which on a build
without an accelerator counts the CPU as the one device while diffusers picks each rank's (``rank %
torch.accelerator.device_count()``, a division by zero there). Ulysses on diffusers' ``native`` backend needs
nothing else; its ring needs an attention op that returns the log-sum-exp, which ``native`` does not, so it does
not run on CPU (see the README).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from ac_core import ModelCase, apply_activation_checkpointing, resolve_blocks
from ac_core.libraries.diffusers_parallel import enable_context_parallel, whole_inputs
from ac_core.measure import OpCounter
from ac_core_conformance.distributed import _finish_rank, _run_ranks
from ac_core_conformance.probes import capture_logs

pytest.importorskip("diffusers")
flux = pytest.importorskip("ac_core_adapters.models.flux")
wan = pytest.importorskip("ac_core_adapters.models.wan")

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with gloo is not built",
)

WORLD = 2
TIMEOUT_S = 300.0
STEPS = 2
ALL_TO_ALL = "_c10d_functional::all_to_all_single"
ATTENTION = "aten::_scaled_dot_product_flash_attention_for_cpu"
# (policy, set up before or after enable_parallelism); None: the parallel run without checkpointing.
SETUPS: list[tuple[str | None, str]] = [(None, ""), ("full", "before"), ("full", "after")]
SETUPS += [("ops", "before"), ("ops", "after")]


@dataclass(frozen=True)
class Tiny:
    make: Callable[[], ModelCase]
    blocks: int
    ulysses_calls: int  # attention calls per forward that go through Ulysses (4 all-to-alls each)


# Wan: 3 blocks, whose self-attention is context parallel (the text cross-attention is not). Flux: 3 double and 3
# single blocks, one joint attention each.
TINIES = {"wan": Tiny(wan.tiny_wan, 3, 3), "flux": Tiny(flux.tiny_flux, 6, 6)}


def _count_run(runs: list[int], *_: Any) -> None:
    runs[0] += 1


def _steps(name: str, policy: str | None, order: str) -> dict[str, Any]:
    """Two steps of ``name`` under ``policy`` set up ``order`` enable_parallelism, as this rank sees them."""
    case = TINIES[name].make()
    case.inputs = whole_inputs(case.inputs)  # return_dict=False: diffusers' split hook reads a tuple
    runs = [0]
    for block in resolve_blocks(case.model):  # counts each block's runs, forward and recompute alike
        next(block.module.children()).register_forward_pre_hook(functools.partial(_count_run, runs))
    if policy is not None and order == "before":
        apply_activation_checkpointing(case.model, policy)
    enable_context_parallel(case.model, "ulysses")
    if policy is not None and order == "after":
        apply_activation_checkpointing(case.model, policy)
    steps = []
    with capture_logs(level=logging.INFO) as records:
        for _ in range(STEPS):
            case.model.zero_grad(set_to_none=True)
            with OpCounter() as ops:
                loss = case.run()
                forward_runs = runs[0]
                loss.backward()
            steps.append(
                {
                    "loss": loss.detach(),
                    "grads": {n: p.grad.clone() for n, p in case.model.named_parameters() if p.grad is not None},
                    "forward": {op: ops.count([op]) for op in (ALL_TO_ALL, ATTENTION)},
                    "backward": {op: ops.count([op], "backward") for op in (ALL_TO_ALL, ATTENTION)},
                    "recomputed_blocks": runs[0] - forward_runs,
                }
            )
            runs[0] = 0
    return {"steps": steps, "sat_out": [r.getMessage() for r in records if "sat out" in r.getMessage()]}


def _worker(rank: int, world: int, tmp: str, name: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
    runs = {(policy, order): _steps(name, policy, order) for policy, order in SETUPS}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, runs)
    _finish_rank(tmp, rank, gathered)


@pytest.mark.parametrize("name", list(TINIES))
def test_ulysses_under_full_and_ops_set_up_before_or_after_it(name):
    """One spawn per model runs every setup; every check reads what it recorded."""
    tiny = TINIES[name]
    ranks: list[Any] = _run_ranks(_worker, (name,), WORLD, TIMEOUT_S)
    assert len(ranks) == WORLD
    for rank, runs in enumerate(ranks):
        plain = runs[(None, "")]["steps"]
        for step in plain:  # q, k, v and the output in forward; their gradients in backward
            assert step["forward"][ALL_TO_ALL] == step["backward"][ALL_TO_ALL] == 4 * tiny.ulysses_calls
            assert step["recomputed_blocks"] == 0
        for (policy, order), run in runs.items():
            assert run["sat_out"] == [], (rank, policy, order)
            if policy is None:
                continue
            assert len(run["steps"]) == STEPS
            for index, (step, expected) in enumerate(zip(run["steps"], plain, strict=True)):
                where = f"rank {rank}, {policy} set up {order} enable_parallelism, step {index}"
                # Bit-equal to the same parallel run without checkpointing.
                assert torch.equal(step["loss"], expected["loss"]), where
                assert step["grads"].keys() == expected["grads"].keys() != set(), where
                for param, grad in step["grads"].items():
                    assert torch.equal(grad, expected["grads"][param]), f"{where}: gradient of {param}"
                # Every block's first call is checkpointed too, whichever was set up first.
                assert step["recomputed_blocks"] == tiny.blocks, where
                if policy == "full":  # every attention kernel and all-to-all of the forward runs again
                    for op in (ALL_TO_ALL, ATTENTION):
                        assert step["backward"][op] == expected["backward"][op] + expected["forward"][op], where
    # ops keeps attention and the all-to-alls' outputs: its backward runs what the plain backward runs, no more.
    for rank, runs in enumerate(ranks):
        plain = runs[(None, "")]["steps"]
        for order in ("before", "after"):
            for index, (step, expected) in enumerate(zip(runs[("ops", order)]["steps"], plain, strict=True)):
                assert step["backward"] == expected["backward"], f"rank {rank}, ops set up {order}, step {index}"
