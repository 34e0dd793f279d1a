"""Predicted time of an op occurrence on a :class:`~.devices.Device`: the roofline.

An op takes at least its FLOPs at the peak rate for its dtype, and at least its bytes moved (inputs read plus
outputs written) at the memory bandwidth; it is predicted to take the larger. A GELU or a norm costs few FLOPs
but reads and writes whole tensors, so it is memory-bound; a large matmul is compute-bound. A host transfer
(offload) takes its bytes over the host link. A collective over ``r`` ranks takes what each rank sends or receives
over the interconnect, the larger: ``(r - 1) / r`` of its larger side (an all-to-all's input, an all-gather's
output, a reduce-scatter's input); its wait takes no time of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from ..collectives import WAIT_TENSOR, is_collective

if TYPE_CHECKING:
    from .devices import Device
    from .profile import OpOccurrence


class OpTime(NamedTuple):
    """The terms of an op's roofline, in seconds: ``compute`` (FLOPs at the peak rate), ``memory`` (bytes moved at
    the memory bandwidth) and ``link`` (a collective's bytes over the interconnect)."""

    compute: float
    memory: float
    link: float = 0.0

    @property
    def seconds(self) -> float:
        return max(self.compute, self.memory, self.link)

    @property
    def bound(self) -> str:
        """``"compute"``, ``"memory"`` or ``"link"``: the term that sets the time."""
        if self.link > max(self.compute, self.memory):
            return "link"
        return "compute" if self.compute >= self.memory else "memory"


def link_bytes(op: OpOccurrence) -> int:
    """What one rank sends or receives (the larger) in collective ``op``: ``(ranks - 1) / ranks`` of its larger
    side, its output (``nbytes``) or its input (what it reads, ``bytes_moved - nbytes``); 0 for any other op."""
    if not is_collective(op.op) or op.ranks <= 1 or op.op.partition(".")[0] == WAIT_TENSOR:
        return 0
    larger = max(op.nbytes, op.bytes_moved - op.nbytes)
    return larger * (op.ranks - 1) // op.ranks


def op_time(op: OpOccurrence, device: Device) -> OpTime:
    """``op``'s roofline on ``device``; an op without FLOPs needs no rate for its dtype (an integer op); a
    collective's time is its :func:`link_bytes` over ``device.interconnect``."""
    if is_collective(op.op):
        return OpTime(0.0, 0.0, link_bytes(op) / device.interconnect)
    compute = op.flops / device.peak_flops(op.dtype) if op.flops else 0.0
    return OpTime(compute, op.bytes_moved / device.memory_bandwidth)


def transfer_seconds(nbytes: int, device: Device) -> float:
    """Seconds to move ``nbytes`` between host and ``device`` one way."""
    return nbytes / device.host_link


__all__ = ["OpTime", "link_bytes", "op_time", "transfer_seconds"]
