"""The one place that overrides a module's ``forward``: a chain of layers on the instance.

Checkpointing, activation offload, keep-on-device regions and bench's ``save_on_cpu`` baseline each add
a :class:`ForwardLayer` to a module's chain instead of replacing ``forward`` themselves. The instance's
``forward`` becomes one callable that runs the layers outermost first, each handed the call to the
one below it, down to the forward that was there before the first layer (the class's, or an instance
forward someone else set). Any layer can be removed in any order and the others keep working; the
last one removed restores the forward that was there. The module tree is left as it is, so every
parameter, module and state_dict name stays the plain model's.

Other libraries replace the instance's ``forward`` too, and keep the forward they replaced, to call it
and to put it back: diffusers' and accelerate's hooks, read by :mod:`ac_core.libraries.hooks` (which says
how each keeps it and what its pre- and post-forward do). Their pre-forward readies the weights and their
post-forward takes them away again, so a checkpoint must run them again when it recomputes. Hence, where
a foreign forward meets ac-core's:

- **The layers run at the top.** A foreign forward set over ac-core's (its library applied after ac-core)
  gets another ac-core forward over it, which runs the layers around it: checkpoint(foreign forward ->
  class forward) is what runs and what recomputes. An ac-core forward reached while the layers already
  run above it passes straight through (``_Chain.depth``). Such a foreign forward is found when a layer is
  added (the library was applied first), or when the model ac-core was applied to is called (the library
  came after): a forward pre-hook on that model (:func:`link_root`) settles every module before any of
  them runs, so the very first call of each block is checkpointed above the foreign forward. No library
  says when it sets a forward, and noticing the assignment would take a descriptor or ``__setattr__`` on
  the module's class; the model's call comes before every block's. A block called on its own (not
  through that model) after such a forward was set is found only from inside it, where a layer that runs
  its call again (checkpoint) could not run that forward again: that one call is not checkpointed (exact;
  the block keeps its activations once), which is logged, and the whole model is settled then.
- **Ac-core's forward is kept where those libraries keep what they restore.** Added over a library's
  hook, ac-core also puts a forward of its own where that library keeps the forward it wrapped, so
  removing their hook brings back ac-core's (which runs the layers once on top) and not the forward from
  before ac-core. Removing ac-core's last layer takes its forwards out of those places again; one still
  called by a forward that keeps it elsewhere (``__wrapped__`` only) passes straight through.
- **A foreign post-forward below a checkpoint runs in the recompute.** torch's early stop, which would end
  a recompute before that post-forward, is off where a hook below undoes its pre-forward; it stays on
  where a hook below replaces the call with work of its own after the block (``Hook.replaces_call``).
- **What no longer reaches ac-core's forward is reported.** A forward that replaced ac-core's without
  keeping it (a library that restored what it had kept from before ac-core) makes :func:`active` false;
  removal then leaves that forward as it is rather than put back a stale one.

The depth count is per module, not per thread: one module runs one call (or its recompute) at a time.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, TypeGuard

import torch
from torch import nn
from torch.utils.checkpoint import set_checkpoint_early_stop

from ._module_ref import ModuleRef
from .libraries import hooks

CHAIN_ATTR = "_ac_core_chain"

logger = logging.getLogger("ac_core")

# Links followed from an instance's forward down to the class's: enough for any stack of hooks.
_WALK_LIMIT = 64


class ForwardLayer:
    """One layer of a module's forward chain. ``kind`` names it; a module holds at most one layer per kind.

    ``reruns`` is True for a layer that calls ``call_next`` again after the call returned (checkpoint's
    recompute): it runs above every foreign forward on the module, which then runs again with it.
    """

    kind: ClassVar[str]
    reruns: ClassVar[bool] = False

    def forward(self, module: nn.Module, call_next: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        """Run the module's forward through this layer; ``call_next(*args, **kwargs)`` runs the rest of the chain."""
        raise NotImplementedError


