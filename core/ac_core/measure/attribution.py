"""Which running module each dispatcher op belongs to: ops counted by the innermost module of a set."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


class _Attribution(TorchDispatchMode):
    def __init__(self, matches: Callable[[str], bool]) -> None:
        super().__init__()
        self.matches = matches
        self.stack: list[str] = []
        self.counts: Counter[str | None] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self.matches(func.name()):
            self.counts[self.stack[-1] if self.stack else None] += 1
        return func(*args, **(kwargs or {}))


def _push(attribution: _Attribution, fqn: str, module: nn.Module, args: Any) -> None:
    attribution.stack.append(fqn)


def _pop(attribution: _Attribution, fqn: str, module: nn.Module, args: Any, output: Any) -> None:
    if attribution.stack and attribution.stack[-1] == fqn:
        attribution.stack.pop()


@contextmanager
def attribute_ops(
    modules: Mapping[str, nn.Module], matches: Callable[[str], bool] = lambda name: True
) -> Iterator[Counter[str | None]]:
    """Count dispatcher ops for which ``matches(op name)`` holds, by the innermost running module of ``modules``.

    ``modules`` maps a label (an FQN, a class name) to a module; calls outside all of them count under
    ``None``. Yields the Counter, filled as the model runs; forward hooks are removed on exit.
    """
    attribution = _Attribution(matches)
    handles = []
    for label, module in modules.items():
        handles.append(module.register_forward_pre_hook(functools.partial(_push, attribution, label)))
        handles.append(module.register_forward_hook(functools.partial(_pop, attribution, label), always_call=True))
    try:
        with attribution:
            yield attribution.counts
    finally:
        for handle in handles:
            handle.remove()
