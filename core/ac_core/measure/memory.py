"""Bytes of activations a forward pass leaves alive for backward."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

T = TypeVar("T")


def new_storages(func, out) -> list[tuple[tuple[str, int], torch.UntypedStorage]]:
    """The storages an op's result brings into being, keyed by (device, address); none for views and in-place ops."""
    schema = getattr(func, "_schema", None)
    if schema is not None and any(r.alias_info is not None for r in schema.returns):
        return []  # a view or in-place result: its storage is not new (a parameter's, often)
    storages = []
    for leaf in tree_leaves(out):
        if isinstance(leaf, torch.Tensor):
            storage = leaf.untyped_storage()
            storages.append(((str(leaf.device), storage.data_ptr()), storage))
    return storages


class _StorageRecorder(TorchDispatchMode):
    """Remembers every storage an op creates, weakly, with its size."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[tuple[str, int], tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key, storage in new_storages(func, out):
            self.storages[key] = (StorageWeakRef(storage), storage.nbytes())
        return out


class LivePeak(TorchDispatchMode):
    """Peak bytes of storages created inside the mode and alive at once.

    Memory only grows when an op allocates, so the live set is pruned and the peak taken only then:
    cost grows with the number of live storages, not with everything ever allocated.
    """

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0
        self._live: dict[tuple[str, int], tuple[StorageWeakRef, int]] = {}
        self._live_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        created = new_storages(func, out)
        if created:
            for key in [k for k, (ref, _) in self._live.items() if ref.expired()]:
                self._live_bytes -= self._live.pop(key)[1]
            for key, storage in created:
                if key not in self._live:
                    nbytes = storage.nbytes()
                    self._live[key] = (StorageWeakRef(storage), nbytes)
                    self._live_bytes += nbytes
            self.peak = max(self.peak, self._live_bytes)
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
    returned = {
        (str(t.device), t.untyped_storage().data_ptr()) for t in tree_leaves(result) if isinstance(t, torch.Tensor)
    }
    held = sum(nbytes for key, (ref, nbytes) in recorder.storages.items() if key not in returned and not ref.expired())
    return result, held
