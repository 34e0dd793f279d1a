"""Offload on CUDA: copies on two side streams, into pinned slabs, ordered by events.

Imported only when a CUDA device is present: nothing here runs, or asks for pinned memory,
on a machine without one.

Ordering, copy by copy:
- to host: the copy stream waits for the compute stream (the tensor must be computed) and for
  the last reads of the slab region it reuses; the session holds the source tensor until the
  copy's event has fired, or fences it (``record_stream`` on the copy stream, so the caching
  allocator cannot hand its memory to new work before the copy has read it).
- back to the device: the new tensor is allocated on the compute stream, so autograd frees it
  where it is used; the reload stream waits for the compute stream first (the block may have just
  been freed by work still queued there) and for the copy to host. The consumer's stream waits
  on the reload's event before use, and ``record_stream`` covers a consumer on another stream.
"""

from __future__ import annotations

import itertools
import threading

import torch

from ._pool import Chunk, HostPool, host_view

_pool: HostPool | None = None
_pool_lock = threading.Lock()


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def pinned_pool() -> HostPool:
    """The process's pinned slabs, shared by every CUDA device."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = HostPool(_pinned)
        return _pool


class _Ticket:
    __slots__ = ("chunk", "compute", "host", "read", "written")

    def __init__(self, chunk: Chunk, host: torch.Tensor, written: tuple[int, torch.cuda.Event], compute):
        self.chunk = chunk
        self.host = host
        self.written = written  # (record order on the copy stream, event)
        self.compute = compute
        self.read: tuple[int, torch.cuda.Event] | None = None


class _Reload:
    __slots__ = ("loaded", "stream", "tensor")

    def __init__(self, tensor: torch.Tensor, loaded: torch.cuda.Event, stream: torch.cuda.Stream):
        self.tensor = tensor
        self.loaded = loaded
        self.stream = stream


class CudaTransport:
    """The :class:`OffloadTransport` of one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool = pinned_pool()
        self._to_host = torch.cuda.Stream(device)
        self._to_device = torch.cuda.Stream(device)
        self._order = itertools.count()  # record order of events, for the pool's fences
        self._record_lock = threading.Lock()

    def _record(self, stream: torch.cuda.Stream) -> tuple[int, torch.cuda.Event]:
        event = torch.cuda.Event()
        with self._record_lock:
            event.record(stream)
            return next(self._order), event

    def accepts(self, tensor: torch.Tensor) -> bool:
        # A copy on a side stream cannot join a CUDA graph being captured.
        return tensor.device == self.device and not torch.cuda.is_current_stream_capturing()

    def start_offload(self, tensor: torch.Tensor, max_host_fraction: float) -> _Ticket:
        compute = torch.cuda.current_stream(self.device)
        chunk = self._pool.acquire(tensor.numel() * tensor.element_size(), max_host_fraction)
        host = host_view(chunk.data, tensor)
        stream = self._to_host
        stream.wait_stream(compute)
        for fence in chunk.fences:
            stream.wait_event(fence)
        with torch.cuda.stream(stream):
            host.copy_(tensor, non_blocking=True)
        return _Ticket(chunk, host, self._record(stream), compute)

    def offload_done(self, ticket: _Ticket) -> bool:
        return ticket.written[1].query()

    def fence_offload(self, ticket: _Ticket, tensor: torch.Tensor, throttle: bool) -> None:
        tensor.record_stream(self._to_host)
        if throttle:
            ticket.compute.wait_event(ticket.written[1])

    def start_reload(self, ticket: _Ticket) -> _Reload:
        compute = torch.cuda.current_stream(self.device)
        host = ticket.host  # dense: the source's strides, or contiguous
        out = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=self.device)
        stream = self._to_device
        stream.wait_stream(compute)
        stream.wait_event(ticket.written[1])
        with torch.cuda.stream(stream):
            out.copy_(host, non_blocking=True)
        ticket.read = self._record(stream)
        return _Reload(out, ticket.read[1], compute)

    def finish_reload(self, reload: _Reload) -> torch.Tensor:
        current = torch.cuda.current_stream(self.device)
        current.wait_event(reload.loaded)
        if current != reload.stream:
            # Allocated on another stream than the one that uses it: tell the allocator, or it may
            # reuse the memory for that stream's work while this one still reads it.
            reload.tensor.record_stream(current)
        return reload.tensor

    def drop_reload(self, reload: _Reload) -> None:
        # The copy may still be writing it: its memory must not serve new work before the copy ends.
        reload.tensor.record_stream(self._to_device)

    def free(self, ticket: _Ticket) -> None:
        # One fence per stream: the reload stream's last read, else the copy stream's write.
        if ticket.read is not None:
            order, event = ticket.read
            self._pool.release(ticket.chunk, event, (self.device.index, "to_device"), order)
        else:
            order, event = ticket.written
            self._pool.release(ticket.chunk, event, (self.device.index, "to_host"), order)
