"""Planning from the user's own training step: ``with ac_core.profile_step(model) as rec: train_step(batch)``.

:func:`~ac_core.budget.plan_activation_checkpointing` runs the model's forward itself, on example inputs, outside
the user's code: a framework's forward context (FastVideo's ``set_forward_context``), a loss computed outside the
model (an LLM's logits) and data-dependent code are then not what runs. :func:`profile_step` measures the step as
it runs instead, with no second forward of the whole model:

- The bytes ``none`` holds: every storage the step's ops make from the start of the ``with`` block until backward
  starts (the first ``torch.autograd.backward`` or ``torch.autograd.grad`` outside the model's forward, or the end
  of the block) and still alive then, but the model's inputs and outputs and the tensors backward starts from, as
  :func:`~ac_core.measure.held_for_backward` leaves out a forward's result.
- Each distinct (block class, input shapes) block alone, as :func:`~ac_core.budget.profile_model` does, run from a
  pre-hook on its first call, so inside the user's context (autocast, a forward context, FSDP's unsharded
  weights), on copies of its inputs, :func:`~._isolation.isolated` (RNG, buffers, parameters put back, the user's
  hooks silenced) and under no dispatch mode of the step (neither ours nor the user's sees it).
- For a :class:`~ac_core.StepBudget`: each distinct block alone once more, forward and backward, unchecked and
  checkpointed, for backward's transient (see :mod:`.predict`), and the model's inputs' and output's bytes.
- The least any plan holds (``min_bytes``) without a forward with every block checkpointed: each storage is noted
  with whether a block's forward made it. Made outside every block, or a block's input or output: held under
  every plan. Made inside a block and neither: the block's own, which checkpointing it whole frees. Block inputs
  the step frees before backward (Wan's timestep projection) are kept by a checkpoint, so they count too. On the
  toy transformer and the tiny Wan, Flux, HunyuanVideo and Llama this equals what the forward with every block
  checkpointed holds; a tensor a block makes that something outside it keeps (a cache on the model) would be
  counted as the block's.

The step runs without transformers' KV cache by default, as under a plan, and a block given one is refused.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ..blocks import Block, ModelBlocks, resolve_blocks
from ..collectives import agreed
from ..libraries.checkpointing import FLAG
from ..measure.memory import live_nbytes, new_storages, plain_tensors, storage_ref
from ..offload import OffloadConfig
from ..spec import AdapterSpec
from ._isolation import without_kv_cache
from .checkpoint_plan import CheckpointPlan
from .offload_cost import SavedInputs
from .planner import named_containers, plan_from_profile
from .profile import (
    BlockProfile,
    ModelProfile,
    ProfileKey,
    Signature,
    _per_forward,
    _unchecked,
    profile_alone,
    signature,
)
from .step_budget import StepBudget

if TYPE_CHECKING:
    from .predict import BlockBackward


class _Made:
    """A storage the step made: whether a block's forward made it, whether it is a block's input or output, and
    whether it is left out (the model's inputs and outputs, what backward starts from)."""

    __slots__ = ("boundary", "excluded", "inside", "ref")

    def __init__(self, ref: StorageWeakRef, inside: bool) -> None:
        self.ref = ref
        self.inside = inside
        self.boundary = False
        self.excluded = False


class _Recorder(TorchDispatchMode):
    """Notes every storage the step's ops make while its forward is measured."""

    def __init__(self, profile: StepProfile) -> None:
        super().__init__()
        self.profile = profile

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        profile = self.profile
        if profile._recording:
            inside = bool(profile._inside)
            for ref in new_storages(func, out):
                profile._made[ref.cdata] = _Made(ref, inside)  # a freed storage's address reused: a new one
        return out


class StepProfile:
    """One training step's profile, recorded by :func:`profile_step`; plan from it with :meth:`plan`."""

    def __init__(self, resolved: ModelBlocks) -> None:
        self.resolved = resolved
        self._made: dict[int, _Made] = {}
        self._inside: list[Block] = []
        self._recording = False
        self._rerunning = False
        self._root_depth = 0
        self._inputs: Signature | None = None
        self._block_inputs: dict[int, tuple[StorageWeakRef, int]] = {}
        self._freed_inputs = 0  # block inputs found freed when their address was reused
        self._keys: dict[str, ProfileKey] = {}
        self._profiles: dict[ProfileKey, BlockProfile] = {}
        self._calls: dict[str, int] = defaultdict(int)
        self._figures: tuple[int, int, int] | None = None  # bytes: none, kept by every plan, block inputs freed
        self._backward: dict[ProfileKey, BlockBackward] = {}  # each distinct block's, for a StepBudget
        self._input_bytes = 0
        self._output_bytes = 0
        self._stack = ExitStack()
        self._profile: ModelProfile | None = None  # made once, as the group's first rank made it

    def __enter__(self) -> StepProfile:
        if self._recording or self._keys:
            raise RuntimeError("a StepProfile records one step: call ac_core.profile_step(model) for another")
        resolved = self.resolved
        model = resolved.model
        stack = self._stack
        try:
            stack.enter_context(_unchecked([*model.modules()]))
            stack.enter_context(without_kv_cache(model))
            switched = [m for m in model.modules() if getattr(m, FLAG, False) is True]
            for module in switched:
                setattr(module, FLAG, False)
            stack.callback(_switch_on, switched)
            stack.enter_context(_hooked(model, self._root_entered, self._root_left))
            for block in resolved:
                stack.enter_context(_hooked(block.module, self._entering(block), self._leaving(block)))
            for name in ("backward", "grad"):
                original = getattr(torch.autograd, name)
                setattr(torch.autograd, name, self._marks_backward(original))
                stack.callback(setattr, torch.autograd, name, original)
            stack.enter_context(_Recorder(self))
        except BaseException:
            stack.close()
            raise
        self._recording = True
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if self._recording and exc_type is None:
            self._measure(())
        self._recording = False
        self._stack.close()

    # The step's forward, as it runs.

    def _root_entered(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        self._root_depth += 1
        if self._recording and torch.is_grad_enabled():
            if self._inputs is None:
                self._inputs = signature(args, kwargs)
                self._input_bytes = _bytes((args, kwargs))
            self._mark((args, kwargs), "excluded")

    def _root_left(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._root_depth -= 1
        if self._recording:
            self._mark(output, "excluded")
            if self._root_depth == 0:
                self._output_bytes = _bytes(output)

    def _entering(self, block: Block) -> Callable[[nn.Module, tuple, dict[str, Any]], None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            if not self._recording or self._rerunning or not torch.is_grad_enabled():
                return
            cache = _kv_cache(args, kwargs)
            if cache is not None:
                raise ValueError(
                    f"block {block.path!r} ({type(module).__name__}) got a KV cache ({cache}) in a forward with "
                    "gradients: its run alone would write to it, as a checkpoint's recompute would (a plan refuses "
                    "it). Profile the training step without it (use_cache=False, no cache passed)"
                )
            self._note_inputs(args, kwargs)
            self._calls[block.path] += 1
            if block.path not in self._keys:
                key = ProfileKey(block.path, signature(args, kwargs))
                self._keys[block.path] = key
                if key not in self._profiles:
                    self._profiles[key] = self._alone(block, key, args, kwargs)
            self._inside.append(block)

        return hook

    def _leaving(self, block: Block) -> Callable[[nn.Module, tuple, Any], None]:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if self._inside and self._inside[-1] is block:
                self._inside.pop()
                if self._recording:
                    self._mark(output, "boundary")

        return hook

    def _alone(self, block: Block, key: ProfileKey, args: tuple, kwargs: dict[str, Any]) -> BlockProfile:
        # The block's own pre-hooks ran (FSDP's unshard among them): its forward runs, not its hooks again.
        self._rerunning = True
        try:
            from .predict import block_backward  # .predict imports this module

            with _disable_current_modes():  # no mode of the step sees the extra runs: ours, the user's
                forward = block.module.forward
                profile = profile_alone(self.resolved, block, forward, key, args, kwargs)
                self._backward[key] = block_backward(self.resolved, block.module, args, kwargs, forward)
                return profile
        finally:
            self._rerunning = False

    def _note_inputs(self, args: tuple, kwargs: dict[str, Any]) -> None:
        for tensor in plain_tensors((args, kwargs)):
            ref = storage_ref(tensor)
            seen = self._block_inputs.get(ref.cdata)
            if seen is None or seen[0].expired():
                if seen is not None:
                    self._freed_inputs += seen[1]
                self._block_inputs[ref.cdata] = (ref, live_nbytes(ref))
            made = self._made.get(ref.cdata)
            if made is not None:
                made.boundary = True

    def _mark(self, value: Any, what: str) -> None:
        for tensor in plain_tensors(value):
            made = self._made.get(storage_ref(tensor).cdata)
            if made is not None:
                setattr(made, what, True)

    def _marks_backward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def backward(*args: Any, **kwargs: Any) -> Any:
            if self._recording and self._root_depth == 0:  # not a grad the model's forward takes itself
                self._measure(plain_tensors((args, kwargs)))
            return original(*args, **kwargs)

        return backward

    def _measure(self, seeds: Iterable[torch.Tensor]) -> None:
        """What the step holds for backward now, at backward's start: ``none``'s bytes and the least a plan holds."""
        self._recording = False
        self._mark(list(seeds), "excluded")
        held = kept = 0
        for made in self._made.values():
            if made.excluded:
                continue
            nbytes = live_nbytes(made.ref)
            held += nbytes
            if made.boundary or not made.inside:
                kept += nbytes
        freed = self._freed_inputs + sum(nbytes for ref, nbytes in self._block_inputs.values() if ref.expired())
        self._figures = (held, kept, freed)
        self._made.clear()
        self._block_inputs.clear()

    # What it gives.

    @property
    def profile(self) -> ModelProfile:
        """The step's :class:`~ac_core.budget.ModelProfile`: ``none_bytes`` as the step held at backward's start,
        ``full_bytes`` (hence ``min_bytes``) from where its storages were made, the blocks' own profiles.

        Where the blocks' collectives ran over ranks (context parallelism), the first access is itself a
        collective: every rank of the group takes the first rank's profile, so that every rank plans the same
        (keep decisions that differ between ranks deadlock the recompute). Access it, or plan, on every rank."""
        if self._profile is None:
            made = self._made_profile()
            self._profile = agreed(made, made.group)
        return self._profile

    def _made_profile(self) -> ModelProfile:
        resolved = self.resolved
        if self._figures is None:
            raise ValueError(
                "profile_step(...) has a profile once backward starts in its with block, or the block ends (without "
                "an error)"
            )
        missing = [b.path for b in resolved if b.path not in self._keys]
        if missing:
            raise ValueError(
                f"the profiled step ran no forward with grad through block(s) {missing} before backward started: "
                "profile a training step that calls them"
            )
        none_bytes, kept, freed = self._figures
        served = resolved.served_model
        return ModelProfile(
            model_class=f"{type(served).__module__}.{type(served).__qualname__}",
            inputs=self._inputs or (),
            blocks=tuple(
                (b.path, _per_forward(self._profiles[self._keys[b.path]], self._calls[b.path])) for b in resolved
            ),
            none_bytes=none_bytes,
            checkpoint_input_bytes=freed,
            full_bytes=kept + freed,
            saved_inputs=SavedInputs(),
        )

    def plan(
        self, memory_budget: float | int | str | StepBudget, *, offload: bool | OffloadConfig | None = None
    ) -> CheckpointPlan:
        """The plan for ``memory_budget`` (as :func:`~ac_core.plan_activation_checkpointing` takes it) from this
        step; apply it with ``apply_activation_checkpointing(model, plan)``. Plan at several budgets from one step.

        A :class:`~ac_core.StepBudget` counts the step's own loss, which the step ran before backward, in what
        it holds (its ``loss`` callable is not run), and the model's output, inputs and states as measured here.

        ``offload`` is refused: which checkpointed blocks' inputs moving to the host frees memory is seen in a
        forward with every block checkpointed, which a profiled step does not run; plan offload with
        ``plan_activation_checkpointing(model, example_inputs, budget, offload=...)``.
        """
        if offload is not None and offload is not False:
            raise ValueError(
                "a profiled step plans without offload: which checkpointed blocks' inputs moving to the host frees "
                "memory needs a forward with every block checkpointed, which the step does not run; plan offload "
                "with ac_core.plan_activation_checkpointing(model, example_inputs, budget, offload=...)"
            )
        containers = named_containers(self.resolved)
        if isinstance(memory_budget, StepBudget):
            from .predict import facts_of, plan_for_step  # .predict imports this module

            profile = self.profile  # first: it names what the step lacks
            backward = {b.path: self._backward[self._keys[b.path]] for b in self.resolved}
            facts = facts_of(self.resolved, memory_budget, backward, self._input_bytes, self._output_bytes)
            return plan_for_step(profile, facts, memory_budget, containers)
        return plan_from_profile(self.profile, memory_budget, containers=containers)


def _kv_cache(args: tuple, kwargs: dict[str, Any]) -> str | None:
    """The argument holding a transformers KV cache (a ``Cache``), if any, named by position or keyword."""
    for name, value in [*((f"argument {i}", a) for i, a in enumerate(args)), *kwargs.items()]:
        if any(c.__name__ == "Cache" and c.__module__.startswith("transformers.") for c in type(value).__mro__):
            return name
    return None


def _bytes(value: Any) -> int:
    refs = {ref.cdata: ref for ref in map(storage_ref, plain_tensors(value))}
    return sum(live_nbytes(ref) for ref in refs.values())


def _switch_on(modules: list[nn.Module]) -> None:
    for module in modules:
        setattr(module, FLAG, True)


@contextmanager
def _hooked(module: nn.Module, pre: Callable[..., None], post: Callable[..., None]) -> Iterator[None]:
    """A pre-hook (with kwargs) and a forward hook (run on error too) on ``module`` inside the block."""
    handles = [
        module.register_forward_pre_hook(pre, with_kwargs=True),
        module.register_forward_hook(post, always_call=True),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def profile_step(
    model: nn.Module, *, adapter: AdapterSpec | str | None = None, blocks: Sequence[str] | None = None
) -> StepProfile:
    """Profile one training step of ``model`` as the user runs it, to plan from: a context manager.

    .. code-block:: python

        with ac_core.profile_step(model) as rec:
            loss = train_step(batch)  # forward (in your own context), loss, backward, as always
        plan = rec.plan(0.5)  # or bytes, "40GiB"; the same CheckpointPlan plan_activation_checkpointing makes
        ac_core.apply_activation_checkpointing(model, plan)

    The model's forward runs once, as the step calls it, unchecked: ac-core's layers (an earlier plan, offload)
    and the library's own checkpointing are set aside for the step and put back after, so it needs the memory an
    unchecked step needs, and a little more while a block runs alone. As under a plan, it runs without the KV
    cache by default (transformers' ``use_cache``), and a block given a cache in a forward with gradients is
    refused (its run alone would write to it; a plan refuses it too). Blocks come from the adapter or ``blocks=``.
    What is measured and how is in :mod:`ac_core.budget.step`; the figures are those
    :func:`~ac_core.plan_activation_checkpointing` gets on the same model and inputs where the step is a forward
    and a loss that holds nothing more. After the block the model, its hooks, the RNG and the buffers are as the
    step alone leaves them: each block's run alone puts back the RNG, buffers and parameters and silences the
    user's hooks, as :func:`~ac_core.plan_activation_checkpointing`'s forwards do. Offload cannot be planned from a
    step (see :meth:`StepProfile.plan`). A step with two forwards before one backward counts each
    block's calls in both.
    """
    return StepProfile(resolve_blocks(model, adapter, blocks))
