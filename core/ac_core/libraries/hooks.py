"""diffusers' and accelerate's forward hooks, read for ac-core's forward chain (:mod:`ac_core._chain`).

Both libraries replace a module's instance ``forward`` and keep the forward they replaced, to call it
and to put it back:

- diffusers (``HookRegistry.register_hook``: group offloading, layerwise casting, the caches) sets
  ``module.forward = functools.update_wrapper(partial(new_forward, module), forward)`` around whatever
  ``module.forward`` was, and calls that forward from a ``HookFunctionReference`` (its ``forward``, or
  ``original_forward`` for hooks with a ``new_forward``); ``remove_hook`` puts it back on the module
  (outermost hook) or into the next hook's reference.
- accelerate (``add_hook_to_module``: ``cpu_offload``, ``dispatch_model``, AlignDevicesHook) keeps it as
  ``module._old_forward``, calls ``module._old_forward`` at each call, and ``remove_hook_from_module`` sets
  ``module.forward = module._old_forward``.

Their pre-forward puts the weights where the forward needs them (group offloading onloads the group,
AlignDevicesHook loads them) and their post-forward takes them away again, so a checkpoint must run them
again when it recomputes; diffusers' own checkpointing does, as it calls the block's ``__call__`` inside
``torch.utils.checkpoint``. torch's early stop ends a recompute once it has what backward needs, before
the post-forward that offloads the group again (diffusers' own checkpointing onloads 6 groups and
offloads none in the backward of a tiny Flux): :meth:`Hook.undoes` says where that matters. A diffusers
cache's ``new_forward`` does bookkeeping after the block that, rerun in full, would save tensors the
forward did not (checkpoint raises): :meth:`Hook.replaces_call` says where the recompute must stop early,
as diffusers' own checkpointing stops it.

Nothing here imports diffusers or accelerate: their forwards are recognised by the module that defines them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn


class Hook:
    """A library hook's forward on a module: ``below`` is the forward it calls (and puts back when removed),
    ``redirect(forward)`` makes it call (and keep) ``forward`` instead."""

    __slots__ = ("below", "redirect")

    def __init__(self, below: Any, redirect: Callable[[Any], None]) -> None:
        self.below = below
        self.redirect = redirect

    def undoes(self) -> bool:
        """Whether its post-forward undoes its pre-forward (weights offloaded again), so a recompute must run it."""
        raise NotImplementedError

    def replaces_call(self) -> bool:
        """Whether it replaces the call with a forward of its own, whose work after it a recompute must not run."""
        raise NotImplementedError

    def describe(self) -> str:
        """The hook in words, for ac-core's messages."""
        raise NotImplementedError


class _DiffusersHook(Hook):
    __slots__ = ("_module", "_reference")

    def __init__(self, module: nn.Module, reference: Any) -> None:
        attribute = "original_forward" if reference.original_forward is not None else "forward"
        super().__init__(getattr(reference, attribute), functools.partial(setattr, reference, attribute))
        self._module = module
        self._reference = reference

    def undoes(self) -> bool:
        return _own_post_forward(getattr(self._reference.post_forward, "__self__", None))

    def replaces_call(self) -> bool:
        return self._reference.original_forward is not None

    def describe(self) -> str:
        registry = self._module.__dict__.get("_diffusers_hook")
        return f"diffusers' hooks ({', '.join(getattr(registry, '_hook_order', ())) or '?'})"


class _AccelerateHook(Hook):
    __slots__ = ("_module",)

    def __init__(self, module: nn.Module) -> None:
        kept = module.__dict__
        super().__init__(kept["_old_forward"], functools.partial(kept.__setitem__, "_old_forward"))
        self._module = module

    def undoes(self) -> bool:
        return _own_post_forward(self._module.__dict__.get("_hf_hook"))

    def replaces_call(self) -> bool:
        return False

    def describe(self) -> str:
        return f"accelerate's {type(self._module.__dict__.get('_hf_hook')).__name__}"


def _diffusers_reference(forward: Any) -> Any:
    """The ``HookFunctionReference`` a diffusers hook's forward calls through, or None for other forwards."""
    function = forward.func if isinstance(forward, functools.partial) else None
    if getattr(function, "__module__", None) != "diffusers.hooks.hooks":
        return None
    # create_new_forward's new_forward closes over the reference it calls through.
    names = getattr(getattr(function, "__code__", None), "co_freevars", ())
    for name, cell in zip(names, getattr(function, "__closure__", None) or (), strict=False):
        if name == "function_reference" and hasattr(cell.cell_contents, "original_forward"):
            return cell.cell_contents
    return None


def _is_accelerate(module: nn.Module, forward: Any) -> bool:
    return (
        isinstance(forward, functools.partial)
        and getattr(forward.func, "__module__", None) == "accelerate.hooks"
        and forward.args[:1] == (module,)
        and "_old_forward" in module.__dict__
    )


def _own_post_forward(hook: Any) -> bool:
    """Whether a diffusers or accelerate hook has a post-forward of its own, not its base ``ModelHook``'s no-op."""
    hooks = getattr(hook, "hooks", None)  # accelerate's SequentialHook
    if isinstance(hooks, (list, tuple)):
        return any(_own_post_forward(each) for each in hooks)
    owner = next((cls for cls in type(hook).__mro__ if "post_forward" in cls.__dict__), None)
    return owner is not None and owner.__name__ != "ModelHook"


def hook_of(module: nn.Module, forward: Any) -> Hook | None:
    """``forward`` (an instance forward of ``module``) as a diffusers or accelerate hook, or None for any other."""
    reference = _diffusers_reference(forward)
    if reference is not None:
        return _DiffusersHook(module, reference)
    if _is_accelerate(module, forward):
        return _AccelerateHook(module)
    return None
