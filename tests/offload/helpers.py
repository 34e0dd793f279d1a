"""Running a toy or adapter case with offload through the recording double."""

from __future__ import annotations

import gc

import torch
from torch import nn

import ac_core
from ac_core import (
    ModelCase,
    OffloadConfig,
    apply_activation_checkpointing,
    apply_activation_offload,
    use_offload_transport,
)
from ac_core.offload.testing import RecordingTransport
from ac_core.testing import TOY_ADAPTER, toy_case

POLICIES = ("none", *ac_core.registered_policies())

# Every activation of the toy is far below the default 1 MiB threshold: tests that are not about it lower it.
EVERYTHING = OffloadConfig(min_tokens=1, min_bytes=1)


def prepare(case: ModelCase, policy: str, offload: OffloadConfig | None, adapter=TOY_ADAPTER) -> ModelCase:
    """Checkpoint ``case.model`` by ``policy`` ("none": not at all) and offload by ``offload``."""
    if policy != "none":
        config = ac_core.BlockSkip(every=2) if policy == ac_core.BlockSkip.name else policy
        apply_activation_checkpointing(case.model, config, adapter=adapter, offload=offload)
    elif offload is not None:
        apply_activation_offload(case.model, offload, adapter=adapter)
    return case


def loss_and_grads(case: ModelCase) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and every gradient; a parameter the loss does not reach has none (zeros here, as in the plain run)."""
    loss = case.run()
    loss.backward()
    grads = {
        name: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
        for name, p in case.model.named_parameters()
    }
    return loss.detach(), grads


def train_step(case: ModelCase, lag: int = 0) -> tuple[tuple, RecordingTransport]:
    """Loss and gradients of one step with offload routed through a fresh double."""
    with use_offload_transport(RecordingTransport(lag=lag)) as transport:
        result = loss_and_grads(case)
    gc.collect()  # anything left would be a leak the double reports as live tickets
    return result, transport


def toy(policy: str, offload: OffloadConfig | None = EVERYTHING, **kwargs) -> ModelCase:
    return prepare(toy_case(**kwargs), policy, offload)


def parameter_storages(model: nn.Module) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


def assert_contract_kept(transport: RecordingTransport) -> None:
    assert transport.violations == []
    assert transport.live_tickets == 0, "host memory still held after backward"
    assert transport.pool.in_use_bytes == 0
    assert transport.finished_reloads + transport.dropped_reloads == transport.reloads
