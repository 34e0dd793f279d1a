"""One FSDP2 training step in several CPU processes (gloo), compared against a single process.

Each rank gets the same inputs, so the averaged gradients must equal the single-process ones:
any difference comes from sharding, unsharding or recompute under FSDP2, not from the data.
Worker processes are spawned, so they find the adapter again from a string: a registered
(entry-point) name or ``"module:attr"`` (see :func:`ac_core_conformance.subjects.portable_ref`).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch import nn
from torch.multiprocessing.spawn import ProcessContext, ProcessExitedException, start_processes

from ac_core import AdapterSpec, ModelCase, apply_activation_checkpointing, observe_retention

from .policies import Policy, as_policy
from .subjects import Subject, load_adapter
from .training import STEP_SEED, build

_RESULT = "result.pt"

FSDP_TIMEOUT_S = 600.0
"""How long the spawned ranks of one check may take before they are killed and the check fails."""


def subject_for(adapter_ref: str, model_cls: str | int) -> Subject:
    """The Subject for ``model_cls`` of the adapter ``adapter_ref`` names: a ModelSpec's ``cls`` string (its
    first spec), or an index into ``adapter.models`` (exact where an adapter declares one class twice)."""
    adapter = load_adapter(adapter_ref)
    if isinstance(model_cls, int):
        return Subject(adapter, adapter.models[model_cls], adapter_ref)
    matching = [m for m in adapter.models if m.cls == model_cls]
    if not matching:
        raise ValueError(f"adapter {adapter.name!r} has no ModelSpec for {model_cls}")
    return Subject(adapter, matching[0], adapter_ref)


def build_case(adapter: AdapterSpec, model_cls: str) -> ModelCase:
    """The seeded tiny case of ``model_cls`` on CPU, as every process of the check builds it."""
    (model_spec,) = [m for m in adapter.models if m.cls == model_cls]
    if model_spec.tiny is None:
        raise ValueError(f"adapter {adapter.name!r} gives no tiny factory for {model_cls}")
    return build(Subject(adapter, model_spec, adapter))


@dataclass(frozen=True)
class StepResult:
    """Loss, full (unsharded) gradients, and the op names ``ops`` retained, of one step."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    retained_ops: frozenset[str]


def _shard_blocks(model: nn.Module, subject: Subject) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in subject.blocks(model):
        fully_shard(block.module)
    fully_shard(model)


def _one_step(subject: Subject, policy: Policy | None) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    case = build(subject)
    with observe_retention() as retained:
        if policy is not None:
            apply_activation_checkpointing(case.model, as_policy(policy), adapter=subject.adapter)
        _shard_blocks(case.model, subject)
        torch.manual_seed(STEP_SEED)
        loss = case.run()
        loss.backward()
    grads = {}
    for name, p in case.model.named_parameters():
        if p.grad is not None:
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad  # a collective: every rank calls
            grads[name] = grad.detach().clone()
    return {"loss": loss.detach(), "grads": grads, "retained": sorted(retained.op_names)}


def _worker(
    rank: int,
    world: int,
    tmp: str,
    adapter_ref: str,
    model_cls: str | int,
    policies: Sequence[Policy | None],
) -> None:
    import torch.distributed as dist

    # A file rendezvous in this check's own folder: a TCP port picked ahead of time can be taken by
    # another check running in parallel (pytest-xdist), and a rank that joins the wrong group crashes.
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
    subject = subject_for(adapter_ref, model_cls)
    results = [_one_step(subject, policy) for policy in policies]
    _finish_rank(tmp, rank, results)


def _finish_rank(tmp: str, rank: int, result: Any) -> NoReturn:
    """End a rank of :func:`_run_ranks`: rank 0 saves ``result`` for the parent, every rank waits for the others,
    marks itself done and leaves the process group, then exits without interpreter teardown."""
    import torch.distributed as dist

    if rank == 0:
        torch.save(result, os.path.join(tmp, _RESULT))
    # No rank tears gloo down while another is still in a collective.
    dist.barrier()
    _mark_done(tmp, rank)
    dist.destroy_process_group()
    # Skip interpreter teardown: gloo's native threads can abort a finished process there
    # ("terminate called without an active exception", seen on a loaded 2-core CI machine), and
    # nothing is left to clean up (pytorch/pytorch#179291 describes the same teardown crash).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _done_marker(tmp: str, rank: int) -> str:
    return os.path.join(tmp, f"rank{rank}.done")


