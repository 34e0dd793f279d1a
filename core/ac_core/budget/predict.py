"""The predicted peak of one whole training step on one rank, part by part, and the plan keeping it within a
:class:`~.step_budget.StepBudget`.

The peak is the sum of:

- ``params``, ``grads``, ``optimizer``: the model states, each parameter at the step budget's dtypes (else its
  own), the gradients and optimizer state of the trainable ones; sharded over ``fsdp`` ranks (buffers, counted
  with the parameters, are not). Gradients count for the whole step: the optimizer step holds them all.
- ``gathered``: with ``fsdp > 1``, the largest block's unsharded parameters and their unsharded gradients,
  which FSDP holds while the block runs and until its reduce-scatter.
- ``inputs``: the example inputs (one rank's).
- ``held``: what the forward holds for backward under the plan (the plan's ``device_bytes``).
- ``transient``: the most backward adds on top at once, beyond the loss's part (the loss's backward runs first,
  and is done when the blocks' start). Backward runs the blocks last first; when it reaches a
  block, the later blocks' held bytes are gone, and the block's backward makes its gradient buffers and, where
  it is checkpointed, its recompute. Both are measured by running each distinct block (class and input shapes)
  alone on copies of its inputs, forward then backward, unchecked and checkpointed whole (the kept bytes of an
  ``ops`` block are not recomputed). Or, where it is larger, the optimizer update's temporaries beyond the
  activations freed by then.
- ``loss``: the model's output and, with a ``loss`` callable, the most its forward and backward make on a copy
  of that output (run on the tensors the planning forward made: real, ``meta`` or fake alike).
- ``margin``: the step budget's fraction of ``memory``.

The blocks' runs and the loss's are :func:`~._isolation.isolated`, as every planning forward is: no trace is
left on the model, its inputs, the RNG or the hooks.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from ..blocks import ModelBlocks, resolve_blocks
from ..collectives import agreed
from ..measure.memory import LivePeak, held_for_backward, live_nbytes, plain_tensors, storage_ref
from ..op_names import op_matches
from ..policies import BlockMode, CheckpointType, retained_ops
from ..spec import AdapterSpec
from ..units import human_bytes
from ._isolation import isolated
from ._isolation import without_kv_cache as without_kv_cache  # re-exported: the cli measures a step with it
from .checkpoint_plan import CheckpointPlan
from .devices import Device
from .memory_budget import MemoryBudget
from .planner import plan_from_profile
from .profile import (
    ModelProfile,
    OpOccurrence,
    _CpuAttentionOnMeta,
    _detached_copy,
    _fed,
    _unchecked,
    call_model,
    cpu_attention_on_meta_in_backward,
    profile_model,
    signature,
)
from .solve import Cost
from .step_budget import StepBudget

logger = logging.getLogger("ac_core")

FITS_NONE = "ac-core: the step budget %s fits none's predicted peak of %s: the plan checkpoints no block"
"""What :func:`plan_for_step` logs, once, where ``none`` fits the step budget (the CLI's neighbouring budgets
filter it out)."""


@dataclass(frozen=True)
class StepPeak:
    """One rank's predicted peak of a training step, in bytes, by part (see :mod:`ac_core.budget.predict`):
    ``peak`` is their sum but the margin, ``total`` with it, ``memory`` the step budget's."""

    params: int
    grads: int
    optimizer: int
    gathered: int
    inputs: int
    held: int
    transient: int
    loss: int
    margin: int
    memory: int

    @property
    def states(self) -> int:
        """Parameters (and buffers), gradients and optimizer state."""
        return self.params + self.grads + self.optimizer

    @property
    def peak(self) -> int:
        return self.states + self.gathered + self.inputs + self.held + self.transient + self.loss

    @property
    def total(self) -> int:
        return self.peak + self.margin

    @property
    def fits(self) -> bool:
        return self.total <= self.memory

    def dominant(self) -> tuple[str, int, str]:
        """The largest part: its name, bytes, and what makes it smaller."""
        return max(
            (
                ("parameters", self.params, "shard over more GPUs (fsdp=) or hold them in a smaller param_dtype"),
                ("gradients", self.grads, "shard over more GPUs (fsdp=) or use a smaller grad_dtype"),
                (
                    "optimizer state",
                    self.optimizer,
                    "shard over more GPUs (fsdp=) or use a lighter optimizer (optimizer='adamw-8bit' or 'sgd')",
                ),
                ("FSDP's gathered block", self.gathered, "wrap smaller modules in FSDP units"),
                ("inputs", self.inputs, "fewer tokens per GPU (a smaller batch, context parallelism)"),
                (
                    "activations held for backward",
                    self.held,
                    "fewer tokens per GPU (a smaller batch or sequence, context parallelism)",
                ),
                ("backward's transient", self.transient, "fewer tokens per GPU (a smaller batch or sequence)"),
                ("the loss", self.loss, "a loss that holds less (a chunked cross-entropy)"),
            ),
            key=lambda part: part[1],
        )

    def __str__(self) -> str:
        parts = ("params", "grads", "optimizer", "gathered", "inputs", "held", "transient", "loss", "margin")
        named = ", ".join(f"{name} {human_bytes(getattr(self, name), digits=2)}" for name in parts)
        return f"step peak {human_bytes(self.total, digits=2)} of {human_bytes(self.memory, digits=2)}: {named}"


