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

    Memory only grows when an op allocates, so the live set is re-read and the peak taken only then:
    the cost grows with the number of live storages, not with everything ever allocated.
    """

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0
        self._live: dict[int, StorageWeakRef] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        created = new_storages(func, out)
        if created:
            for ref in created:
                self._live.setdefault(ref.cdata, ref)
            total = 0
            for key, ref in list(self._live.items()):
                if ref.expired():
                    del self._live[key]
                else:
                    total += live_nbytes(ref)
            self.peak = max(self.peak, total)
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
