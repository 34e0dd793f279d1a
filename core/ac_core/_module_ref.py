"""A weak reference to a model that pickles and deep-copies along with it."""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn


class ModuleRef:
    """A weak reference to the model a checkpointed block belongs to, kept by the block's checkpoint layer.

    Weak, so that a block does not keep its model alive. It pickles and deep-copies along with the model:
    pickled, it refers to the model (pickled with it, once); deep-copied with the model, it refers to the copy;
    a block deep-copied on its own gets an empty reference (its own ``gradient_checkpointing`` flag is still checked).
    """

    __slots__ = ("_ref",)

    def __init__(self, module: nn.Module | None = None) -> None:
        self._ref = None if module is None else weakref.ref(module)

    def __call__(self) -> nn.Module | None:
        return None if self._ref is None else self._ref()

    def __reduce__(self) -> tuple[type, tuple[nn.Module | None]]:
        return ModuleRef, (self(),)

    def __deepcopy__(self, memo: dict[int, Any]) -> ModuleRef:
        module = self()
        copied = None if module is None else memo.get(id(module))
        return ModuleRef(copied if isinstance(copied, nn.Module) else None)