def _mark_done(tmp: str, rank: int) -> None:
    open(_done_marker(tmp, rank), "w").close()


def _run_ranks(worker: Callable[..., None], args: tuple, world: int, timeout: float) -> list[dict[str, Any]]:
    """Spawn ``world`` ranks of ``worker(rank, world, tmp, *args)`` and return what rank 0 saved in ``tmp``.

    A worker saves its results with ``torch.save`` under ``tmp/result.pt`` (rank 0) and calls
    :func:`_mark_done` once every rank is past its last collective.

    A rank that a signal kills before the final barrier (a native crash: no Python exception, no
    wrong number) costs one more run, with a warning; a second crash fails the check. A rank that
    raises fails it at once.
    """
    first = _attempt(worker, args, world, timeout)
    if not isinstance(first, ProcessExitedException):
        return first
    warnings.warn(f"an FSDP2 rank crashed ({first}); running the ranks once more", RuntimeWarning, stacklevel=2)
    second = _attempt(worker, args, world, timeout)
    if isinstance(second, ProcessExitedException):
        raise RuntimeError(
            f"FSDP2 ranks crashed twice in a row ({first}; then {second}): a crash in torch.distributed or a "
            "native kernel, not an assertion of this check"
        ) from second
    return second


def _attempt(
    worker: Callable[..., None], args: tuple, world: int, timeout: float
) -> list[dict[str, Any]] | ProcessExitedException:
    with tempfile.TemporaryDirectory() as tmp:
        context = start_processes(worker, args=(world, tmp, *args), nprocs=world, start_method="spawn", join=False)
        assert context is not None  # join=False returns the context to join
        try:
            _join(context, timeout)
        except ProcessExitedException as exc:
            if not all(os.path.exists(_done_marker(tmp, r)) for r in range(world)):
                return exc
            # Every rank passed the final barrier: a crash after it cannot change the results.
        return torch.load(os.path.join(tmp, _RESULT))


def _join(context: ProcessContext, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(0.0, min(5.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
            raise TimeoutError(f"FSDP2 ranks did not finish within {timeout:.0f} s (a hang in a collective?)")


def fsdp_steps(
    adapter_ref: str,
    model_cls: str | int,
    policies: Sequence[Policy | None],
    world: int = 2,
    timeout: float = FSDP_TIMEOUT_S,
) -> dict[Policy | None, StepResult]:
    """One FSDP2 step per policy (``None``: no checkpointing), each on a fresh model, in one set of ``world`` ranks.

    Every block of the declared containers and the root are ``fully_shard``-ed after the policy is applied.
    """
    data = _run_ranks(_worker, (adapter_ref, model_cls, list(policies)), world, timeout)
    return {
        policy: StepResult(d["loss"], d["grads"], frozenset(d["retained"]))
        for policy, d in zip(policies, data, strict=True)
    }


def fsdp_step(adapter_ref: str, model_cls: str | int, policy: Policy | None, world: int = 2) -> StepResult:
    """Loss, full gradients and retained op names of one step under FSDP2 on ``world`` CPU processes."""
    return fsdp_steps(adapter_ref, model_cls, [policy], world)[policy]


def single_step(adapter_ref: str, model_cls: str | int) -> StepResult:
    """The same step in this process, without checkpointing or sharding."""
    case = build(subject_for(adapter_ref, model_cls))
    torch.manual_seed(STEP_SEED)
    loss = case.run()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in case.model.named_parameters() if p.grad is not None}
    return StepResult(loss.detach(), grads, frozenset())


__all__ = [
    "FSDP_TIMEOUT_S",
    "StepResult",
    "build_case",
    "fsdp_step",
    "fsdp_steps",
    "load_adapter",
    "single_step",
    "subject_for",
]
