"""The real CUDA path: side streams, pinned slabs, events (skipped where no CUDA device is present)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ac_core import OffloadConfig, apply_activation_checkpointing, apply_activation_offload, last_offload_stats
from ac_core.offload._cuda import pinned_pool
from ac_core.testing import TOY_ADAPTER, toy_case

from ..core.helpers import assert_same_training
from .helpers import loss_and_grads

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Residual-stream activations of 2 MiB: above the default 1 MiB threshold.
SHAPE = {"dim": 256, "heads": 4, "depth": 4, "tokens": 1024, "batch": 2}
CONFIG = OffloadConfig(min_tokens=1)


def _case(policy: str, offload: OffloadConfig | None):
    case = toy_case(**SHAPE).to("cuda")
    if policy != "none":
        apply_activation_checkpointing(case.model, policy, 2, adapter=TOY_ADAPTER, offload=offload)
    elif offload is not None:
        apply_activation_offload(case.model, offload, adapter=TOY_ADAPTER)
    return case


@pytest.mark.parametrize("policy", ["none", "full", "ops", "block_skip"])
def test_gradients_hold_and_host_memory_is_reused(policy):
    expected = loss_and_grads(_case(policy, None))
    case = _case(policy, CONFIG)
    got = loss_and_grads(case)
    assert_same_training(got, expected, atol=1e-5)
    stats = last_offload_stats(case.model)
    assert stats.offloaded > 0 and stats.prefetched + stats.on_demand + stats.reused > 0
    slabs = pinned_pool().slabs_allocated
    for _ in range(2):
        for p in case.model.parameters():
            p.grad = None
        loss_and_grads(case)
    assert pinned_pool().slabs_allocated == slabs
    torch.cuda.synchronize()
    assert pinned_pool().in_use_bytes == 0


def test_device_memory_held_after_forward_drops():
    def held_after_forward(offload: OffloadConfig | None) -> int:
        case = _case("none", offload)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = case.run()
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        loss.backward()
        return held

    plain = held_after_forward(None)
    # max_inflight_bytes=0: every original is let go as soon as its copy is queued (compute waits for it).
    offloaded = held_after_forward(dataclasses.replace(CONFIG, max_inflight_bytes=0))
    assert offloaded < 0.2 * plain


def test_side_stream_forward_and_backward():
    expected = loss_and_grads(_case("full", None))
    case = _case("full", CONFIG)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = loss_and_grads(case)
    torch.cuda.current_stream().wait_stream(stream)
    assert_same_training(got, expected, atol=1e-5)
