"""Collectives by their dispatcher op names, and which of their calls move activations (keepable) or parameters
(never kept).

Under FSDP2 each block's parameters are all-gathered when the block runs and resharded after; keeping that
all-gather's output would pin every checkpointed block's whole weights until backward, undoing the sharding, and
its gradients' reduce-scatter runs after backward, outside any checkpointed region. Sequence parallelism's
collectives move activations instead: Ulysses' all-to-alls of q, k, v and the attention output, a ring's
exchange of keys and values. Keeping their outputs holds activation-sized tensors and spares recompute a network
round per attention call. So a collective is kept only where it is a functional collective (its output a new
tensor: ``_c10d_functional``), named as carrying activations (by the adapter for ``ops``; a plan weighs any by
its bytes and link time), and what it moves is no parameter: a call whose
input is a parameter or buffer of the block, a view of one or made from them alone (a cast, FSDP's copy into its
flat all-gather buffer) moves parameters. Every rank decides from op names and tensor identity alone, so every
rank decides the same (a keep decision that differs between ranks deadlocks the recompute's collectives).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar, cast

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

# Op namespaces of collectives.
COLLECTIVE_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "c10d", "c10d_functional")

# The namespace whose collectives return their output as a new tensor (torch.distributed._functional_collectives):
# the only ones whose output can be kept. c10d's own ops write into tensors given to them.
FUNCTIONAL_NAMESPACE = "_c10d_functional"

WAIT_TENSOR = "_c10d_functional::wait_tensor"
"""What a functional collective's output is waited with; kept with the collective it waits on, never alone (kept
alone, backward re-runs the collective and never waits on it)."""

ACTIVATION_COLLECTIVES: frozenset[str] = frozenset({"_c10d_functional::all_to_all_single"})
"""The collectives ``ops`` keeps by default where they move activations: the all-to-all of Ulysses (diffusers'
``ulysses_degree``, xDiT, FastVideo) and of a ring rotated by ``permute_tensor``. A ring's all-gather of keys and
values (``_c10d_functional::all_gather_into_tensor``) is an adapter's to declare (``AdapterSpec.
activation_collectives``), or a plan's to keep where its budget allows."""


def is_collective(op_name: str) -> bool:
    """True for a dispatcher op name in a collective namespace, e.g. ``_c10d_functional::all_gather_into_tensor``."""
    return op_name.split("::", 1)[0] in COLLECTIVE_NAMESPACES and "::" in op_name


def is_keepable_collective(op_name: str) -> bool:
    """A functional collective other than the wait: one whose output a selective checkpoint can keep."""
    return op_name.startswith(f"{FUNCTIONAL_NAMESPACE}::") and op_name.partition(".")[0] != WAIT_TENSOR


def check_activation_collectives(names: Iterable[str], where: str) -> frozenset[str]:
    """``names`` as a frozenset, each a keepable functional collective; else a ValueError naming ``where``."""
    result = frozenset(names)
    waits = sorted(n for n in result if n.partition(".")[0] == WAIT_TENSOR)
    if waits:
        raise ValueError(
            f"{where}: {waits[0]!r} is the wait, not the collective: name the collective it waits on "
            "(e.g. '_c10d_functional::all_to_all_single'); its wait is kept with it"
        )
    other = sorted(n for n in result if not is_keepable_collective(n))
    if other:
        raise ValueError(
            f"{where}: {other} are not functional collectives ('_c10d_functional::...', whose output is a new "
            "tensor): only those can be kept"
        )
    return result