class _Chain:
    """A module's layers (innermost first) and what ran before them."""

    __slots__ = ("class_forward", "depth", "layers", "previous_forward", "root")

    def __init__(self, module: nn.Module) -> None:
        # Taken now: reaching the class's forward through type(module) inside a checkpointed call makes
        # dynamo break the graph for classes marked allow_in_graph (every diffusers transformer block).
        self.class_forward: Callable[..., Any] = type(module).forward
        self.previous_forward: Any = module.__dict__.get("forward")
        self.layers: list[ForwardLayer] = []
        # Calls in flight (or recomputing) whose layers ran in an ac-core forward above a foreign one.
        self.depth = 0
        # The model the module was set up in: a foreign forward found at a call settles all of its modules.
        self.root = ModuleRef()


class _ChainedForward:
    """An instance ``forward`` of ac-core's: runs its module's chain, then ``below``.

    ``below`` is None for the class's forward, else the forward this one was put over. An object rather
    than a bound method so that it pickles (a pickled bound method is looked up by name on the unpickled
    module, where no such attribute exists); ``copy.deepcopy`` rebinds it to the copied module through the memo.
    """

    __slots__ = ("__self__", "below")

    def __init__(self, module: nn.Module, below: Any = None) -> None:
        self.__self__ = module
        self.below = below

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.__self__
        chain: _Chain | None = module.__dict__.get(CHAIN_ATTR)
        if chain is None or chain.depth:
            # ac-core's layers are gone (a foreign forward kept this one), or already run above it.
            return _bottom(self, chain, args, kwargs)
        top = module.__dict__.get("forward")
        if top is not self and not _is_ours(top, module):
            return _under_foreign(self, chain, top, args, kwargs)
        if self.below is not None and any(layer.reruns for layer in chain.layers) and _undoes_below(module, self.below):
            with set_checkpoint_early_stop(False):
                return _call_below(self, None, *args, **kwargs)
        return _call_below(self, None, *args, **kwargs)

    def __reduce__(self) -> tuple[type, tuple[nn.Module, Any]]:
        return _ChainedForward, (self.__self__, self.below)


def _is_ours(forward: Any, module: nn.Module) -> TypeGuard[_ChainedForward]:
    return isinstance(forward, _ChainedForward) and forward.__self__ is module


def _call_below(forward: _ChainedForward, layer: ForwardLayer | None, *args: Any, **kwargs: Any) -> Any:
    """Run the chain from just below ``layer`` (from the top when None) down to ``forward``'s ``below``."""
    module = forward.__self__
    chain: _Chain | None = module.__dict__.get(CHAIN_ATTR)
    layers = chain.layers if chain is not None else []
    # A layer removed while a call through it is in flight (a recompute after removal) continues below it.
    position = len(layers) if layer is None else next((i for i, each in enumerate(layers) if each is layer), 0)
    if position == 0:
        return _bottom(forward, chain, args, kwargs)
    below = layers[position - 1]
    # A partial of a module-level function (not a closure): torch.compile accepts it as checkpoint's function.
    return below.forward(module, functools.partial(_call_below, forward, below), args, kwargs)


def _call_layers(forward: _ChainedForward, layers: tuple[ForwardLayer, ...], *args: Any, **kwargs: Any) -> Any:
    """Run ``layers`` (innermost first) down to ``forward``'s ``below``."""
    if not layers:
        return _bottom(forward, forward.__self__.__dict__.get(CHAIN_ATTR), args, kwargs)
    return layers[-1].forward(forward.__self__, functools.partial(_call_layers, forward, layers[:-1]), args, kwargs)


def _bottom(forward: _ChainedForward, chain: _Chain | None, args: tuple, kwargs: dict[str, Any]) -> Any:
    module = forward.__self__
    if forward.below is None:
        class_forward = chain.class_forward if chain is not None else type(module).forward
        return class_forward(module, *args, **kwargs)
    if chain is None:
        return forward.below(*args, **kwargs)
    # An ac-core forward of this module reached from here (inside a foreign one) passes straight through.
    chain.depth += 1
    try:
        return forward.below(*args, **kwargs)
    finally:
        chain.depth -= 1


