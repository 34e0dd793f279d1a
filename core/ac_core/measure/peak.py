"""Peak memory of a region beyond what was allocated when it began."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves


class PeakMemory:
    """Context manager: ``bytes`` is the peak memory allocated inside it minus ``base_bytes``, what was allocated
    on entry (so ``base_bytes + bytes`` is the peak in all).

    On CUDA it reads the caching allocator's statistics (``torch.cuda.max_memory_allocated``). Elsewhere
    (CPU) it uses ``torch.distributed._tools.mem_tracker.MemTracker``, which follows every tensor storage
    made inside the region; ``track`` names what existed before it (modules, optimizers, tensors, or
    containers of tensors) so that it counts in the baseline. Allocate gradients before entering when
    the peak should exclude them, as a training loop that zeroes gradients in place does.
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
        from torch.distributed._tools.mem_tracker import MemTracker

        self._tracker = MemTracker()
        kinds = (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)
        external = [obj for obj in tree_leaves(self.track) if isinstance(obj, kinds)]
        if external:
            self._tracker.track_external(*external)
        self._tracker.__enter__()
        self.base_bytes = self._total(self._tracker.get_tracker_snapshot("current"))
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self.base_bytes
            return
        self._tracker.__exit__(*exc)
        self.bytes = max(0, self._total(self._tracker.get_tracker_snapshot("peak")) - self.base_bytes)
        self._tracker = None

    def _total(self, snapshot: dict[torch.device, dict[Any, int]]) -> int:
        for device, stats in snapshot.items():
            if torch.device(device).type == self.device.type:
                return stats["Total"]
        return 0


__all__ = ["PeakMemory"]
