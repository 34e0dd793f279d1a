"""One offload session: autograd's saved-tensor hooks deciding what moves, and ordering it.

What reaches these hooks depends on the checkpointing policy, which is how offload knows it:
inside a block checkpointed by torch.utils.checkpoint (non-reentrant), the checkpoint's own
hooks take every save, so nothing of the block's inside arrives here; the block's inputs, which
the checkpoint keeps for recompute, are saved through the hooks outside it, so they do. Under
``ops``, torch's selective checkpoint keeps the retained op outputs (attention) in its caching
dispatch mode's storage, never through saved-tensor hooks: they stay on the device by
construction. Tensors saved outside checkpointed blocks (an unchecked block, the head) arrive
here as themselves.
"""

from __future__ import annotations

import collections
import sys
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from . import _regions
from ._transport import OffloadTransport, transport_for
from .config import OffloadConfig
from .stats import Kept, OffloadStats

_PLAIN = (torch.Tensor, nn.Parameter)

StorageKey = tuple[torch.device, int]


def storage_key(t: torch.Tensor) -> StorageKey:
    return t.device, t.untyped_storage().data_ptr()


def kept_reason(t: torch.Tensor, min_bytes: int, alive: Callable[[torch.Tensor], Kept | None]) -> Kept | None:
    """Why a saved plain tensor ``t`` stays on its device wherever it is saved; None where it moves.

    ``alive(t)``: why its storage outlives the forward anyway, if it does. One rule for the session and for the
    memory-budget planner, which predicts what a plan's offload moves (on meta and fake tensors too).
    """
    if t.layout is not torch.strided:
        return Kept.UNSUPPORTED
    if any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride(), strict=True)):
        # An expanded view: its copy would materialize the expansion, on the host and again on return.
        return Kept.UNSUPPORTED
    base = t._base if t._is_view() and t._base is not None else t
    if isinstance(t, nn.Parameter) or isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad):
        return Kept.PARAMETER
    reason = alive(t)
    if reason is not None:
        return reason
    if t.numel() * t.element_size() < min_bytes:
        return Kept.SMALL
    return None


def _modified(shape: torch.Size, saved: int, now: int) -> RuntimeError:
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"a tensor of shape {list(shape)} saved at version {saved} is at version {now} (ac-core activation offload "
        "checks this as autograd does without saved-tensor hooks). Make the in-place operation out of place."
    )


