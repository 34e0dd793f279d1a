"""Check 11: an adapter that declares context parallelism trains under it like the unchecked parallel run, and
``ops`` re-runs none of its activation collectives.

On two gloo ranks, per declared mode (Ulysses, ring) and policy, with ac-core applied before and after the model
is switched to the mode: the first step's loss and gradients equal (``torch.equal``) those of the same parallel
run unchecked; backward re-runs the activation collectives (``AdapterSpec.activation_collectives``) and attention
kernels as the policy says: under ``ops`` no more collectives and kernel calls than the unchecked backward runs
(diffusers' Ulysses backward runs the kernel's forward once of its own), under ``full`` more kernel calls and,
where the forward runs any, more collectives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from ac_core import DEFAULT_RETAINED_OPS, Full, Ops, PolicyConfig, apply_activation_checkpointing
from ac_core.measure import OpCounter

from ..base import AdapterTests
from ..distributed import FSDP_TIMEOUT_S, _finish_rank, _run_ranks, subject_for
from ..policies import label
from ..subjects import Subject, portable_ref
from ..training import STEP_SEED, build, require_tiny
from .fsdp import WORLD_SIZE

ORDERS = ("before", "after")
"""ac-core applied before the model is switched to context parallelism, or after."""


def _counted(subject: Subject) -> tuple[frozenset[str], frozenset[str]]:
    """(the adapter's activation collectives, the attention kernels ``ops`` keeps) by name."""
    return frozenset(subject.adapter.activation_collectives), DEFAULT_RETAINED_OPS | subject.adapter.retained_ops()


def _one_step(subject: Subject, mode: str, policy: PolicyConfig | None, order: str) -> dict[str, Any]:
    parallel = subject.adapter.context_parallel
    assert parallel is not None
    case = build(subject)
    inputs = parallel.shard(case.inputs)
    if policy is not None and order == "before":
        apply_activation_checkpointing(case.model, policy, adapter=subject.adapter)
    parallel.enable(case.model, mode)
    if policy is not None and order == "after":
        apply_activation_checkpointing(case.model, policy, adapter=subject.adapter)
    collectives, kernels = _counted(subject)
    torch.manual_seed(STEP_SEED)
    with OpCounter() as counter:
        loss = case.loss(case.model(**inputs))
        loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in case.model.named_parameters() if p.grad is not None}
    return {
        "loss": loss.detach(),
        "grads": grads,
        "forward": counter.count(collectives, "forward"),
        "collectives": counter.count(collectives, "backward"),
        "kernels": counter.count(kernels, "backward"),
    }


def _facts(runs: dict[tuple[str, str, str], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per (mode, policy label, order): the backward's counts and whether loss and gradients equal the unchecked's."""
    facts = {}
    for (mode, policy, order), run in runs.items():
        plain = runs[(mode, "none", "before")]
        same = torch.equal(run["loss"], plain["loss"]) and run["grads"].keys() == plain["grads"].keys()
        same = same and all(torch.equal(run["grads"][n], g) for n, g in plain["grads"].items())
        counts = {k: run[k] for k in ("forward", "collectives", "kernels")}
        facts[f"{mode}/{policy}/{order}"] = {**counts, "equal": same}
    return facts


def _worker(
    rank: int, world: int, tmp: str, adapter_ref: str, model: int, policies: Sequence[PolicyConfig]
) -> None:  # fmt: skip
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
    torch.set_num_threads(1)  # ranks sharing a small machine's cores do not starve each other at every collective
    subject = subject_for(adapter_ref, model)
    assert subject.adapter.context_parallel is not None
    runs = {}
    for mode in subject.adapter.context_parallel.modes:
        runs[(mode, "none", "before")] = _one_step(subject, mode, None, "before")
        for policy in policies:
            for order in ORDERS:
                runs[(mode, label(policy), order)] = _one_step(subject, mode, policy, order)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, _facts(runs))
    _finish_rank(tmp, rank, everyone)


def check_context_parallel(
    subject: Subject, policies: Sequence[PolicyConfig] = (Full(), Ops())
) -> dict[str, dict[str, Any]]:
    """For an adapter that declares ``context_parallel`` (a model it excludes is skipped): on two gloo ranks, per
    mode, policy and order of setup, the first step trains bit-equal to the unchecked parallel run; under ``ops``
    backward runs no more of the adapter's kernels and activation collectives than the unchecked backward runs;
    under ``full`` more kernel calls and, where the mode's forward runs any, more collectives; any other policy
    trains bit-equal. Returns the facts
    per ``mode/policy/order`` (collectives in forward and backward, kernels in backward, gradients equal), as
    rank 0 found them. All runs share one pair of spawned ranks."""
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not built into this torch")
    if subject.adapter.context_parallel is None:
        pytest.skip(f"adapter {subject.adapter.name!r} declares no context_parallel")
    require_tiny(subject)
    unsupported = subject.adapter.context_parallel.reason(build(subject).model)
    if unsupported is not None:
        pytest.skip(f"{subject.id}: {unsupported}")
    model = subject.adapter.models.index(subject.model)
    ranks = _run_ranks(_worker, (portable_ref(subject.ref), model, list(policies)), WORLD_SIZE, FSDP_TIMEOUT_S)
    failures = []
    for rank, facts in enumerate(ranks):
        for key, fact in facts.items():
            mode, policy, _ = key.split("/")
            plain = facts[f"{mode}/none/before"]
            what = f"{subject.id} on rank {rank} under {mode} with {key.split('/', 1)[1]}"
            if not fact["equal"]:
                failures.append(f"{what}: loss or gradients differ from the unchecked parallel run's")
            # Beyond the unchecked backward's own: diffusers' Ulysses backward runs the kernel's forward again.
            if policy == "ops" and (fact["collectives"] > plain["collectives"] or fact["kernels"] > plain["kernels"]):
                failures.append(
                    f"{what}: backward re-ran {fact['collectives'] - plain['collectives']} activation collectives "
                    f"and {fact['kernels'] - plain['kernels']} attention kernels that 'ops' keeps"
                )
            if policy == "full" and fact["kernels"] <= plain["kernels"]:
                failures.append(f"{what}: backward re-ran no attention kernel, though 'full' recomputes them")
            if policy == "full" and plain["forward"] and fact["collectives"] <= plain["collectives"]:
                failures.append(f"{what}: backward re-ran no activation collective, though 'full' recomputes them")
    if failures:
        raise AssertionError("\n".join(failures))
    return ranks[0]


class ContextParallelTests(AdapterTests):
    """Check 11: under each declared context-parallel mode, on two gloo ranks, training is bit-equal to the
    unchecked parallel run and ``ops`` re-runs no activation collective."""

    def test_context_parallel(self, subject: Subject) -> None:
        check_context_parallel(subject, self._policies())


__all__ = ["ContextParallelTests", "check_context_parallel"]
