"""Peak memory of a region beyond what was allocated when it began."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from .memory import LivePeak, live_nbytes, plain_tensors, storage_ref


class PeakMemory:
    """Context manager: ``bytes`` is the peak memory allocated inside it minus ``base_bytes``, what was allocated
    on entry (so ``base_bytes + bytes`` is the peak in all).

    On CUDA it reads the caching allocator's statistics (``torch.cuda.max_memory_allocated``). Elsewhere
    (CPU) it follows every tensor storage ops create inside the region (:class:`LivePeak`; torch's
    MemTracker does the same but rescans every storage on every op, which made a tiny model's step take
    seconds); ``track`` names what existed before it (modules, optimizers, tensors, or containers of
    tensors), whose bytes are reported as ``base_bytes``. Allocate gradients before entering when the
    peak should exclude them, as a training loop that zeroes gradients in place does.
    """

    def __init__(self, device: str | torch.device, track: Any = ()) -> None:
        self.device = torch.device(device)
        self.track = track
        self.bytes = 0
        self.base_bytes = 0
        self._tracker: Any = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base_bytes = torch.cuda.memory_allocated(self.device)
            return self
        self.base_bytes = _bytes_of(self.track)
        self._tracker = LivePeak()
        self._tracker.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self.base_bytes
            return
        self._tracker.__exit__(*exc)
        self.bytes = self._tracker.peak
        self._tracker = None


def _bytes_of(track: Any) -> int:
    """Bytes of the distinct storages behind the tensors in ``track`` (modules' parameters and buffers too)."""
    tensors: list[torch.Tensor] = []
    for obj in tree_leaves(track):
        if isinstance(obj, torch.nn.Module):
            tensors += [*obj.parameters(), *obj.buffers()]
        elif isinstance(obj, torch.optim.Optimizer):
            tensors += [t for state in obj.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
        elif isinstance(obj, torch.Tensor):
            tensors.append(obj)
    refs = {ref.cdata: ref for ref in map(storage_ref, plain_tensors(tensors))}
    return sum(live_nbytes(ref) for ref in refs.values())


__all__ = ["PeakMemory"]