class _KeptSave:
    """A save that stays where it is: a detached alias (no grad_fn, so no reference cycle through autograd)."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach()
        self.version = tensor._version


class _Offloaded:
    """A save copied to the host. Autograd owns it; when autograd drops it, its host memory goes back."""

    __slots__ = (
        "__weakref__",
        "consumed",
        "index",
        "nbytes",
        "reload",
        "session",
        "shape",
        "source",
        "stale",
        "storage",
        "ticket",
        "transport",
        "version",
    )

    def __init__(self, session: OffloadSession, transport: OffloadTransport, tensor: torch.Tensor, index: int):
        self.ticket: Any = None  # first: __del__ runs even when start_offload raises
        self.source: torch.Tensor | None = None
        self.reload: Any = None
        self.session = session
        self.transport = transport
        self.nbytes = tensor.numel() * tensor.element_size()
        self.shape = tensor.shape
        self.version = tensor._version
        self.storage = StorageWeakRef(tensor.untyped_storage())
        self.index = index
        self.ticket = transport.start_offload(tensor, session.config.max_host_fraction)
        # Held (as a detached alias) until the copy has finished: dropping it earlier would let the
        # allocator hand its memory to new work while the copy still reads it.
        self.source = tensor.detach()
        self.consumed = False
        self.stale = False

    def let_go(self) -> None:
        """Drop the device original (its copy has finished or is fenced), noting an in-place change since the save."""
        if self.source is not None and self.source._version != self.version:
            self.stale = True
        self.source = None

    def __del__(self) -> None:
        if sys.is_finalizing():
            return
        self.session._discard(self)


class OffloadSession(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that offload what is worth it, for one forward and its backward.

    Built by :func:`offload_activations`; ``stats`` says what it did. ``alive`` maps storages that
    outlive the forward anyway (the model's buffers, its inputs) to the reason they stay.
    """

    def __init__(self, config: OffloadConfig, alive: dict[StorageKey, Kept] | None = None) -> None:
        self.config = config
        self.stats = OffloadStats()
        self._alive = alive or {}
        # Re-entrant: a handle autograd drops while this thread holds the lock cleans up through it.
        self._lock = threading.RLock()
        self._order: list[weakref.ref[_Offloaded]] = []
        self._inflight: collections.deque[tuple[weakref.ref[_Offloaded], int]] = collections.deque()
        self._inflight_bytes = 0
        self._prefetched_bytes = 0
        self._top: int | None = None
        self._shared: dict[tuple, weakref.ref[_Offloaded]] = {}
        self._scope = _regions.session_scope()
        super().__init__(self._pack, self._unpack)

    def __enter__(self) -> OffloadSession:  # pyright: ignore[reportIncompatibleMethodOverride]
        self._scope.__enter__()
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._scope.__exit__()
        with self._lock:
            self._drain()

    # -- forward ---------------------------------------------------------------------------------

    def _kept_reason(self, t: torch.Tensor) -> Kept | None:
        if _regions.in_no_offload():
            return Kept.NO_OFFLOAD
        if type(t) not in _PLAIN:
            return Kept.UNSUPPORTED
        reason = kept_reason(t, self.config.min_bytes, lambda t: self._alive.get(storage_key(t)))
        if reason is None and _regions.in_checkpoint_inputs() and not self.config.checkpoint_inputs:
            return Kept.CHECKPOINT_INPUT
        return reason

    def _pack(self, t: torch.Tensor) -> _KeptSave | _Offloaded:
        reason = self._kept_reason(t)
        transport = transport_for(t) if reason is None else None
        if transport is None:
            reason = reason or Kept.OTHER_DEVICE
            self.stats.kept[reason] += 1
            self.stats.kept_bytes[reason] += t.numel() * t.element_size()
            return _KeptSave(t)
        with self._lock:
            return self._offload(t, transport)

    def _offload(self, t: torch.Tensor, transport: OffloadTransport) -> _Offloaded:
        key = (*storage_key(t), t.storage_offset(), t.shape, t.stride(), t.dtype)
        ref = self._shared.get(key)
        handle = ref() if ref is not None else None
        if handle is not None and not handle.storage.expired() and handle.version == t._version:
            self.stats.shared += 1  # e.g. rotary embeddings passed to every block
            return handle
        handle = _Offloaded(self, transport, t, len(self._order))
        self._order.append(weakref.ref(handle))
        self._shared[key] = weakref.ref(handle)
        self._inflight.append((weakref.ref(handle), handle.nbytes))
        self._inflight_bytes += handle.nbytes
        stats = self.stats
        stats.offloaded += 1
        stats.offloaded_bytes += handle.nbytes
        if _regions.in_checkpoint_inputs():
            stats.checkpoint_inputs += 1
            stats.checkpoint_input_bytes += handle.nbytes
        self._drain()
        return handle

    def _drain(self) -> None:
        """Let go of originals whose copy finished; past ``max_inflight_bytes``, make compute wait for the oldest.

        Copies to the host run in order on one stream, so the oldest unfinished one bounds the rest.
        """
        limit = self.config.max_inflight_bytes
        while self._inflight:
            ref, nbytes = self._inflight[0]
            handle = ref()
            if handle is not None and handle.source is not None:
                if handle.transport.offload_done(handle.ticket):
                    handle.let_go()
                elif self._inflight_bytes > limit:
                    handle.transport.fence_offload(handle.ticket, handle.source, throttle=True)
                    handle.let_go()
                    self.stats.throttled += 1
                else:
                    return
            self._inflight.popleft()
            self._inflight_bytes -= nbytes

    # -- backward --------------------------------------------------------------------------------

    def _unpack(self, packed: _KeptSave | _Offloaded) -> torch.Tensor:
        if isinstance(packed, _KeptSave):
            if packed.tensor._version != packed.version:
                raise _modified(packed.tensor.shape, packed.version, packed.tensor._version)
            return packed.tensor
        handle = packed
        out: torch.Tensor | None = None
        with self._lock:
            self._drain()
            reload = None
            if handle.source is not None:
                if handle.source._version != handle.version:
                    raise _modified(handle.shape, handle.version, handle.source._version)
                out = handle.source  # its copy has not finished yet: no need for one back
                self.stats.reused += 1
            elif handle.stale:
                raise _modified(handle.shape, handle.version, handle.version + 1)
            elif handle.reload is not None:
                reload, handle.reload = handle.reload, None
                self._prefetched_bytes -= handle.nbytes
            else:
                reload = handle.transport.start_reload(handle.ticket)
                self.stats.on_demand += 1
            handle.consumed = True
            self._prefetch()
        if reload is not None:
            out = handle.transport.finish_reload(reload)
        assert out is not None  # the source was reused or a reload started
        return out

    def _prefetch(self) -> None:
        """Start copying back the newest saves backward has not used yet, up to ``prefetch_bytes`` in flight.

        Backward consumes saves in roughly the reverse order of the forward (a node's own saves in
        forward order), so the newest unused ones are needed next. ``_top`` is the newest save not yet
        settled (used, coming back, still resident, or dead); it only moves down.
        """
        budget = self.config.prefetch_bytes
        if budget == 0:
            return
        if self._top is None:
            self._top = len(self._order) - 1
        index = self._top
        while index >= 0:
            handle = self._order[index]()
            if handle is None or handle.consumed or handle.source is not None or handle.reload is not None:
                if index == self._top:
                    self._top -= 1
                index -= 1
                continue
            if self._prefetched_bytes and self._prefetched_bytes + handle.nbytes > budget:
                return
            handle.reload = handle.transport.start_reload(handle.ticket)
            self._prefetched_bytes += handle.nbytes
            self.stats.prefetched += 1
            index -= 1

    def _discard(self, handle: _Offloaded) -> None:
        """Autograd dropped ``handle`` (its node ran, or the graph was freed): release what it holds, safely."""
        if handle.ticket is None:
            return
        transport = handle.transport
        if handle.source is not None and not transport.offload_done(handle.ticket):
            transport.fence_offload(handle.ticket, handle.source, throttle=False)
        if handle.reload is not None:
            transport.drop_reload(handle.reload)
            with self._lock:
                self._prefetched_bytes -= handle.nbytes
        transport.free(handle.ticket)


def alive_storages(model: nn.Module | None, inputs: Iterable[Any] = ()) -> dict[StorageKey, Kept]:
    """Storages that outlive the forward anyway: ``model``'s buffers and the tensors among ``inputs``."""
    alive: dict[StorageKey, Kept] = {}
    for t in inputs:
        if isinstance(t, torch.Tensor) and type(t) in _PLAIN:
            alive[storage_key(t)] = Kept.MODEL_INPUT
    if model is not None:
        for t in model.buffers():
            if type(t) in _PLAIN:
                alive[storage_key(t)] = Kept.PARAMETER
    return alive