class BlockBackward(NamedTuple):
    """What one block's backward makes at once beyond what its forward held (bytes), its weight gradients
    aside: ``unchecked``, and ``checkpointed`` whole (its recompute included)."""

    unchecked: int
    checkpointed: int


class BlockStep(NamedTuple):
    """One block's part of a step: its backward's figures with its weight gradients' (each made, then added into
    ``.grad``), and its parameters' and gradients' bytes (what FSDP gathers)."""

    path: str
    unchecked: int
    checkpointed: int
    params: int
    grads: int


@dataclass(frozen=True)
class StepFacts:
    """Everything but the plan that a step's peak depends on: model states, the blocks' backwards (by path, in
    forward order), the inputs, the model's output, the loss's peak on it and the optimizer update's
    temporaries."""

    params: int
    grads: int
    optimizer: int
    update: int
    inputs: int
    output: int
    loss: int
    blocks: tuple[BlockStep, ...]


def _tensor_bytes(value: Any) -> int:
    refs = {ref.cdata: ref for ref in map(storage_ref, plain_tensors(value))}
    return sum(live_nbytes(ref) for ref in refs.values())


def _itemsize(dtype: torch.dtype | str | None, fallback: torch.dtype) -> int:
    return dtype.itemsize if isinstance(dtype, torch.dtype) else fallback.itemsize


def _grad_dtype(budget: StepBudget) -> torch.dtype | str | None:
    return budget.grad_dtype or budget.param_dtype


def _per_tensor_update(model: nn.Module, budget: StepBudget) -> bool:
    """Whether the optimizer updates tensor by tensor (torch's default on the CPU) or all at once (foreach)."""
    if budget.device is not None:
        return budget.device == "cpu"
    first = next(model.parameters(), None)
    return first is not None and first.device.type == "cpu"


def _states(model: nn.Module, budget: StepBudget) -> tuple[int, int, int, int]:
    """(parameters and buffers, gradients, optimizer state (a master copy included), the update's temporaries)
    on one rank."""
    state = budget.state
    params = grads = master = optimizer = largest = 0
    for p in model.parameters():
        params += p.numel() * _itemsize(budget.param_dtype, p.dtype)
        if not p.requires_grad:
            continue
        grads += p.numel() * _itemsize(_grad_dtype(budget), p.dtype)
        state_size = _itemsize(budget.master_dtype or budget.param_dtype, p.dtype)
        if budget.master_dtype is not None:
            master += p.numel() * state_size
        optimizer += p.numel() * state.states * (state.state_bytes or state_size)
        largest = max(largest, p.numel() * state_size)
    ranks = budget.fsdp
    sharded = optimizer + master
    if _per_tensor_update(model, budget):
        update = math.ceil(state.per_tensor * largest / ranks)  # FSDP shards each parameter
    else:
        update = math.ceil(state.foreach * (sharded - master) / max(1, state.states) / ranks)
    buffers = _tensor_bytes(list(model.buffers()))
    return math.ceil(params / ranks) + buffers, math.ceil(grads / ranks), math.ceil(sharded / ranks), update