def _under_foreign(forward: _ChainedForward, chain: _Chain, top: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """A call that came up through a foreign forward set over ac-core's after ac-core's layers were added, and not
    settled before it: a module called on its own, not through its model (or the model itself)."""
    module = forward.__self__
    with reports():
        _note(logging.INFO, "found", module, _describe(module, top))
        _settle(chain.root() or module)
    # This call is inside that forward already, which a layer that runs its call again could not run again.
    layers = tuple(layer for layer in chain.layers if not layer.reruns)
    return _call_layers(forward, layers, *args, **kwargs)


# Following a forward to the one it calls: (what it calls, how to make it call another or None).
_Link = tuple[Any, Callable[[Any], None] | None]


def _link(module: nn.Module, forward: Any) -> _Link | None:
    if _is_ours(forward, module):
        return forward.below, functools.partial(setattr, forward, "below")
    hook = hooks.hook_of(module, forward)
    if hook is not None:
        return hook.below, hook.redirect
    wrapped = getattr(forward, "__wrapped__", None)
    return (wrapped, None) if wrapped is not None else None


def _links(module: nn.Module, forward: Any) -> Iterator[_Link]:
    """The links from ``forward`` down, as far as they can be followed."""
    seen: set[int] = set()
    for _ in range(_WALK_LIMIT):
        if forward is None or id(forward) in seen:
            return
        seen.add(id(forward))
        found = _link(module, forward)
        if found is None:
            return
        yield found
        forward = found[0]


def _reaches_ours(module: nn.Module, forward: Any) -> bool:
    return _is_ours(forward, module) or any(_is_ours(target, module) for target, _ in _links(module, forward))


def _is_class_forward(module: nn.Module, forward: Any) -> bool:
    """Whether ``forward`` is the class's forward bound to ``module`` (as a library's hook keeps it)."""
    return (
        isinstance(forward, types.MethodType)
        and forward.__self__ is module
        and forward.__func__ is getattr(type(module).forward, "__func__", type(module).forward)
    )


def _undoes_below(module: nn.Module, forward: Any) -> bool:
    """Whether a hook at or below ``forward`` undoes its pre-forward in a post-forward, which a recompute must run
    too, and none replaces the call with a forward of its own, whose work after the call a recompute must not run."""
    undoes = False
    for each in (forward, *(target for target, _ in _links(module, forward))):
        hook = hooks.hook_of(module, each)
        if hook is not None:
            if hook.replaces_call():
                return False
            undoes = undoes or hook.undoes()
    return undoes


def _describe(module: nn.Module, forward: Any) -> str:
    if forward is None or _is_class_forward(module, forward):
        return "the class's forward"
    hook = hooks.hook_of(module, forward)
    if hook is not None:
        return hook.describe()
    return f"an instance forward ({getattr(forward, '__qualname__', type(forward).__name__)})"


def _put_over(module: nn.Module, top: Any) -> None:
    """Put an ac-core forward over the foreign ``top``, and where its library keeps what it restores, another."""
    if _reaches_ours(module, top):
        _note(logging.INFO, "over", module, _describe(module, top))
    else:
        # The deepest place that a library keeps a forward in (the first it wrapped): its removal puts ours back.
        kept = None
        for target, put in _links(module, top):
            if put is not None and target is not None:
                kept = target, put
        if kept is not None:
            target, put = kept
            put(_ChainedForward(module, None if _is_class_forward(module, target) else target))
            _note(logging.INFO, "kept", module, _describe(module, top))
    module.__dict__["forward"] = _ChainedForward(module, top)


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
    top = module.__dict__.get("forward")
    if top is None:
        module.__dict__["forward"] = _ChainedForward(module)
    elif not _is_ours(top, module):
        _put_over(module, top)


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
    if len(chain.layers) == 1:
        _take_out(module, found)
    chain.layers.remove(found)
    if not chain.layers:
        del module.__dict__[CHAIN_ATTR]
    return found


def _take_out(module: nn.Module, last: ForwardLayer) -> None:
    """Take ac-core's forwards off ``module`` (its last layer goes): from the top, and where libraries keep them."""
    top = module.__dict__.get("forward")
    if not _reaches_ours(module, top):
        _note(logging.WARNING, "gone", module, _describe(module, top), last)
        return
    while _is_ours(top, module):
        top = top.below
        if top is None:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = top
    stays = False
    forward = top
    for _ in range(_WALK_LIMIT):
        found = _link(module, forward) if forward is not None else None
        if found is None:
            break
        target, put = found
        if _is_ours(target, module):
            if put is None:
                stays = True
            else:
                while _is_ours(target, module):
                    target = target.below
                put(types.MethodType(type(module).forward, module) if target is None else target)
        forward = target
    if stays:
        _note(logging.INFO, "stays", module, _describe(module, top), last)


def get(module: nn.Module, kind: str) -> ForwardLayer | None:
    """``module``'s layer of ``kind``, or None."""
    chain: _Chain | None = module.__dict__.get(CHAIN_ATTR)
    if chain is None:
        return None
    return next((layer for layer in chain.layers if layer.kind == kind), None)


def active(module: nn.Module) -> bool:
    """Whether ``module``'s layers run when it is called: it has some, and its forward reaches ac-core's."""
    if module.__dict__.get(CHAIN_ATTR) is None:
        return False
    top = module.__dict__.get("forward")
    return _is_ours(top, module) or (top is not None and _reaches_ours(module, top))


def check(module: nn.Module) -> bool:
    """:func:`active`, and where ``module`` has layers that no longer run, a warning saying what replaced them."""
    if active(module):
        return True
    if module.__dict__.get(CHAIN_ATTR) is not None:
        _note(logging.WARNING, "dropped", module, _describe(module, module.__dict__.get("forward")))
    return False


def _set_over_ours(module: nn.Module) -> Any:
    """The foreign forward set over ac-core's on ``module`` since its layers were added, or None."""
    if module.__dict__.get(CHAIN_ATTR) is None:
        return None
    top = module.__dict__.get("forward")
    return top if top is not None and not _is_ours(top, module) and _reaches_ours(module, top) else None


def _settle(root: nn.Module) -> None:
    """Put ac-core's layers over every foreign forward set over ac-core's in ``root`` and its submodules."""
    for module in root.modules():
        if module.__dict__.get(CHAIN_ATTR) is None:
            continue
        top = _set_over_ours(module)
        if top is not None:
            _put_over(module, top)
        else:
            check(module)


def _settle_before_call(paths: tuple[tuple[str, ...], ...], root: nn.Module, args: tuple) -> None:
    """The forward pre-hook :func:`link_root` puts on the model: before any of its modules runs, ac-core's layers
    go over every foreign forward set over ac-core's since (a library applied after ac-core) on the modules at
    ``paths``, so that the first call of each block is checkpointed with that forward inside, as every later one is.

    Paths (their names, split) rather than modules: the hook pickles and deep-copies with the model, and a module
    replaced since is the one found. The model's own forward was taken before this hook ran, so the model itself
    is left to its call (see :func:`_under_foreign`). Under torch.compile nothing is moved: the graph is traced as
    it stands."""
    if torch.compiler.is_compiling():
        return
    with reports():
        for path in paths:
            module: nn.Module | None = root
            for atom in path:
                module = module._modules.get(atom) if module is not None else None
            top = None if module is None else _set_over_ours(module)  # None: taken out of the model since
            if top is not None and module is not None:
                _put_over(module, top)


def _is_settle_hook(hook: Any) -> bool:
    return isinstance(hook, functools.partial) and hook.func is _settle_before_call


def link_root(root: nn.Module) -> None:
    """Note ``root`` as the model of every module with layers in it, and settle those at each call of ``root``.

    A foreign forward found at one call of a module settles all; calling ``root`` settles all before any runs."""
    paths: list[tuple[str, ...]] = []
    for name, module in root.named_modules():
        chain: _Chain | None = module.__dict__.get(CHAIN_ATTR)
        if chain is not None:
            chain.root = ModuleRef(root)
            if module is not root:
                paths.append(tuple(name.split(".")))
    unlink_root(root)
    if paths:
        root.register_forward_pre_hook(functools.partial(_settle_before_call, tuple(paths)))


def unlink_root(root: nn.Module) -> None:
    """Take :func:`link_root`'s forward pre-hook off ``root``."""
    for key in [key for key, hook in root._forward_pre_hooks.items() if _is_settle_hook(hook)]:
        del root._forward_pre_hooks[key]


def original_forward(module: nn.Module) -> Callable[..., Any]:
    """The forward below every layer, bound to ``module``: what its signature and behaviour are without ac-core."""
    chain: _Chain | None = module.__dict__.get(CHAIN_ATTR)
    previous = chain.previous_forward if chain is not None else module.__dict__.get("forward")
    return previous if previous is not None else types.MethodType(type(module).forward, module)


# What happened to whose forward, logged together at the end of the outermost ``reports()``.
_MESSAGES = {
    "found": "ac-core: a call of %(names)s came up through %(detail)s, set over ac-core's forward after ac-core's, "
    "and not through the model ac-core was applied to (whose call puts ac-core's layers above such forwards "
    "first): checkpointing sat out that call, as its recompute could not have run that forward again; from the "
    "next call on it runs above it. Call the model, or apply ac-core after that library, to checkpoint every call",
    "over": "ac-core: %(detail)s set over ac-core's forward of %(names)s: ac-core's layers run above it from now "
    "on, so a checkpoint's recompute runs it too",
    "kept": "ac-core: %(detail)s already on %(names)s: ac-core's layers run above it (a checkpoint's recompute "
    "runs it too), and removing that hook puts back ac-core's forward",
    "stays": "ac-core: %(detail)s on %(names)s still calls ac-core's forward, which now passes straight through",
    "gone": "ac-core: ac-core's forward of %(names)s had been replaced by %(detail)s (its library put back a "
    "forward from before ac-core's), so it was not checkpointed; that forward is left as it is",
    "dropped": "ac-core: ac-core's forward of %(names)s has been replaced by %(detail)s (its library put back a "
    "forward from before ac-core's), so it is not checkpointed; apply ac-core again to checkpoint it",
}
_collected: list[tuple[int, str, str, str]] | None = None


@contextlib.contextmanager
def reports() -> Iterator[None]:
    """Log what happens to foreign forwards inside the block once per kind, naming every module it happened to."""
    global _collected
    if _collected is not None:
        yield
        return
    _collected = []
    try:
        yield
    finally:
        collected, _collected = _collected, None
        grouped: dict[tuple[int, str, str], list[str]] = {}
        for level, what, name, detail in collected:
            names = grouped.setdefault((level, what, detail), [])
            if name not in names:
                names.append(name)
        for (level, what, detail), names in grouped.items():
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            logger.log(level, _MESSAGES[what], {"names": shown, "detail": detail})


def _note(level: int, what: str, module: nn.Module, detail: str, layer: ForwardLayer | None = None) -> None:
    chain: _Chain | None = module.__dict__.get(CHAIN_ATTR)
    layers = [layer] if layer is not None else chain.layers if chain is not None else []
    path = next((getattr(each, "path", None) for each in layers if isinstance(getattr(each, "path", None), str)), None)
    name = type(module).__name__ if path is None else f"{path or 'the model'} ({type(module).__name__})"
    with reports():
        assert _collected is not None
        _collected.append((level, what, name, detail))
