"""The planning verbs: a memory budget of held bytes planned from a profile of the model, a step budget from
the whole step's predicted peak (:mod:`.predict`, which plans through :mod:`.planner` in turn)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from torch import nn

from ..blocks import ModelBlocks, resolve_blocks
from ..offload import OffloadConfig
from ..spec import AdapterSpec
from .checkpoint_plan import CheckpointPlan
from .memory_budget import MemoryBudget
from .offload_cost import offload_request
from .planner import DeviceLike, _costing, default_device, named_containers, plan_from_profile, resolve_device
from .predict import StepFacts, StepPeak, plan_for_step, plan_peak, step_facts
from .profile import ModelProfile, profile_model
from .solve import Cost
from .step_budget import StepBudget, refuse_step_offload


class StepPlanner:
    """Plans of one model at one input for step budgets that differ only in memory, and their predicted peaks:
    the model profiled once and the step's facts measured once (:func:`~ac_core.predict_step`'s), so that
    ``ac-core plan`` prices the budgets beside a plan without profiling again. ``device`` None: the step budget's
    accelerator where it names one, else the model's own (:func:`default_device`). ``profile``: one already made
    of ``blocks`` at ``example_inputs`` (:func:`profile_model`'s), not made again."""

    def __init__(
        self,
        blocks: ModelBlocks,
        example_inputs: Any,
        step_budget: StepBudget,
        *,
        cost: Cost | None = None,
        device: DeviceLike | None = None,
        profile: ModelProfile | None = None,
    ) -> None:
        if device is None and step_budget.device not in (None, "cpu"):
            device = step_budget.device  # the CPU only where calibrated: default_device's rule, below
        self.device = resolve_device(device) if device is not None else default_device(blocks.model)
        _costing(cost, self.device)
        self.blocks, self.example_inputs, self.step_budget = blocks, example_inputs, step_budget
        self.cost: Cost | None = cost
        self._profile = profile
        self._facts: StepFacts | None = None

    @property
    def profile(self) -> ModelProfile:
        """The model's profile at the inputs, made on the first need."""
        if self._profile is None:
            self._profile = profile_model(self.blocks, self.example_inputs)
        return self._profile

    def _step_facts(self) -> StepFacts:
        if self._facts is None:
            self._facts = step_facts(self.blocks, self.example_inputs, self.step_budget)
        return self._facts

    def plan(self, memory: int | str | None = None, *, cost: Cost | None = None) -> CheckpointPlan:
        """The least-recompute plan within the step budget, or the same budget at ``memory`` (bytes or a size);
        ``cost`` None: the planner's own."""
        budget = self.step_budget if memory is None else dataclasses.replace(self.step_budget, memory=memory)
        containers = named_containers(self.blocks)
        cost = self.cost if cost is None else cost
        return plan_for_step(self.profile, self._step_facts(), budget, containers, cost=cost, device=self.device)

    def predict(self, plan: CheckpointPlan) -> StepPeak:
        """``plan``'s predicted step peak under the step budget (its memory: the plan's own step budget's)."""
        plan.check_fits(self.blocks)
        budget = plan.step_budget if plan.step_budget is not None else self.step_budget
        return plan_peak(plan, self._step_facts(), budget)


def plan_blocks(
    blocks: ModelBlocks,
    example_inputs: Any,
    memory_budget: MemoryBudget | StepBudget,
    offload: bool | OffloadConfig | None,
    *,
    cost: Cost | None = None,
    device: DeviceLike | None = None,
) -> CheckpointPlan:
    """The plan for ``memory_budget`` on resolved ``blocks`` (what the policies' handlers call); ``device``
    None: a step budget's accelerator (its ``device``, a name in the table), else the model's own
    (:func:`default_device`)."""
    offload_request(offload)  # a bad offload= fails before the model runs
    if isinstance(memory_budget, StepBudget):
        refuse_step_offload(offload)
        return StepPlanner(blocks, example_inputs, memory_budget, cost=cost, device=device).plan()
    where = resolve_device(device) if device is not None else default_device(blocks.model)
    _costing(cost, where)
    profile = profile_model(blocks, example_inputs)
    containers = named_containers(blocks)
    return plan_from_profile(profile, memory_budget, offload=offload, containers=containers, cost=cost, device=where)


def plan_activation_checkpointing(
    model: nn.Module,
    example_inputs: Any,
    memory_budget: MemoryBudget | StepBudget | float | int | str,
    *,
    adapter: AdapterSpec | str | None = None,
    blocks: Sequence[str] | None = None,
    offload: bool | OffloadConfig | None = None,
    cost: Cost | None = None,
    device: DeviceLike | None = None,
) -> CheckpointPlan:
    """The plan with the least predicted recompute time (or FLOPs) whose bytes held for backward stay within
    ``memory_budget``.

    ``example_inputs``: one forward's inputs (a dict of keyword arguments, a tuple of positional ones, or a
    tensor), real, on ``meta`` or fake: the plan is made from shapes, FLOPs and bytes. ``memory_budget``: a
    fraction of what ``none`` holds (a float, 0 < f <= 1), bytes (an int) or a size string (``"40GiB"``). A
    budget below the least possible is an error naming it in bytes; one at or above ``none`` plans no
    checkpointing (and says so). Blocks come from the adapter or ``blocks=``, as for the fixed policies. Or a
    :class:`~ac_core.StepBudget`: then the whole training step's predicted peak on one rank (model states,
    FSDP's gathered block, what is held, backward's largest transient, the loss, the margin; see
    :func:`~ac_core.predict_step`) stays within its ``memory``, and a memory nothing fits is an error naming the
    least peak possible and its largest part; the plan records the step budget.

    ``cost="time"`` minimises the recompute's predicted seconds on ``device`` (each op occurrence's roofline, see
    :mod:`~ac_core.budget.roofline`: memory-bound ops such as a GELU or a norm cost time without FLOPs);
    ``cost="flops"`` its FLOPs. ``device``: a name from :data:`~ac_core.budget.devices.DEVICES` (``"h100"``),
    ``"cpu"`` (``ac-core calibrate``'s figures, else measured now) or a torch device; None: a
    :class:`~ac_core.StepBudget`'s accelerator where it names one, else the model's parameters' device where its
    figures are known without measuring (:func:`default_device`: a CUDA device in the table, the CPU once
    calibrated). ``cost`` None: time where a device is known, else FLOPs (planning on ``meta`` for a cluster:
    pass ``device="h100"``). With a device, the plan records each block's predicted
    seconds and the predicted step-time overhead over ``none``, whichever the cost.

    ``offload=True`` (or an :class:`~ac_core.OffloadConfig`, for its ``min_bytes``, ``max_inflight_bytes``,
    ``prefetch_bytes`` and ``keep_on_device``) lets the plan move checkpointed blocks' saved inputs to host memory,
    before it recomputes more; the budget then counts the device bytes offload keeps in flight and prefetched.
    Planning needs no GPU (plan on ``meta`` for a cluster); running an offloading plan needs the model on CUDA,
    and raises otherwise. The rest of the model's saved tensors stay on the device. Such a plan brings its own
    offload: apply it without ``offload=`` (which would replace it and move more than planned).

    Planning runs forwards of its own (the whole model unchecked, each distinct block alone, every block
    checkpointed) and leaves no trace on real tensors: around each, the CPU and CUDA RNG states are taken and put
    back; a dispatch mode copies a parameter or example input the first time an op writes into it and writes the
    copy back; buffers are copied up front and written back where their values changed (BatchNorm's statistics);
    replaced buffers and ``training`` flags are put back; the forward hooks and pre-hooks of user code (on the
    model's modules and global) are silenced, while torch's (FSDP2's unshard), ac-core's and the model
    libraries' run. All of it on error too. A block that changes its input in place is refused (it cannot be
    checkpointed), naming it, the argument and the op; any other failure in a planning forward names the block
    and the op. To plan from your own training step (its forward context, its loss), see
    :func:`~ac_core.profile_step`.
    """
    # A bad budget fails before the blocks are resolved.
    parsed = memory_budget if isinstance(memory_budget, StepBudget) else MemoryBudget.of(memory_budget)
    resolved = resolve_blocks(model, adapter, blocks)
    return plan_blocks(resolved, example_inputs, parsed, offload, cost=cost, device=device)