@contextmanager
def _planning_context(modules: list[nn.Module]) -> Iterator[None]:
    with _unchecked(modules), torch.enable_grad(), _CpuAttentionOnMeta():
        yield


def _backward_bytes(run: Callable[[], Any], wrt: list[torch.Tensor], params: Sequence[torch.Tensor]) -> int:
    """The most bytes ``run`` (a forward) and the backward of its result, from gradients of ones, have alive at
    once beyond what the forward holds and returns: the backward's frees of saved tensors counted, as in the
    model. Gradients are taken with respect to ``wrt`` (the block's inputs), else ``params``, never into
    ``.grad``."""
    targets = [t for t in wrt if t.requires_grad] or [p for p in params if p.requires_grad]
    with LivePeak() as peak:
        result, held = held_for_backward(run)
        out = [t for t in plain_tensors(result) if t.requires_grad]
        out_bytes = _tensor_bytes(out)
        if out and targets:
            with cpu_attention_on_meta_in_backward():
                torch.autograd.grad(out, targets, [torch.ones_like(t) for t in out], allow_unused=True)
        del result, out
    return max(0, peak.peak - held - out_bytes)


def _recompute_context() -> tuple[AbstractContextManager, AbstractContextManager]:
    # The recompute runs from backward, where the forward's function modes are not on: SDPA on meta takes the
    # fused kernel's path there too, as in the forward.
    return nullcontext(), _CpuAttentionOnMeta()


def block_backward(
    resolved: ModelBlocks,
    module: nn.Module,
    args: tuple,
    kwargs: dict[str, Any],
    call: Callable[..., Any] | None = None,
) -> BlockBackward:
    """``module``'s :class:`BlockBackward` at these inputs, run alone on copies of them, isolated; ``call`` runs
    it (``module.forward`` where its hooks already ran), else ``module`` itself."""
    call = call or module
    from torch.utils.checkpoint import checkpoint

    params = list(module.parameters())
    figures = []
    for checkpointed in (False, True):
        with isolated(resolved.model), _planning_context([module]):
            fed_args, fed_kwargs = _fed(args), _fed(kwargs)
            wrt = list(plain_tensors((fed_args, fed_kwargs)))
            if checkpointed:
                run = functools.partial(
                    checkpoint, call, *fed_args, use_reentrant=False, context_fn=_recompute_context, **fed_kwargs
                )
            else:
                run = functools.partial(call, *fed_args, **fed_kwargs)
            figures.append(_backward_bytes(run, wrt, params))
    return BlockBackward(*figures)


def _block_step(path: str, module: nn.Module, measured: BlockBackward, budget: StepBudget) -> BlockStep:
    params = list(module.parameters())
    grads = [p.numel() * _itemsize(_grad_dtype(budget), p.dtype) for p in params if p.requires_grad]
    # Weight gradients were not asked for in the block's backward alone: each is made, then added into .grad.
    accumulate = max(grads, default=0)
    param_bytes = sum(p.numel() * _itemsize(budget.param_dtype, p.dtype) for p in params)
    return BlockStep(path, measured.unchecked + accumulate, measured.checkpointed + accumulate, param_bytes, sum(grads))


def _loss_bytes(output: Any, loss: Callable[[Any], torch.Tensor] | None) -> int:
    """The most ``loss``'s forward and backward on ``output`` make at once (0 without a loss)."""
    if loss is None:
        return 0
    leaves = [t for t in plain_tensors(output) if t.requires_grad]
    with LivePeak() as peak:
        value = loss(output)
        if leaves and isinstance(value, torch.Tensor) and value.requires_grad:
            torch.autograd.grad(value, leaves, allow_unused=True)
    return peak.peak


