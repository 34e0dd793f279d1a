"""The planner's own forwards leave no trace: the model, its inputs, the RNG and the user's hooks stay as they were.

Planning runs forwards nobody asked for (:func:`~ac_core.budget.profile_model`: the whole model, each block alone,
every block checkpointed; :class:`~ac_core.budget.StepProfile`: each block alone inside the user's step). On real
tensors a forward has effects: it draws random numbers, updates BatchNorm statistics, may change its inputs in
place, and fires the hooks on the model. Around each such forward, :func:`isolated`:

- takes the state of the CPU generator and of every CUDA device's (where CUDA is initialized), and puts it back;
- copies a parameter or watched input the first time an op writes into its storage (a dispatch mode reading the
  ops' schemas: nothing is copied that no op changes, and parameters are never copied up front), and writes the
  copy back;
- copies the buffers up front (they are small; BatchNorm's kernel updates its running statistics without saying
  so in its schema, nor bumping their version counters) and writes back, through ``.data``, those whose values
  changed, so that a graph holding a buffer for backward stays valid; buffers replaced or added on a module are
  put back or removed, and ``training`` flags put back;
- silences the forward hooks and pre-hooks (the modules' and torch's global ones) that come from user code.
  Hooks defined in torch (FSDP2's unshard), ac-core and the model libraries (transformers'
  ``enable_input_require_grads``) run: the forward depends on them. diffusers' and accelerate's hooks replace
  ``forward`` and run too (they onload weights). A silenced hook's own tensors are not planned for.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from .._recompute import is_real, put_back
from ..libraries.transformers import meta_values_unread
from ..measure.memory import plain_tensors, storage_ref

# Where a hook's function is defined for it to run in a planning forward: the forward depends on it.
_KEPT = frozenset({"torch", "ac_core", "transformers", "diffusers", "accelerate", "peft"})
# Per op: (position, name) of the arguments it writes into.
_WRITES: dict[Any, tuple[tuple[int, str], ...]] = {}


def _silent(*args: Any, **kwargs: Any) -> None:
    """Stands in for a silenced hook: returns None, which changes nothing."""


def _kept(hook: Any) -> bool:
    while isinstance(hook, functools.partial):
        hook = hook.func
    return (getattr(hook, "__module__", None) or "").partition(".")[0] in _KEPT


@contextmanager
def _silenced_hooks(model: nn.Module) -> Iterator[None]:
    # Values are replaced, not entries removed: handles and the order of the hooks stay as they are.
    tables = [module_hooks._global_forward_pre_hooks, module_hooks._global_forward_hooks]
    for module in model.modules():
        tables += [module._forward_pre_hooks, module._forward_hooks]
    silenced = [(table, key, hook) for table in tables for key, hook in table.items() if not _kept(hook)]
    for table, key, _ in silenced:
        table[key] = _silent
    try:
        yield
    finally:
        for table, key, hook in silenced:
            if table.get(key) is _silent:
                table[key] = hook


def _op_name(func: Any) -> str:
    return func.name().partition(".")[0]  # "aten::mul_", its overload left out


def written(func: Any, args: tuple, kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    """The plain tensors an op call writes into, as its schema says (``Tensor(a!)``: in-place ops, ``out=``)."""
    found = _WRITES.get(func)
    if found is None:
        schema = getattr(func, "_schema", None)
        arguments = schema.arguments if schema is not None else ()
        found = tuple(
            (i, a.name) for i, a in enumerate(arguments) if a.alias_info is not None and a.alias_info.is_write
        )
        _WRITES[func] = found
    for position, name in found:
        yield from plain_tensors(args[position] if position < len(args) else kwargs.get(name))


class CopyOnWrite(TorchDispatchMode):
    """Copies each watched tensor before the first op that writes into its storage; :meth:`restore` writes the
    copies back. ``writers``: per watched tensor written (by ``id``), the op that wrote first (``"aten::mul_"``);
    ``failure``: the name of the op that raised, and its exception."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self.watched: dict[int, list[torch.Tensor]] = defaultdict(list)
        self.watch(tensors)
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.writers: dict[int, str] = {}
        self.failure: tuple[str, BaseException] | None = None

    def watch(self, tensors: Iterable[torch.Tensor]) -> None:
        for tensor in tensors:
            self.watched[storage_ref(tensor).cdata].append(tensor)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        # An error the forward caught and went on from is not held (its traceback holds the frames' tensors).
        self.failure = None
        for tensor in written(func, args, kwargs):
            for watched in self.watched.get(storage_ref(tensor).cdata, ()):
                if id(watched) not in self.saved:
                    self.saved[id(watched)] = (watched, watched.detach().clone())
                    self.writers[id(watched)] = _op_name(func)
        try:
            return func(*args, **kwargs)
        except Exception as exc:
            self.failure = (_op_name(func), exc)
            raise

    def failed_op(self, exc: BaseException) -> str | None:
        """The op that raised ``exc`` (or an exception it was raised from), if an op did."""
        if self.failure is None:
            return None
        op, raised = self.failure
        seen: BaseException | None = exc
        while seen is not None:
            if seen is raised:
                return op
            seen = seen.__cause__ or seen.__context__
        return None

    def restore(self) -> None:
        with torch.no_grad():
            for tensor, copy in self.saved.values():
                tensor.copy_(copy)
        self.saved.clear()


def _rng_states() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_states(states: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _put_back_buffers(
    saved: list[tuple[nn.Module, dict[str, torch.Tensor | None]]], values: list[tuple[torch.Tensor, torch.Tensor]]
) -> None:
    for module, buffers in saved:
        for name in [name for name in module._buffers if name not in buffers]:
            delattr(module, name)
        for name, tensor in buffers.items():
            if module._buffers.get(name) is not tensor:
                module._buffers[name] = tensor
    put_back(values)


@contextmanager
def isolated(model: nn.Module, inputs: Any = ()) -> Iterator[CopyOnWrite]:
    """Run a planning forward of ``model`` inside, on ``inputs`` (watched too): afterwards the RNG, ``model``'s
    parameters, buffers and ``training`` flags and the tensors in ``inputs`` are as they were, on error too, and
    the user's forward hooks did not fire (see the module's docstring). Enter it before any mode that measures:
    the copies it makes are not the forward's.
    """
    rng = _rng_states()
    modules = list(model.modules())
    flags = [(module, module.training) for module in modules]
    buffers = [(module, dict(module._buffers)) for module in modules]
    with _disable_current_modes():  # our copies, made outside the modes that measure the forward
        values = [(b, b.detach().clone()) for b in plain_tensors(list(model.buffers())) if is_real(b)]
    guard = CopyOnWrite(plain_tensors([list(model.parameters()), inputs]))
    try:
        with _silenced_hooks(model), guard, meta_values_unread():
            yield guard
    finally:
        guard.restore()
        _put_back_buffers(buffers, values)
        for module, training in flags:
            module.training = training
        _set_rng_states(rng)


@contextmanager
def without_kv_cache(model: nn.Module) -> Iterator[None]:
    """Forwards run with ``use_cache=False`` by default (transformers' configs), as ac-core runs forwards with
    gradients under checkpointing (:func:`~ac_core.libraries.transformers.train_without_kv_cache`): a KV cache
    made in the step would hold keys and values a plan's forward does not, and a block run alone would write
    into the cache of the call it was taken from."""
    configs: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", None) is True:
            configs[id(config)] = config
    for config in configs.values():
        config.use_cache = False
    try:
        yield
    finally:
        for config in configs.values():
            config.use_cache = True
