"""Host slabs: reused across steps, packed without power-of-two waste, ordered by fences, and guarded."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from ac_core import last_offload_stats, use_offload_transport
from ac_core.offload import _pool as pool_module
from ac_core.offload._pool import HostPool, host_view, is_dense
from ac_core.offload.testing import RecordingTransport

from ..core.helpers import loss_and_grads
from .helpers import EVERYTHING, assert_contract_kept, toy, train_step

MiB = 1 << 20


def _counting_pool() -> tuple[HostPool, list[int]]:
    allocations: list[int] = []

    def allocate(nbytes: int) -> torch.Tensor:
        allocations.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    return HostPool(allocate, slab_bytes=4 * MiB), allocations


def test_chunks_pack_into_slabs_and_slabs_come_back_for_the_next_step():
    pool, allocations = _counting_pool()
    sizes = [3 * MiB, MiB, 700, 3 * MiB + 5, 9 * MiB]

    def step() -> None:
        chunks = [pool.acquire(n) for n in sizes]  # forward
        assert [c.data.numel() for c in chunks] == sizes
        assert all((c.data.data_ptr() - c.slab.data.data_ptr()) % 512 == 0 for c in chunks)
        for chunk in reversed(chunks):  # backward
            pool.release(chunk)

    step()
    # 3 MiB and 1 MiB fill a 4 MiB slab; 700 B and 3 MiB + 5 B share the next; 9 MiB gets a 16 MiB one.
    assert allocations == [4 * MiB, 4 * MiB, 16 * MiB]
    held = pool.held_bytes
    step()
    step()
    assert allocations == [4 * MiB, 4 * MiB, 16 * MiB] and pool.held_bytes == held
    assert pool.in_use_bytes == 0


def test_a_large_tensor_gets_a_power_of_two_slab_that_later_chunks_fill():
    pool, allocations = _counting_pool()
    big = pool.acquire(9 * MiB)
    small = pool.acquire(5 * MiB)
    assert allocations == [16 * MiB]  # the 7 MiB left after the 9 MiB chunk take the next 5 MiB
    assert small.slab is big.slab


def test_fences_of_the_last_reads_are_handed_to_the_next_writer():
    pool, _ = _counting_pool()
    a, b = pool.acquire(MiB), pool.acquire(MiB)
    pool.release(b, fence="read-b", fence_key="to_device", order=7)
    pool.release(a, fence="read-a", fence_key="to_device", order=3)  # released later, recorded earlier
    reused = pool.acquire(MiB)  # the emptied slab, taken again
    assert reused.slab is a.slab and reused.data.data_ptr() == a.data.data_ptr()
    assert reused.fences == ["read-b"]


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(4, 6, 8),
        lambda: torch.randn(4, 6, 8).permute(2, 0, 1),  # dense, not contiguous: strides kept
        lambda: torch.randn(4, 6, 8)[:, ::2],  # gaps: copied contiguous
        lambda: torch.randn(6, 1).expand(6, 4),  # overlap: copied contiguous
        lambda: torch.randn(3, 5).to(torch.bfloat16),
        lambda: torch.randn(2, 3, dtype=torch.complex64),
    ],
)
def test_host_views_round_trip_values_and_dense_strides(make):
    t = make()
    pool, _ = _counting_pool()
    chunk = pool.acquire(t.numel() * t.element_size())
    host = host_view(chunk.data, t)
    host.copy_(t)
    assert torch.equal(host, t) and host.dtype == t.dtype
    if is_dense(t):
        assert host.stride() == t.stride()
    else:
        assert host.is_contiguous()


def test_guard_warns_once_when_pinned_memory_passes_the_fraction(monkeypatch, caplog):
    monkeypatch.setattr(pool_module, "total_ram_bytes", lambda: 10 * MiB)
    pool, _ = _counting_pool()
    with caplog.at_level(logging.WARNING, logger="ac_core"):
        pool.acquire(3 * MiB, max_host_fraction=0.5)  # 4 MiB held of 10: fine
        assert not caplog.records
        pool.acquire(3 * MiB, max_host_fraction=0.5)  # 8 MiB held: past 5
        pool.acquire(3 * MiB, max_host_fraction=0.5)
    (record,) = caplog.records
    assert "max_host_fraction" in record.getMessage() and "50%" in record.getMessage()


def test_guard_through_a_model_uses_the_configured_fraction(monkeypatch, caplog):
    monkeypatch.setattr(pool_module, "total_ram_bytes", lambda: 2 * MiB)
    config = dataclasses.replace(EVERYTHING, max_host_fraction=0.3)
    case = toy("none", config, depth=2)
    with caplog.at_level(logging.WARNING, logger="ac_core"):
        _, transport = train_step(case)  # the double's first 1 MiB slab passes 30% of 2 MiB
        train_step(case)
    assert transport.pool.held_bytes > 0.3 * 2 * MiB
    # One warning per pool: each step above used a fresh double, hence a fresh pool.
    assert len([r for r in caplog.records if "pinned host memory" in r.getMessage()]) == 2
    assert_contract_kept(transport)


def test_steps_reuse_the_same_host_memory():
    case = toy("none", depth=2)
    transport = RecordingTransport()
    with use_offload_transport(transport):
        loss_and_grads(case)
        slabs = transport.pool.slabs_allocated
        for _ in range(3):
            for p in case.model.parameters():
                p.grad = None
            loss_and_grads(case)
    assert transport.pool.slabs_allocated == slabs > 0
    assert last_offload_stats(case.model).offloaded > 0
    assert_contract_kept(transport)