def _storage(tensor: torch.Tensor) -> StorageWeakRef | None:
    local = getattr(tensor, "_local_tensor", tensor)  # a DTensor parameter (FSDP2's shard): its local storage
    try:
        return StorageWeakRef(local.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None  # a tensor without storage (a fake or functional wrapper): no identity to go by


def _storages(value: Any) -> list[StorageWeakRef | None]:
    return [_storage(t) for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


class _Storages:
    """A set of storages by identity. Weak references: they keep no tensor alive, yet keep a freed storage's
    address from being taken by another while held, so an identity never stands for two tensors (an address
    reused on one rank only would make the ranks decide apart)."""

    __slots__ = ("_refs",)

    def __init__(self) -> None:
        self._refs: dict[int, StorageWeakRef] = {}

    def add(self, refs: Iterable[StorageWeakRef | None]) -> None:
        self._refs.update((ref.cdata, ref) for ref in refs if ref is not None)

    def __contains__(self, ref: StorageWeakRef | None) -> bool:
        held = self._refs.get(ref.cdata) if ref is not None else None
        return held is not None and not held.expired()


class CollectiveKeeper:
    """Per checkpointed call of a block: which collective calls may be kept, and which waits go with them.

    Seeded with the block's parameters and buffers, it follows every op call of the call's forward (:meth:`saw`):
    an output made from parameter data alone is parameter data too. :meth:`moves_activations` says whether a
    collective call moves none of it; :meth:`kept` records a kept output, and :meth:`waits_on_kept` whether a
    wait's input is one, so that recompute runs neither the collective nor its wait.
    """

    __slots__ = ("_kept", "_parameters")

    def __init__(self, state: Iterable[torch.Tensor]) -> None:
        self._parameters = _Storages()
        self._parameters.add(map(_storage, state))
        self._kept = _Storages()

    def saw(self, args: tuple, kwargs: dict[str, Any], out: Any) -> None:
        inputs = _storages((args, kwargs))
        if inputs and all(ref in self._parameters for ref in inputs):
            self._parameters.add(_storages(out))

    def moves_activations(self, args: tuple, kwargs: dict[str, Any]) -> bool:
        inputs = _storages((args, kwargs))
        return bool(inputs) and all(ref is not None and ref not in self._parameters for ref in inputs)

    def kept(self, out: Any) -> None:
        self._kept.add(_storages(out))

    def waits_on_kept(self, args: tuple) -> bool:
        inputs = _storages(args)
        return bool(inputs) and all(ref in self._kept for ref in inputs)


def group_name(func: Any, args: tuple, kwargs: dict[str, Any]) -> str | None:
    """The name of the process group a collective call runs over, from its ``group_name`` argument (None where
    it has none)."""
    names = [a.name for a in func._schema.arguments]
    if "group_name" not in names:
        return None
    index = names.index("group_name")
    name = kwargs.get("group_name", args[index] if index < len(args) else None)
    return name if isinstance(name, str) else None


def group_size(name: str | None) -> int:
    """The ranks process group ``name`` spans (1 for None)."""
    if name is None:
        return 1
    from torch.distributed.distributed_c10d import _get_group_size_by_name

    return _get_group_size_by_name(cast(Any, name))  # a GroupName, a str at run time


T = TypeVar("T")


def agreed(value: T, group: str | None) -> T:
    """``value`` as the first rank of process group ``group`` made it, on every rank of it (as is for None).

    What a rank measures of its own forward may differ by timing from another's (a collective's input freed by
    the communication thread before the measurement on one rank, after it on the other), so a plan made from it
    could keep other collectives on each rank and deadlock the recompute. Every rank of the group ran the
    measured collectives, so all of them are here to take the first one's."""
    if group is None:
        return value
    import torch.distributed as dist
    from torch._C._distributed_c10d import _resolve_process_group

    resolved = _resolve_process_group(cast(Any, group))  # a GroupName, a str at run time
    box: list[Any] = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(resolved, 0), group=resolved)
    return box[0]


def settle(groups: Iterable[str]) -> None:
    """Return once the communication threads of ``groups`` let go of what the collectives run so far moved.

    A finished collective's input is still held by the thread that ran it until that thread takes its next work,
    so a measurement of what a forward left alive counts it on one run and not on the next (on one rank and not
    the other). A barrier over the group is queued behind them and waits on every rank: past it, they are let go.
    """
    import torch.distributed as dist
    from torch._C._distributed_c10d import _resolve_process_group

    for name in groups:
        dist.barrier(group=_resolve_process_group(cast(Any, name)))  # a GroupName, a str at run time


def block_state(module: torch.nn.Module) -> list[torch.Tensor]:
    """A block's parameters and buffers: what :class:`CollectiveKeeper` counts as parameter data."""
    return [*module.parameters(), *module.buffers()]


__all__ = [
    "ACTIVATION_COLLECTIVES",
    "COLLECTIVE_NAMESPACES",
    "WAIT_TENSOR",
    "CollectiveKeeper",
    "agreed",
    "block_state",
    "check_activation_collectives",
    "group_name",
    "group_size",
    "is_collective",
    "is_keepable_collective",
    "settle",
]
