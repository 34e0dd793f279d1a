"""Counting dispatcher ops separately in forward and in backward (where recompute runs)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..op_names import op_matches


class OpCounter(TorchDispatchMode):
    """Counts every dispatcher op by name, split into ``forward`` and ``backward``.

    An op counts as backward when it runs inside an autograd graph task, which is where
    checkpointed blocks are recomputed. Ops an ``ops`` policy retained are served from its
    cache during recompute and never reach this mode.
    """

    def __init__(self) -> None:
        super().__init__()
        self.forward: Counter[str] = Counter()
        self.backward: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        phase = self.backward if torch._C._current_graph_task_id() != -1 else self.forward
        phase[func.name()] += 1
        return func(*args, **(kwargs or {}))

    def count(self, names: Iterable[str], phase: str = "forward") -> int:
        """Calls of any op in ``names`` during ``phase`` ("forward" or "backward")."""
        counter = {"forward": self.forward, "backward": self.backward}[phase]
        wanted = set(names)
        return sum(n for op, n in counter.items() if op_matches(op, wanted))


class CompiledOpCounter(OpCounter):
    """An :class:`OpCounter` for torch.compile'd models: counts the ops their compiled code runs.

    A plain TorchDispatchMode makes torch.compile fall back to eager for as long as it is active
    (and then keep skipping the frame), so an OpCounter around a compiled model counts eager ops.
    This one asks to be left out of compilation and sees what the compiled artifacts dispatch:
    every aten op of an ``aot_eager`` graph, the ops an inductor graph calls out to (such as SDPA).
    """

    # A recomputed random op reaches the mode wrapped in a higher-order op that replays its RNG state
    # (run_and_save_rng_state / run_with_rng_state): counted as the op it wraps.
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not isinstance(func, torch._ops.HigherOrderOperator):
            return super().__torch_dispatch__(func, types, args, kwargs)
        inner = next((a for a in args[:2] if isinstance(a, torch._ops.OpOverload)), func)
        phase = self.backward if torch._C._current_graph_task_id() != -1 else self.forward
        phase[inner.name()] += 1
        return func(*args, **(kwargs or {}))
