"""One FSDP2 training step in several CPU processes (gloo), compared against a single process.

Each rank gets the same inputs, so the averaged gradients must equal the single-process ones:
any difference comes from sharding, unsharding or recompute under FSDP2, not from the data.
"""

from __future__ import annotations

import importlib
import os
import socket
import tempfile
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

from ac_core import AdapterSpec, ModelCase, apply_activation_checkpointing, get_adapter


def load_adapter(ref: str) -> AdapterSpec:
    """An adapter by registered name, or by ``"module:attribute"`` of an AdapterSpec."""
    if ":" not in ref:
        return get_adapter(ref)
    module, _, attr = ref.partition(":")
    spec = getattr(importlib.import_module(module), attr)
    if not isinstance(spec, AdapterSpec):
        raise TypeError(f"{ref} is a {type(spec).__name__}, not an AdapterSpec")
    return spec


def build_case(adapter: AdapterSpec, model_cls: str) -> ModelCase:
    (model_spec,) = [m for m in adapter.models if m.cls == model_cls]
    if model_spec.tiny is None:
        raise ValueError(f"adapter {adapter.name!r} gives no tiny factory for {model_cls}")
    torch.manual_seed(0)
    return model_spec.tiny()


@dataclass(frozen=True)
class StepResult:
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    retained_ops: frozenset[str]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shard_blocks(model: nn.Module, adapter: AdapterSpec) -> None:
    from torch.distributed.fsdp import fully_shard

    from ac_core._containers import resolve_containers

    model_spec = adapter.model_spec(model)
    assert model_spec is not None
    for _, blocks in resolve_containers(model, model_spec.containers, adapter.name):
        for _, block in blocks:
            fully_shard(block)
    fully_shard(model)


def _record_retained(retained: set[str]) -> None:
    # Wrap the policy so the step reports every op whose output 'ops' kept.
    from torch.utils.checkpoint import CheckpointPolicy

    from ac_core import ops

    original = ops._policy

    def recording(names, record, ctx, func, *args, **kwargs):
        decision = original(names, record, ctx, func, *args, **kwargs)
        if decision == CheckpointPolicy.MUST_SAVE:
            retained.add(func.name())
        return decision

    ops._policy = recording


def _worker(
    rank: int,
    world: int,
    port: int,
    adapter_ref: str,
    model_cls: str,
    policy: str | None,
    n_layer: int,
    out: str,
) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        adapter = load_adapter(adapter_ref)
        case = build_case(adapter, model_cls)
        retained: set[str] = set()
        _record_retained(retained)
        if policy is not None:
            apply_activation_checkpointing(case.model, policy, n_layer, adapter=adapter)
        _shard_blocks(case.model, adapter)
        loss = case.run()
        loss.backward()
        grads = {}
        for name, p in case.model.named_parameters():
            if p.grad is not None:
                grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                grads[name] = grad.detach().clone()
        if rank == 0:
            torch.save({"loss": loss.detach(), "grads": grads, "retained": sorted(retained)}, out)
    finally:
        dist.destroy_process_group()


def fsdp_step(adapter_ref: str, model_cls: str, policy: str | None, n_layer: int = 1, world: int = 2) -> StepResult:
    """Loss, full gradients and retained op names of one step under FSDP2 on ``world`` CPU processes."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.start_processes(
            _worker,
            args=(world, _free_port(), adapter_ref, model_cls, policy, n_layer, out),
            nprocs=world,
            start_method="spawn",
        )
        data: dict[str, Any] = torch.load(out)
    return StepResult(data["loss"], data["grads"], frozenset(data["retained"]))


def single_step(adapter_ref: str, model_cls: str) -> StepResult:
    """The same step in this process, without checkpointing or sharding."""
    case = build_case(load_adapter(adapter_ref), model_cls)
    loss = case.run()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in case.model.named_parameters() if p.grad is not None}
    return StepResult(loss.detach(), grads, frozenset())


__all__ = ["StepResult", "build_case", "fsdp_step", "load_adapter", "single_step"]
