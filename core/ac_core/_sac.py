"""torch's selective-checkpoint contexts, with a recompute that runs the casts autocast's cache served in forward.

Under autocast a weight is cast once per autocast region and the cast reused (the cast cache): a block called
twice in one forward casts its weights in the first call only, while the recompute of each call casts them
again. torch's recompute matches every op to one the forward ran, so the second call's recompute fails with
"aten._to_copy.default encountered during backward but not found in storage", where ``full`` (no matching)
trains exactly. The extra cast is run where it is proven harmless at that moment: autocast is on, the op is the
cast, and no output of a cast was kept in that forward (so no kept output's index can shift); the cast's value
is the cached one's, and a cast saves nothing for backward.

The ops named in ``copied`` are kept as copies of their outputs: a block may change such an output in place after
the op ran (transformers' MoE routers normalise the top-k weights with ``/=``), and torch's cache holds the
output itself, so its recompute would refuse it as mutated; the copy keeps the values the op returned.

torch gives its own two modes a rule for some higher-order ops (``flex_attention``, ``invoke_subgraph``, compiled
regions), keyed by their exact classes; these subclasses take the same ops, and refuse the others as torch does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._ops import HigherOrderOperator
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import (
    _RECOMPUTE,
    _CachedTorchDispatchMode,
    _CachingTorchDispatchMode,
    _sac_storage_key,
    _VersionWrapper,
    create_selective_checkpoint_contexts,
)

from .op_names import op_matches

_CAST = torch.ops.aten._to_copy.default
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps")


def _refuse_unruled(func: Any, torch_mode: type) -> None:
    # Without this rule, HigherOrderOperator.dispatch raises for a subclass even where torch's mode has one.
    if isinstance(func, HigherOrderOperator) and torch_mode not in func.python_key_table:
        raise NotImplementedError(
            f"selective activation checkpointing has no rule for the higher-order op {func.name()!r} (torch's "
            f"{torch_mode.__name__} has none either): checkpoint the blocks that call it with Full()"
        )


class _CastTolerantRecompute(_CachedTorchDispatchMode):
    autocast: frozenset[str] = frozenset()
    supports_higher_order_operators = True

    def __enter__(self) -> Any:
        # Read on entering: inside __torch_dispatch__ the autocast keys are excluded, so it reads as off there.
        self.autocast = frozenset(kind for kind in _AUTOCAST_DEVICES if torch.is_autocast_enabled(kind))
        return super().__enter__()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        _refuse_unruled(func, _CachedTorchDispatchMode)
        if func is _CAST and self._extra_cast(func, args):
            self.func_counter[_sac_storage_key(func, args)] += 1
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _extra_cast(self, func: Any, args: tuple) -> bool:
        if not args or not isinstance(args[0], torch.Tensor) or args[0].device.type not in self.autocast:
            return False
        entries = self.storage.get(_sac_storage_key(func, args)) or {}
        return all(entry is _RECOMPUTE for entry in entries.values())


def _own_copy(value: Any) -> Any:
    return _VersionWrapper(value.detach().clone()) if isinstance(value, torch.Tensor) else _VersionWrapper(value)


class _CopyingCache(_CachingTorchDispatchMode):
    copied: frozenset[str] = frozenset()
    on_copy: Callable[[Any, list[torch.Tensor]], None] | None = None
    supports_higher_order_operators = True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        _refuse_unruled(func, _CachingTorchDispatchMode)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if op_matches(func.name(), self.copied) and not torch.compiler.is_compiling():
            key = _sac_storage_key(func, args)
            index = self.func_counter[key] - 1
            if self.storage[key][index] is not _RECOMPUTE:
                kept = tree_map(_own_copy, out)
                self.storage[key][index] = kept
                if self.on_copy is not None:
                    tensors = [w.val for w in tree_leaves(kept) if isinstance(w.val, torch.Tensor)]
                    self.on_copy(func, tensors)
        return out


def selective_contexts(
    policy_fn: Any,
    copied: frozenset[str] = frozenset(),
    on_copy: Callable[[Any, list[torch.Tensor]], None] | None = None,
) -> tuple[Any, Any]:
    """``(forward mode, recompute mode)`` for ``torch.utils.checkpoint``'s ``context_fn``, as
    ``create_selective_checkpoint_contexts(policy_fn)`` makes them, with the cast-tolerant recompute; the kept
    outputs of the ops in ``copied`` (op names, matched as ``ops.op_matches`` does) are kept as copies, and
    ``on_copy(func, copies)`` is told what is kept in their place."""
    caching, cached = create_selective_checkpoint_contexts(policy_fn)
    if copied:
        caching = _CopyingCache(policy_fn, caching.storage)
        caching.copied = copied
        caching.on_copy = on_copy
    return caching, _CastTolerantRecompute(None, cached.storage)
