"""Instruments for the checks: which module ran which kernel, what ``ops`` retained, and what ac-core logged."""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ac_core.measure import op_matches


def is_attention_like(op_name: str) -> bool:
    """An op name that looks like attention: a fused kernel, a custom attention op, or softmax."""
    lowered = op_name.lower()
    return "attention" in lowered or "attn" in lowered or "softmax" in lowered


class _Attribution(TorchDispatchMode):
    def __init__(self, matches: Callable[[str], bool]) -> None:
        super().__init__()
        self.matches = matches
        self.stack: list[str] = []
        self.counts: Counter[str | None] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.matches(func.name()):
            self.counts[self.stack[-1] if self.stack else None] += 1
        return func(*args, **(kwargs or {}))


def _push(attribution: _Attribution, fqn: str, module, args) -> None:
    attribution.stack.append(fqn)


def _pop(attribution: _Attribution, fqn: str, module, args, output) -> None:
    if attribution.stack and attribution.stack[-1] == fqn:
        attribution.stack.pop()


@contextmanager
def attribute_ops(modules: Mapping[str, nn.Module], matches: Callable[[str], bool]) -> Iterator[Counter[str | None]]:
    """Count ops for which ``matches(name)`` holds, by the innermost running module of ``modules`` (FQN -> module).

    Calls outside all of them count under ``None``. Yields the Counter, filled as the model runs.
    """
    attribution = _Attribution(matches)
    handles = []
    for fqn, module in modules.items():
        handles.append(module.register_forward_pre_hook(functools.partial(_push, attribution, fqn)))
        handles.append(module.register_forward_hook(functools.partial(_pop, attribution, fqn), always_call=True))
    try:
        with attribution:
            yield attribution.counts
    finally:
        for handle in handles:
            handle.remove()


def named_op_matcher(names: Iterable[str]) -> Callable[[str], bool]:
    """A matcher for ``attribute_ops`` that accepts the given op names (with or without overload)."""
    wanted = frozenset(names)
    return lambda op_name: op_matches(op_name, wanted)


@dataclass
class RetainedOutput:
    """One op output that an ``ops`` policy decided to keep for backward."""

    op: str
    device: torch.device
    nbytes: int
    storage: StorageWeakRef | None

    @property
    def alive(self) -> bool:
        return self.storage is not None and not self.storage.expired()


@dataclass
class RetainedRecord:
    """Every output ``ops`` retained while :func:`record_retained` was active, in order."""

    outputs: list[RetainedOutput] = field(default_factory=list)

    @property
    def op_names(self) -> frozenset[str]:
        return frozenset(out.op for out in self.outputs)


@contextmanager
def record_retained() -> Iterator[RetainedRecord]:
    """Record what ac-core's ``ops`` policy keeps: op name, device and a weak reference to each output.

    Works by wrapping ``ac_core.ops._policy`` for the duration, in this process only.
    """
    from torch.utils.checkpoint import CheckpointPolicy

    from ac_core import ops

    record = RetainedRecord()
    original = ops._policy

    def recording(names, retention, ctx, func, *args, **kwargs):
        decision = original(names, retention, ctx, func, *args, **kwargs)
        if decision == CheckpointPolicy.MUST_SAVE:
            outputs = [t for t in tree_leaves(getattr(ctx, "op_output", None)) if isinstance(t, torch.Tensor)]
            for tensor in outputs:
                # Compile traces fake tensors: their device is real, their storage is not.
                real = type(tensor) in (torch.Tensor, nn.Parameter)
                storage = StorageWeakRef(tensor.untyped_storage()) if real else None
                record.outputs.append(RetainedOutput(func.name(), tensor.device, tensor.nbytes, storage))
            if not outputs:
                record.outputs.append(RetainedOutput(func.name(), torch.device("meta"), 0, None))
        return decision

    ops._policy = recording
    try:
        yield record
    finally:
        ops._policy = original


@contextmanager
def capture_logs(logger_name: str = "ac_core", level: int = logging.WARNING) -> Iterator[list[logging.LogRecord]]:
    """Collect the records ``logger_name`` emits at ``level`` or above, whatever logging is configured."""
    logger = logging.getLogger(logger_name)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level)
    handler.emit = records.append  # type: ignore[method-assign]
    previous = logger.level
    if logger.getEffectiveLevel() > level:
        logger.setLevel(level)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


__all__ = [
    "RetainedOutput",
    "RetainedRecord",
    "attribute_ops",
    "capture_logs",
    "is_attention_like",
    "named_op_matcher",
    "record_retained",
]
