"""Bytes of tensor storage a region creates: what a forward leaves alive for backward, and the peak."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

T = TypeVar("T")


def plain_tensors(value: Any) -> Iterator[torch.Tensor]:
    """The plain tensors in ``value``, looking inside wrapper subclasses (DTensor's local shard, ...)."""
    for leaf in tree_leaves(value):
        if not isinstance(leaf, torch.Tensor):
            continue
        if is_traceable_wrapper_subclass(leaf):
            inner_names, _ = leaf.__tensor_flatten__()
            yield from plain_tensors([getattr(leaf, name) for name in inner_names])
        else:
            yield leaf


def storage_ref(tensor: torch.Tensor) -> StorageWeakRef:
    """A weak reference to ``tensor``'s storage; its ``cdata`` identifies the storage while it lives."""
    return StorageWeakRef(tensor.untyped_storage())


def live_nbytes(ref: StorageWeakRef) -> int:
    """Current size of a weakly referenced storage: 0 once freed or resized away (as FSDP frees unsharded weights)."""
    storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
    return 0 if storage is None else storage.nbytes()


def new_storages(func, out) -> list[StorageWeakRef]:
    """The storages an op's result brings into being; none for views and in-place ops."""
    schema = getattr(func, "_schema", None)
    if schema is not None and any(r.alias_info is not None for r in schema.returns):
        return []  # a view or in-place result: its storage is not new (a parameter's, often)
    return [storage_ref(t) for t in plain_tensors(out)]


class _StorageRecorder(TorchDispatchMode):
    """Remembers, weakly, every storage an op creates."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, StorageWeakRef] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for ref in new_storages(func, out):
            self.storages[ref.cdata] = ref
        return out


class LivePeak(TorchDispatchMode):
    """Peak bytes of storages created inside the mode and alive at once.

    A running total counts every storage created, less those found freed at the last prune. That
    total can only overstate what is alive, so the live set is re-read (pruned) only when the total
    passes the peak so far: cheap in backward, where memory shrinks. Resizes (FSDP frees unsharded
    weights with ``resize_(0)``) are followed by wrapping ``UntypedStorage.resize_`` while active.
    """

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0
        self._refs: dict[int, StorageWeakRef] = {}
        self._bytes: dict[int, int] = {}
        self._total = 0
        self._resize: Any = None

    def __enter__(self) -> LivePeak:
        original = self._resize = torch.UntypedStorage.resize_

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            result = original(storage, size)
            key = StorageWeakRef(storage).cdata
            if key in self._bytes:
                self._total += storage.nbytes() - self._bytes[key]
                self._bytes[key] = storage.nbytes()
                self._update_peak()
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        super().__exit__(*exc)

    def _update_peak(self) -> None:
        if self._total <= self.peak:
            return
        for key in [k for k, ref in self._refs.items() if ref.expired()]:
            del self._refs[key]
            self._total -= self._bytes.pop(key)
        self.peak = max(self.peak, self._total)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        created = new_storages(func, out)
        for ref in created:
            old = self._refs.get(ref.cdata)
            if old is not None and not old.expired():
                continue  # the same storage, seen again
            if old is not None:  # a freed storage whose address was reused
                self._total -= self._bytes[ref.cdata]
            self._refs[ref.cdata] = ref
            self._bytes[ref.cdata] = live_nbytes(ref)
            self._total += self._bytes[ref.cdata]
        if created:
            self._update_peak()
        return out


def held_for_backward(fn: Callable[[], T]) -> tuple[T, int]:
    """Run ``fn`` (a forward returning the loss) and return its result and the bytes it left alive.

    Counted: distinct storages created during ``fn`` that are still alive when it returns, apart
    from those of its result. Autograd's saved tensors, the inputs a checkpointed block keeps for
    recompute and the outputs an ``ops`` policy retains are exactly such storages; parameters,
    buffers and inputs made before ``fn`` are not. Works on any device, CPU included.
    """
    recorder = _StorageRecorder()
    with recorder:
        result = fn()
    returned = {storage_ref(t).cdata for t in plain_tensors(result)}
    held = sum(live_nbytes(ref) for key, ref in recorder.storages.items() if key not in returned)
    return result, held
