"""A test double for offload's device path: runs on CPU, records what would move, and checks the contract.

``with use_offload_transport(RecordingTransport()) as t: ...`` routes offload through it. It copies
for real (into a :class:`HostPool` of plain memory, allocated without a dispatcher op so that
``ac_core.measure.held_for_backward`` counts only what stays "on the device"), and plays a copy
engine that finishes each copy once ``lag`` more copies (either way) have started. It records a
violation when the session lets a source's memory go while its copy is still running, uses a ticket
after freeing it, or frees it twice; a reload's tensor holds NaN until ``finish_reload``, so handing
one back early shows in gradients.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ._pool import Chunk, HostPool, host_view


def _plain_bytes(nbytes: int) -> torch.Tensor:
    # set_ on a fresh storage: no allocating dispatcher op, so a TorchDispatchMode sees no new tensor.
    data = torch.empty(0, dtype=torch.uint8)
    return data.set_(torch.UntypedStorage(nbytes))


@dataclass(frozen=True)
class OffloadRecord:
    """One tensor the double was asked to move to the host."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    storage: int  # data_ptr of its storage, to match it against tensors a test captured
    source: StorageWeakRef | None = field(default=None, compare=False)
    """The storage itself, weakly: while both are alive, its ``cdata`` identifies it (an address may be reused)."""


class _Ticket:
    __slots__ = ("chunk", "done", "fenced", "freed", "host", "seq", "storage", "until")

    def __init__(self, seq: int, chunk: Chunk, host: torch.Tensor, storage: StorageWeakRef, until: int) -> None:
        self.seq = seq
        self.chunk = chunk
        self.host = host
        self.storage = storage
        self.until = until  # the clock tick at which the copy is finished
        self.done = False
        self.fenced = False
        self.freed = False


class _Reload:
    __slots__ = ("finished", "host", "tensor")

    def __init__(self, tensor: torch.Tensor, host: torch.Tensor) -> None:
        self.tensor = tensor
        self.host = host
        self.finished = False


class RecordingTransport:
    """An :class:`~ac_core.OffloadTransport` for tensors on ``device_type`` (CPU by default) that records everything."""

    def __init__(self, device_type: str = "cpu", lag: int = 0, pool: HostPool | None = None) -> None:
        self.device_type = device_type
        self.lag = lag
        self.pool = pool or HostPool(_plain_bytes, slab_bytes=1 << 20)
        self.offloaded: list[OffloadRecord] = []
        self.violations: list[str] = []
        self.fenced = 0
        self.throttled = 0
        self.reloads = 0
        self.finished_reloads = 0
        self.dropped_reloads = 0
        self.freed = 0
        self._seq = itertools.count()
        self._clock = 0
        self._pending: list[_Ticket] = []

    @property
    def live_tickets(self) -> int:
        """Tickets not yet freed: host memory a session still holds."""
        return len(self.offloaded) - self.freed

    def _advance(self, tick: int = 0) -> None:
        """Move the clock (copies started) on by ``tick``: finish the copies due; flag a source freed unfenced."""
        self._clock += tick
        still: list[_Ticket] = []
        for ticket in self._pending:
            if ticket.storage.expired() and not ticket.fenced:
                self.violations.append(f"the source of copy {ticket.seq} was freed while its copy was running")
            elif self._clock >= ticket.until:
                ticket.done = True
            else:
                still.append(ticket)
        self._pending = still

    def accepts(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self.device_type

    def start_offload(self, tensor: torch.Tensor, max_host_fraction: float) -> _Ticket:
        nbytes = tensor.numel() * tensor.element_size()
        chunk = self.pool.acquire(nbytes, max_host_fraction)
        host = host_view(chunk.data, tensor)
        host.copy_(tensor)
        storage = tensor.untyped_storage()
        self._advance(1)
        source = StorageWeakRef(storage)
        ticket = _Ticket(next(self._seq), chunk, host, source, self._clock + self.lag)
        self.offloaded.append(OffloadRecord(tuple(tensor.shape), tensor.dtype, nbytes, storage.data_ptr(), source))
        if self.lag:
            self._pending.append(ticket)
        else:
            ticket.done = True
        return ticket

    def offload_done(self, ticket: _Ticket) -> bool:
        self._advance()
        return ticket.done

    def fence_offload(self, ticket: _Ticket, tensor: torch.Tensor, throttle: bool) -> None:
        self._advance()
        self.fenced += 1
        self.throttled += throttle
        ticket.fenced = True  # its memory now waits for the copy: letting it go is safe

    def start_reload(self, ticket: _Ticket) -> _Reload:
        self._advance(1)
        if ticket.freed:
            self.violations.append(f"reload of copy {ticket.seq} after it was freed")
        self.reloads += 1
        host = ticket.host
        out = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype)
        if out.is_floating_point() or out.is_complex():
            out.fill_(float("nan"))
        return _Reload(out, host)

    def finish_reload(self, reload: _Reload) -> torch.Tensor:
        if reload.finished:
            self.violations.append("a reload was finished twice")
        reload.finished = True
        self.finished_reloads += 1
        return reload.tensor.copy_(reload.host)

    def drop_reload(self, reload: _Reload) -> None:
        self.dropped_reloads += 1

    def free(self, ticket: _Ticket) -> None:
        self._advance()
        if ticket.freed:
            self.violations.append(f"copy {ticket.seq} freed twice")
            return
        ticket.freed = True
        self.freed += 1
        self.pool.release(ticket.chunk)


__all__ = ["OffloadRecord", "RecordingTransport"]
