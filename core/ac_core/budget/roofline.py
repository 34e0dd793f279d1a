"""Predicted time of an op occurrence on a :class:`~.devices.Device`: the roofline.

An op takes at least its FLOPs at the peak rate for its dtype, and at least its bytes moved (inputs read plus
outputs written) at the memory bandwidth; it is predicted to take the larger. A GELU or a norm costs few FLOPs
but reads and writes whole tensors, so it is memory-bound; a large matmul is compute-bound. A host transfer
(offload) takes its bytes over the host link.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from .devices import Device
    from .profile import OpOccurrence


class OpTime(NamedTuple):
    """The two terms of an op's roofline, in seconds: ``compute`` (FLOPs at the peak rate) and ``memory`` (bytes
    moved at the memory bandwidth)."""

    compute: float
    memory: float

    @property
    def seconds(self) -> float:
        return max(self.compute, self.memory)

    @property
    def bound(self) -> str:
        """``"compute"`` or ``"memory"``: the term that sets the time."""
        return "compute" if self.compute >= self.memory else "memory"


def op_time(op: OpOccurrence, device: Device) -> OpTime:
    """``op``'s roofline on ``device``; an op without FLOPs needs no rate for its dtype (an integer op)."""
    compute = op.flops / device.peak_flops(op.dtype) if op.flops else 0.0
    return OpTime(compute, op.bytes_moved / device.memory_bandwidth)


def transfer_seconds(nbytes: int, device: Device) -> float:
    """Seconds to move ``nbytes`` between host and ``device`` one way."""
    return nbytes / device.host_link


__all__ = ["OpTime", "op_time", "transfer_seconds"]
