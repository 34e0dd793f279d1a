"""The one place that overrides a module's ``forward``: a chain of layers on the instance.

Checkpointing, activation offload, keep-on-device regions and bench's ``save_on_cpu`` baseline each add
a :class:`ForwardLayer` to a module's chain instead of replacing ``forward`` themselves. The instance's
``forward`` becomes one bound method that runs the layers outermost first, each handed the call to the
one below it, down to the forward that was there before the first layer (the class's, or an instance
forward someone else set). Any layer can be removed in any order and the others keep working; the
last one removed restores the forward that was there. The module tree is left as it is, so every
parameter, module and state_dict name stays the plain model's.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any, ClassVar

from torch import nn

CHAIN_ATTR = "_ac_core_chain"


class ForwardLayer:
    """One layer of a module's forward chain. ``kind`` names it; a module holds at most one layer per kind."""

    kind: ClassVar[str]

    def forward(self, module: nn.Module, call_next: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        """Run the module's forward through this layer; ``call_next(*args, **kwargs)`` runs the rest of the chain."""
        raise NotImplementedError


class _Chain:
    """A module's layers (innermost first) and what ran before them."""

    __slots__ = ("class_forward", "layers", "previous_forward")

    def __init__(self, module: nn.Module) -> None:
        # Taken now: reaching the class's forward through type(module) inside a checkpointed call makes
        # dynamo break the graph for classes marked allow_in_graph (every diffusers transformer block).
        self.class_forward: Callable[..., Any] = type(module).forward
        self.previous_forward: Any = module.__dict__.get("forward")
        self.layers: list[ForwardLayer] = []


def _call_below(module: nn.Module, layer: ForwardLayer | None, *args: Any, **kwargs: Any) -> Any:
    """Run the chain from just below ``layer`` (from the top when None) down to the original forward."""
    chain: _Chain = module.__dict__[CHAIN_ATTR]
    layers = chain.layers
    # A layer removed while a call through it is in flight (a recompute after removal) continues below it.
    position = len(layers) if layer is None else next((i for i, each in enumerate(layers) if each is layer), 0)
    if position == 0:
        if chain.previous_forward is not None:
            return chain.previous_forward(*args, **kwargs)
        return chain.class_forward(module, *args, **kwargs)
    below = layers[position - 1]
    # A partial of a module-level function (not a closure): torch.compile accepts it as checkpoint's function.
    return below.forward(module, functools.partial(_call_below, module, below), args, kwargs)


class _ChainedForward:
    """The instance's ``forward``: runs its chain from the top.

    An object rather than a bound method so that it pickles (a pickled bound method is looked up by
    name on the unpickled module, where no such attribute exists); ``copy.deepcopy`` rebinds it to the
    copied module through the memo.
    """

    __slots__ = ("__self__",)

    def __init__(self, module: nn.Module) -> None:
        self.__self__ = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _call_below(self.__self__, None, *args, **kwargs)

    def __reduce__(self) -> tuple[type, tuple[nn.Module]]:
        return _ChainedForward, (self.__self__,)


def _installed(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, _ChainedForward) and forward.__self__ is module


def add(module: nn.Module, layer: ForwardLayer) -> None:
    """Put ``layer`` on ``module``'s chain, outermost; a layer of the same kind is replaced where it stands."""
    chain: _Chain | None = module.__dict__.get(CHAIN_ATTR)
    if chain is None:
        chain = _Chain(module)
        module.__dict__[CHAIN_ATTR] = chain
    for index, existing in enumerate(chain.layers):
        if existing.kind == layer.kind:
            chain.layers[index] = layer
            break
    else:
        chain.layers.append(layer)
    if not _installed(module):
        module.__dict__["forward"] = _ChainedForward(module)


def remove(module: nn.Module, kind: str) -> ForwardLayer | None:
    """Take the layer of ``kind`` off ``module``'s chain; returns it, or None where there was none.

    When it was the last layer, the forward that was there before the chain comes back.
    """
    chain: _Chain | None = module.__dict__.get(CHAIN_ATTR)
    if chain is None:
        return None
    found = next((layer for layer in chain.layers if layer.kind == kind), None)
    if found is None:
        return None
    chain.layers.remove(found)
    if not chain.layers:
        del module.__dict__[CHAIN_ATTR]
        if _installed(module):
            if chain.previous_forward is None:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = chain.previous_forward
    return found


def get(module: nn.Module, kind: str) -> ForwardLayer | None:
    """``module``'s layer of ``kind``, or None."""
    chain: _Chain | None = module.__dict__.get(CHAIN_ATTR)
    if chain is None:
        return None
    return next((layer for layer in chain.layers if layer.kind == kind), None)


def original_forward(module: nn.Module) -> Callable[..., Any]:
    """The forward below every layer, bound to ``module``: what its signature and behaviour are without ac-core."""
    chain: _Chain | None = module.__dict__.get(CHAIN_ATTR)
    previous = chain.previous_forward if chain is not None else module.__dict__.get("forward")
    return previous if previous is not None else types.MethodType(type(module).forward, module)
