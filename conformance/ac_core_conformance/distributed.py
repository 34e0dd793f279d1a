"""One FSDP2 training step in several CPU processes (gloo), compared against a single process.

Each rank gets the same inputs, so the averaged gradients must equal the single-process ones:
any difference comes from sharding, unsharding or recompute under FSDP2, not from the data.
Worker processes are spawned, so they find the adapter again from a string: a registered
(entry-point) name or ``"module:attr"`` (see :func:`ac_core_conformance.subjects.portable_ref`).
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

from ac_core import AdapterSpec, ModelCase, apply_activation_checkpointing
from ac_core._containers import resolve_containers

from .probes import record_retained
from .subjects import Subject, load_adapter
from .training import STEP_SEED, build

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shard_blocks(model: nn.Module, adapter: AdapterSpec) -> None:
    from torch.distributed.fsdp import fully_shard

    model_spec = adapter.model_spec(model)
    assert model_spec is not None
    for _, blocks in resolve_containers(model, model_spec.containers, adapter.name):
        for _, block in blocks:
            fully_shard(block)
    fully_shard(model)


def _one_step(subject: Subject, policy: str | None, n_layer: int) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    case = build(subject)
    with record_retained() as retained:
        if policy is not None:
            apply_activation_checkpointing(case.model, policy, n_layer, adapter=subject.adapter)
        _shard_blocks(case.model, subject.adapter)
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
    port: int,
    adapter_ref: str,
    model_cls: str | int,
    policies: Sequence[str | None],
    n_layer: int,
    out: str,
) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        subject = subject_for(adapter_ref, model_cls)
        results = [_one_step(subject, policy, n_layer) for policy in policies]
        if rank == 0:
            torch.save(results, out)
        # No rank tears gloo down while another is still in a collective: that aborted a rank
        # ("terminate called without an active exception") on a loaded 2-core machine.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run_ranks(args: tuple, world: int, timeout: float) -> None:
    context = mp.start_processes(_worker, args=args, nprocs=world, start_method="spawn", join=False)
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
    policies: Sequence[str | None],
    n_layer: int = 1,
    world: int = 2,
    timeout: float = FSDP_TIMEOUT_S,
) -> dict[str | None, StepResult]:
    """One FSDP2 step per policy (``None``: no checkpointing), each on a fresh model, in one set of ``world`` ranks.

    Every block of the declared containers and the root are ``fully_shard``-ed after the policy is applied.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        _run_ranks((world, _free_port(), adapter_ref, model_cls, list(policies), n_layer, out), world, timeout)
        data: list[dict[str, Any]] = torch.load(out)
    return {
        policy: StepResult(d["loss"], d["grads"], frozenset(d["retained"]))
        for policy, d in zip(policies, data, strict=True)
    }


def fsdp_step(
    adapter_ref: str, model_cls: str | int, policy: str | None, n_layer: int = 1, world: int = 2
) -> StepResult:
    """Loss, full gradients and retained op names of one step under FSDP2 on ``world`` CPU processes."""
    return fsdp_steps(adapter_ref, model_cls, [policy], n_layer, world)[policy]


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
