"""Host buffers for offloaded tensors: slabs reused across steps, and the host-memory guard.

Tensors are packed one after another into large slabs rather than given a buffer each:
PyTorch's pinned-memory allocator rounds every request up to a power of two, so a 587 MB
activation would pin 1 GiB on its own, and pinning fresh memory per tensor stalls the host.
A slab (a power of two, at least ``slab_bytes``) goes back to the free list once all its
chunks are released and is reused by any later tensor that fits. Forward fills slabs in
order and backward empties them in reverse, so slabs free up as backward proceeds.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Hashable
from typing import Any

import torch

logger = logging.getLogger("ac_core")

_ALIGN = 512  # every chunk starts at a multiple of this, so it can be viewed as any dtype


def total_ram_bytes() -> int:
    """Physical memory of this machine (patched in tests)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _aligned(nbytes: int) -> int:
    return max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers exactly ``numel`` contiguous elements in some dimension order (no gaps, no overlap)."""
    if t.numel() == 0:
        return True
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride(), strict=True) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def host_view(data: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``data`` (uint8, ``like.nbytes`` long) viewed with ``like``'s dtype, shape and, when dense, strides."""
    flat = data.view(like.dtype)
    if is_dense(like):
        return flat.as_strided(like.shape, like.stride())
    return flat.view(like.shape)


class _Slab:
    __slots__ = ("data", "fences", "live", "top")

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data  # 1-D uint8
        self.top = 0
        self.live = 0
        # Per stream, the latest-recorded event of a copy that may still touch this slab (a later
        # event on a stream covers earlier ones), with its record order; a writer reusing it waits first.
        self.fences: dict[Hashable, tuple[int, Any]] = {}

    @property
    def capacity(self) -> int:
        return self.data.numel()


class Chunk:
    """``nbytes`` bytes of a slab, and the fences its writer must wait for before writing."""

    __slots__ = ("data", "fences", "nbytes", "size", "slab")

    def __init__(self, slab: _Slab, offset: int, nbytes: int, size: int) -> None:
        self.slab = slab
        self.nbytes = nbytes
        self.size = size
        self.data = slab.data[offset : offset + nbytes]
        self.fences = [fence for _, fence in slab.fences.values()]


class HostPool:
    """Slabs of host memory from ``allocate(nbytes) -> 1-D uint8 tensor``, reused across steps.

    Thread-safe: backward releases chunks from autograd's device threads.
    """

    # 256 MiB: large enough that activations of long sequences (96 MiB for 32k tokens x 1536 in bf16)
    # share slabs with little left over at the end of each, small next to a training host's RAM.
    def __init__(self, allocate: Callable[[int], torch.Tensor], slab_bytes: int = 256 << 20) -> None:
        self._allocate = allocate
        self._slab_bytes = _pow2_ceil(slab_bytes)
        self._lock = threading.Lock()
        self._open: _Slab | None = None
        self._free: list[_Slab] = []
        self.held_bytes = 0  # all slabs, in use or free: what is pinned
        self.in_use_bytes = 0  # chunks not yet released
        self.slabs_allocated = 0
        self._warned = False

    def acquire(self, nbytes: int, max_host_fraction: float = 1.0) -> Chunk:
        """A chunk of at least ``nbytes``; warns once when the pool's slabs pass ``max_host_fraction`` of RAM."""
        size = _aligned(nbytes)
        with self._lock:
            slab = self._open
            if slab is None or slab.top + size > slab.capacity:
                self._close_open()
                slab = self._take_free(size)
                if slab is None:
                    slab = self._new_slab(size)
                    self._guard(max_host_fraction)
                self._open = slab
            chunk = Chunk(slab, slab.top, nbytes, size)
            slab.top += size
            slab.live += 1
            self.in_use_bytes += size
        return chunk

    def release(self, chunk: Chunk, fence: Any = None, fence_key: Hashable = None, order: int = 0) -> None:
        """Give ``chunk`` back. ``fence`` (e.g. the CUDA event of the last copy touching it, recorded ``order``-th
        on the stream ``fence_key`` names) orders the slab's reuse after that copy."""
        slab = chunk.slab
        with self._lock:
            if fence is not None and order >= slab.fences.get(fence_key, (-1, None))[0]:
                slab.fences[fence_key] = (order, fence)
            slab.live -= 1
            self.in_use_bytes -= chunk.size
            if slab.live == 0:
                # Empty, even the open one: back to the free list, so that a step that repeats the
                # last one's sizes takes the same slabs in the same order and allocates nothing.
                if slab is self._open:
                    self._open = None
                self._recycle(slab)

    def _close_open(self) -> None:
        slab, self._open = self._open, None
        if slab is not None and slab.live == 0:
            self._recycle(slab)

    def _recycle(self, slab: _Slab) -> None:
        slab.top = 0
        self._free.append(slab)

    def _take_free(self, size: int) -> _Slab | None:
        fitting = [s for s in self._free if s.capacity >= size]
        if not fitting:
            return None
        slab = min(fitting, key=lambda s: s.capacity)
        self._free.remove(slab)
        return slab

    def _new_slab(self, size: int) -> _Slab:
        capacity = max(self._slab_bytes, _pow2_ceil(size))
        slab = _Slab(self._allocate(capacity))
        self.held_bytes += capacity
        self.slabs_allocated += 1
        return slab

    def _guard(self, max_host_fraction: float) -> None:
        if self._warned:
            return
        held, ram = self.held_bytes, total_ram_bytes()
        if held <= max_host_fraction * ram:
            return
        self._warned = True
        logger.warning(
            "ac-core: activation offload holds %.1f GiB of pinned host memory, more than %.0f%% of this machine's "
            "%.1f GiB RAM (OffloadConfig.max_host_fraction). Pinned memory cannot be swapped out; raise "
            "OffloadConfig.min_tokens or min_bytes, set checkpoint_inputs=False, or checkpoint more blocks.",
            held / 2**30,
            100 * max_host_fraction,
            ram / 2**30,
        )
