"""The device path behind offload: a small interface, the CUDA implementation's selection, and a seam for doubles.

The session decides *which* tensors move and *when* (thresholds, regions, the in-flight bound,
prefetch order); a transport only moves bytes and keeps the copies ordered. Tests stand a
recording double in for CUDA on machines without a GPU (see ``ac_core.testing.RecordingTransport``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch

logger = logging.getLogger("ac_core")


@runtime_checkable
class OffloadTransport(Protocol):
    """Moves saved tensors between one kind of device and host memory, asynchronously where it can.

    Tickets and reloads are the transport's own objects; the session only hands them back.
    The contract, which every implementation must keep so that no tensor is used while a copy
    still writes it and no memory is reused while a copy still reads it:

    - ``start_offload(tensor, max_host_fraction)`` starts copying ``tensor`` to host memory and returns a ticket.
      The session keeps ``tensor`` alive until ``offload_done(ticket)`` is true or it has called
      ``fence_offload``.
    - ``fence_offload(ticket, tensor, throttle)`` makes it safe to drop ``tensor`` before its copy finished;
      with ``throttle`` later compute also waits for the copy (that bounds device memory).
    - ``start_reload(ticket)`` starts copying the bytes back into a new device tensor and returns a reload;
      ``finish_reload(reload)`` returns that tensor, ready for use by the caller's current stream;
      ``drop_reload(reload)`` discards a reload that will not be used.
    - ``free(ticket)`` gives the host memory back, once nothing will reload from it.
    """

    def accepts(self, tensor: torch.Tensor) -> bool: ...

    def start_offload(self, tensor: torch.Tensor, max_host_fraction: float) -> Any: ...

    def offload_done(self, ticket: Any) -> bool: ...

    def fence_offload(self, ticket: Any, tensor: torch.Tensor, throttle: bool) -> None: ...

    def start_reload(self, ticket: Any) -> Any: ...

    def finish_reload(self, reload: Any) -> torch.Tensor: ...

    def drop_reload(self, reload: Any) -> None: ...

    def free(self, ticket: Any) -> None: ...


_override: list[OffloadTransport] = []
_cuda_transports: dict[int, OffloadTransport] = {}
_cuda_lock = threading.Lock()
_said_inactive = False


@contextlib.contextmanager
def use_offload_transport(transport: OffloadTransport) -> Iterator[OffloadTransport]:
    """Route every offload session started inside this block through ``transport`` (a test double, or a device
    path for an accelerator ac-core does not drive itself) instead of the built-in CUDA one."""
    if not isinstance(transport, OffloadTransport):
        raise TypeError(f"use_offload_transport takes an OffloadTransport, got {type(transport).__name__}")
    _override.append(transport)
    try:
        yield transport
    finally:
        _override.remove(transport)


def can_offload() -> bool:
    """Whether a session started now could move anything; says once, at debug level, when it cannot."""
    global _said_inactive
    if _override or torch.cuda.is_available():
        return True
    if not _said_inactive:
        _said_inactive = True
        logger.debug(
            "ac-core: activation offload does nothing on this machine: no CUDA device is available, so saved "
            "tensors stay where they are (and no pinned memory is requested)."
        )
    return False


def transport_for(tensor: torch.Tensor) -> OffloadTransport | None:
    """The transport that moves ``tensor``, or None when nothing can (e.g. a CPU tensor)."""
    if _override:
        transport = _override[-1]
        return transport if transport.accepts(tensor) else None
    if tensor.device.type != "cuda":
        return None
    index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    with _cuda_lock:
        transport = _cuda_transports.get(index)
        if transport is None:
            from ._cuda import CudaTransport

            transport = _cuda_transports[index] = CudaTransport(torch.device("cuda", index))
    return transport if transport.accepts(tensor) else None


def _reset_inactive_notice() -> None:
    global _said_inactive
    _said_inactive = False