def step_facts(resolved: ModelBlocks, example_inputs: Any, budget: StepBudget) -> StepFacts:
    """:class:`StepFacts` for ``resolved`` at ``example_inputs``: one forward of the whole model (to take each
    block's inputs and the output), each distinct block's backward alone, the loss on the output; all isolated."""
    model = resolved.model
    blocks = list(resolved)
    captured: dict[str, tuple[tuple, dict[str, Any]]] = {}

    def pre_hook(path: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            if path not in captured:
                with _disable_current_modes():  # the copy is ours, not the forward's
                    captured[path] = (_detached_copy(args), _detached_copy(kwargs))

        return hook

    handles = [b.module.register_forward_pre_hook(pre_hook(b.path), with_kwargs=True) for b in blocks]
    try:
        # Without the KV cache, as a plan's forwards run: the blocks run alone would append to a captured cache.
        with (
            isolated(model, example_inputs),
            _planning_context([model, *(b.module for b in blocks)]),
            without_kv_cache(model),
        ):
            output = _detached_copy(call_model(model, example_inputs))
    finally:
        for handle in handles:
            handle.remove()
    measured: dict[tuple[type, Any], BlockBackward] = {}
    by_path: dict[str, BlockBackward] = {}
    for block in blocks:
        args, kwargs = captured[block.path]
        key = (type(block.module), signature(args, kwargs))
        if key not in measured:
            measured[key] = block_backward(resolved, block.module, args, kwargs)
        by_path[block.path] = measured[key]
    with isolated(model), _planning_context([]):
        loss = _loss_bytes(output, budget.loss)
    return facts_of(resolved, budget, by_path, _tensor_bytes(example_inputs), _tensor_bytes(output), loss)


def facts_of(
    resolved: ModelBlocks,
    budget: StepBudget,
    backward: dict[str, BlockBackward],
    inputs: int,
    output: int,
    loss: int = 0,
) -> StepFacts:
    """:class:`StepFacts` from the blocks' measured ``backward`` (by path), the inputs', the output's and the
    loss's bytes."""
    params, grads, optimizer, update = _states(resolved.model, budget)
    blocks = tuple(_block_step(b.path, b.module, backward[b.path], budget) for b in resolved)
    return StepFacts(params, grads, optimizer, update, inputs, output, loss, blocks)


def peak_of(facts: StepFacts, budget: StepBudget, held: int, parts: Sequence[tuple[BlockMode, int]]) -> StepPeak:
    """The step's peak where the forward holds ``held`` and block ``i`` (forward order) runs in ``parts[i]``'s
    mode holding its bytes."""
    backward = facts.blocks
    transient = later = 0
    for (mode, part), block in zip(reversed(parts), reversed(backward), strict=True):
        own = block.unchecked if mode == BlockMode.NONE else max(block.unchecked, block.checkpointed - part)
        transient = max(transient, own - later)
        later += part
    # The loss's backward runs first and is done when the blocks' start: the blocks' transient beyond it counts.
    transient = max(transient - facts.loss, facts.update - held - facts.output - facts.loss, 0)
    gathered = max((b.params + b.grads for b in backward), default=0) if budget.fsdp > 1 else 0
    return StepPeak(
        params=facts.params,
        grads=facts.grads,
        optimizer=facts.optimizer,
        gathered=gathered,
        inputs=facts.inputs,
        held=held,
        transient=transient,
        loss=facts.output + facts.loss,
        margin=budget.margin_bytes,
        memory=budget.nbytes,
    )


def plan_peak(plan: CheckpointPlan, facts: StepFacts, budget: StepBudget) -> StepPeak:
    """``plan``'s predicted step peak from the step's ``facts`` under ``budget``."""
    return peak_of(facts, budget, plan.device_bytes, [(b.mode, b.held_bytes) for b in plan.blocks])


def _kept_by(op: OpOccurrence, kept: frozenset[str]) -> bool:
    # A collective named in kept is kept only where it moves activations (see ac_core.collectives).
    return op_matches(op.op, kept) and not op.moves_parameters


def _layout_parts(profile: ModelProfile, unchecked: Callable[[int], bool]) -> list[tuple[BlockMode, int]]:
    """Per block, (mode, bytes held): its ``none`` bytes where ``unchecked(index)``, else checkpointed whole
    (its routing decision alone kept)."""
    return [
        (BlockMode.NONE, p.none_bytes) if unchecked(i) else (BlockMode.FULL, p.routing_bytes)
        for i, (_, p) in enumerate(profile.blocks)
    ]


def _fixed_parts(profile: ModelProfile, policy: str, kept: frozenset[str]) -> tuple[int, list[tuple[BlockMode, int]]]:
    blocks = [p for _, p in profile.blocks]
    if policy == "none":
        return profile.none_bytes, _layout_parts(profile, lambda i: True)
    if policy == "full":
        parts = _layout_parts(profile, lambda i: False)
    else:
        parts = [(BlockMode.OPS, sum(op.nbytes for op in p.recomputed if _kept_by(op, kept))) for p in blocks]
    return profile.min_bytes + sum(part for _, part in parts), parts


def _policy_name(policy: object) -> str:
    name = policy.value if isinstance(policy, CheckpointType) else policy
    if name not in ("none", "full", "ops"):
        raise ValueError(
            f"predict_step takes a CheckpointPlan or a fixed policy 'none', 'full' or 'ops', not {policy!r}"
        )
    return str(name)


def predict_step(
    model: nn.Module,
    example_inputs: Any,
    plan_or_policy: CheckpointPlan | CheckpointType | str,
    step_budget: StepBudget,
    *,
    adapter: AdapterSpec | str | None = None,
    blocks: Sequence[str] | None = None,
) -> StepPeak:
    """One rank's predicted peak of a training step of ``model`` at ``example_inputs`` (real, ``meta`` or fake)
    under ``plan_or_policy`` (a :class:`~ac_core.CheckpointPlan` or ``"none"``, ``"full"``, ``"ops"``), part by
    part (a :class:`~ac_core.budget.StepPeak`; how each is predicted: :mod:`ac_core.budget.predict`), with
    ``step_budget``'s sharding, optimizer, dtypes, loss and margin. Planning's forwards, isolated: no trace left."""
    if not isinstance(step_budget, StepBudget):
        raise TypeError(f"predict_step needs a StepBudget(memory, ...), not {step_budget!r}")
    if isinstance(plan_or_policy, CheckpointPlan):
        resolved = resolve_blocks(model, adapter, blocks if blocks is not None else plan_or_policy.containers)
        plan_or_policy.check_fits(resolved)
        facts = step_facts(resolved, example_inputs, step_budget)
        return plan_peak(plan_or_policy, facts, step_budget)
    policy = _policy_name(plan_or_policy)
    resolved = resolve_blocks(model, adapter, blocks)
    profile = profile_model(resolved, example_inputs)
    held, parts = _fixed_parts(profile, policy, retained_ops(resolved))
    facts = agreed(step_facts(resolved, example_inputs, step_budget), profile.group)  # see plan_for_step
    return peak_of(facts, step_budget, held, parts)


# Held budgets tried between the least and none's: a bisection, each step one solve, until the held bytes left
# undecided are under 1/_RESOLUTION of the memory (a fiftieth of the default 5% margin) or after _STEPS.
_STEPS = 16
_RESOLUTION = 1024


def plan_for_step(
    profile: ModelProfile,
    facts: StepFacts,
    budget: StepBudget,
    containers: tuple[str, ...] | None,
    *,
    cost: Cost | None = None,
    device: Device | None = None,
) -> CheckpointPlan:
    """The least-recompute plan whose predicted step peak (with the margin) stays within ``budget``'s memory, of
    two searches: the held budget bisected between the least any plan holds and what ``none`` holds; and each
    layout of unchecked blocks given the held bytes its own transient leaves (:func:`_layout_budget`), with a
    slack bisected on top. The peak is not monotone in the held budget: leaving the last block unchecked holds
    its activations but spares backward's first recompute, the step's largest transient (a Wan2.1-14B plan of 8
    blocks at 75,600 tokens: 0.7 GiB more held, 19 GiB less peak), so bisection alone can miss every plan that
    fits. ``cost`` and ``device`` as :func:`~ac_core.plan_activation_checkpointing` takes them."""
    # Measured by each rank of a context-parallel model: the first rank's, so that every rank plans the same.
    facts = agreed(facts, profile.group)

    def plan_at(held: int, layout: Callable[[frozenset[int]], int] | None = None) -> CheckpointPlan:
        at = MemoryBudget(f"{budget.describe()}: {held} bytes held", nbytes=held)
        # Quiet: where none fits, that is said below in the step budget's terms, not in these held bytes'.
        plan = plan_from_profile(
            profile, at, containers=containers, cost=cost, device=device, quiet=True, layout_budget=layout
        )
        return dataclasses.replace(plan, step_budget=budget)

    def recompute(plan: CheckpointPlan) -> float:
        seconds = plan.recompute_seconds
        return seconds if plan.cost == "time" and seconds is not None else plan.recompute_flops

    def fits(plan: CheckpointPlan) -> bool:
        return plan_peak(plan, facts, budget).fits

    none_peak = peak_of(facts, budget, profile.none_bytes, _layout_parts(profile, lambda i: True))
    if none_peak.fits:
        logger.warning(FITS_NONE, human_bytes(budget.nbytes, digits=2), human_bytes(none_peak.total, digits=2))
        return plan_at(profile.none_bytes)
    low = profile.min_bytes + profile.routing_bytes
    least_plan = plan_at(low)
    found = [least_plan] if fits(least_plan) else []
    high = profile.none_bytes - 1
    resolution = budget.nbytes // _RESOLUTION
    if found:
        for _ in range(_STEPS):
            if high - low <= resolution:
                break
            middle = (low + high + 1) // 2
            plan = plan_at(middle)
            if fits(plan):
                low = middle
                found.append(plan)
            else:
                high = middle - 1
    found += _by_layout(profile, facts, budget, plan_at, fits, resolution)
    if not found:
        least = plan_peak(least_plan, facts, budget)
        what, nbytes, fix = least.dominant()
        raise ValueError(
            f"{budget.describe()}: no plan fits; the least peak any plan reaches at these inputs is "
            f"{human_bytes(least.total, digits=2)} ({least.total} bytes, every block checkpointed, margin included): "
            f"{what} {human_bytes(nbytes, digits=2)} of the {human_bytes(least.total, digits=2)} least peak: {fix}"
        )
    return min(found, key=lambda plan: (recompute(plan), plan.device_bytes))


def _layout_budget(
    profile: ModelProfile, facts: StepFacts, budget: StepBudget, slack: int
) -> Callable[[frozenset[int]], int]:
    """Per set of unchecked blocks, the held bytes that keep the step within ``budget`` whatever the checkpointed
    blocks keep (keeping only lowers backward's transient, and the optimizer's temporaries beyond what is freed
    are at their most where the least is held), plus ``slack``."""

    def held(unchecked: frozenset[int]) -> int:
        parts = _layout_parts(profile, unchecked.__contains__)
        least = profile.min_bytes + sum(part for _, part in parts)
        return budget.nbytes - (peak_of(facts, budget, least, parts).total - least) + slack

    return held


def _by_layout(
    profile: ModelProfile,
    facts: StepFacts,
    budget: StepBudget,
    plan_at: Callable[[int, Callable[[frozenset[int]], int] | None], CheckpointPlan],
    fits: Callable[[CheckpointPlan], bool],
    resolution: int,
) -> list[CheckpointPlan]:
    """The plans that fit of those made with each layout's own held budget, at no slack and at slacks bisected up
    to the most any transient can be (the bound is loose where the checkpointed blocks keep much)."""
    found = []
    low, high = 0, max([facts.update, *(max(b.unchecked, b.checkpointed) for b in facts.blocks)])
    for step in range(_STEPS):
        slack = 0 if step == 0 else (low + high + 1) // 2
        try:
            plan = plan_at(profile.none_bytes - 1, _layout_budget(profile, facts, budget, slack))
        except ValueError:  # no layout fits even at its own budget
            plan = None
        if plan is not None and fits(plan):
            found.append(plan)
            low = slack
        elif step == 0:
            return found
        else:
            high = slack - 1
        if high - low <= resolution:
            break
    return found


__all__ = ["StepPeak", "predict_step"]
