"""Planning for a memory budget: profile the model, solve the knapsack, and say it as a :class:`CheckpointPlan`."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

import torch
from torch import nn

from ..blocks import ModelBlocks
from ..offload import OffloadConfig
from ..policies import BlockMode
from ..units import human_bytes
from .checkpoint_plan import CheckpointPlan, PlannedBlock
from .devices import Device, calibration_path, device_for
from .devices import device as named_device
from .memory_budget import MemoryBudget
from .offload_cost import Moved, OffloadCost, offload_request, recorded
from .profile import ModelProfile
from .solve import Choice, Cost, none_step_seconds, solve

logger = logging.getLogger("ac_core")


DeviceLike = Device | str | torch.device


def resolve_device(device: DeviceLike) -> Device:
    """A :class:`~.devices.Device` from its name in the device table (``"h100"``), ``"cpu"`` (its calibration,
    else measured now), or a torch device (a CUDA device by its name)."""
    if isinstance(device, Device):
        return device
    if isinstance(device, str) and not device.strip().lower().startswith("cuda"):
        return named_device(device)
    return device_for(device)


def default_device(model: nn.Module) -> Device | None:
    """The device of ``model``'s parameters where its figures are known without measuring: a CUDA device in the
    table, or the CPU once ``ac-core calibrate`` wrote its figures, where they rate every floating dtype of the
    parameters. Else None (``meta``, a CPU never calibrated: measuring would take seconds and vary from run to run,
    so the plan would too; a float64 model on a CPU calibrated in float32 and bfloat16)."""
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    where = first.device if first is not None else torch.device("cpu")
    known = (where.type == "cuda" and torch.cuda.is_available()) or (
        where.type == "cpu" and calibration_path().exists()
    )
    if not known:
        return None
    try:
        found = device_for(where)
        for dtype in {p.dtype for p in model.parameters() if p.is_floating_point()}:
            found.peak_flops(dtype)
    except ValueError as exc:
        logger.info("ac-core: no device figures for %s (%s): the plan is costed in FLOPs", where, exc)
        return None
    return found


def _costing(cost: Cost | None, device: Device | None) -> Cost:
    """The cost the knapsack minimises: ``cost``, else time where a device is known and FLOPs where not."""
    if cost not in (None, "time", "flops"):
        raise ValueError(f'cost takes "time" or "flops", not {cost!r}')
    if cost == "time" and device is None:
        raise ValueError(
            'cost="time" needs a device to predict seconds on: pass device= (a name such as "h100", "cpu" '
            'after `ac-core calibrate`), or cost="flops"'
        )
    return cost or ("time" if device is not None else "flops")


def named_containers(blocks: ModelBlocks) -> tuple[str, ...] | None:
    """The containers' FQNs a plan records where ``blocks=`` named them (None where the adapter did)."""
    return None if blocks.model_spec is not None else tuple(c.path for c in blocks.containers)


def _least(profile: ModelProfile, offload: OffloadCost | None) -> int:
    """What the plan holding least holds: every block checkpointed keeping only its routing decision, each
    offloading where that saves bytes."""
    least = profile.min_bytes + profile.routing_bytes
    if offload is None:
        return least
    return least - max(0, offload.moved(offload.blocks).gain)


def plan_from_profile(
    profile: ModelProfile,
    memory_budget: object,
    *,
    offload: bool | OffloadConfig | None = None,
    containers: tuple[str, ...] | None = None,
    cost: Cost | None = None,
    device: DeviceLike | None = None,
    quiet: bool = False,
    layout_budget: Callable[[frozenset[int]], int] | None = None,
) -> CheckpointPlan:
    """The plan for ``memory_budget`` from a model's profile (:func:`~ac_core.budget.profile_model`): profile
    once, plan at several budgets (what ``ac-core bench --policy budget`` does). ``containers``: those
    ``blocks=`` named (see :func:`named_containers`), recorded in the plan. ``cost`` and ``device`` as for
    :func:`plan_activation_checkpointing`, but a profile does not know its model's device: without ``device``
    the plan is costed in FLOPs. ``quiet``: no warning for a budget at or above what ``none`` holds (a caller
    that derived the budget says it in its own terms). ``layout_budget``: a tighter budget per set of unchecked
    blocks (see :func:`~.solve.solve`), which a step budget derives from backward's transient."""
    memory_budget = MemoryBudget.of(memory_budget)
    where = resolve_device(device) if device is not None else None
    cost = _costing(cost, where)
    config = offload_request(offload)
    model = OffloadCost(profile.saved_inputs, config) if config is not None else None
    budget = memory_budget.bytes_of(profile.none_bytes)
    minimum = _least(profile, model)
    if budget < minimum:
        routing = " and MoE routing decisions" if profile.routing_bytes else ""
        moved = ", those offload moves on the host" if minimum < profile.min_bytes + profile.routing_bytes else ""
        raise ValueError(
            f"memory_budget={memory_budget.given!r} ({budget} bytes) is below the least any plan holds for backward at "
            f"these inputs: {minimum} bytes ({human_bytes(minimum, digits=2)}), every block checkpointed and nothing "
            f"kept but block inputs{routing}{moved} ('none' holds {profile.none_bytes} bytes)"
        )
    if budget >= profile.none_bytes:
        if not quiet:
            logger.warning(
                "ac-core: memory_budget=%r (%d bytes) is at or above what 'none' holds for backward (%d bytes): "
                "the plan checkpoints no block",
                memory_budget.given,
                budget,
                profile.none_bytes,
            )
        choices = [Choice(BlockMode.NONE, (), p.none_bytes, 0) for _, p in profile.blocks]
    else:
        choices = solve(profile, budget, model, cost=cost, device=where, layout_budget=layout_budget)
    moved = Moved()
    if model is not None:
        moved = model.moved([path for (path, _), c in zip(profile.blocks, choices, strict=True) if c.offload])
    return CheckpointPlan(
        model_class=profile.model_class,
        blocks=tuple(
            PlannedBlock(
                path=path,
                mode=c.mode,
                keep=c.keep,
                class_name=p.class_name,
                inputs=p.signature,
                held_bytes=c.held_bytes,
                recompute_flops=c.recompute_flops,
                offload=c.offload,
                host_bytes=moved.host.get(path, 0) if c.offload else 0,
                recompute_seconds=c.recompute_seconds if where is not None else None,
                offload_seconds=c.offload_seconds,
            )
            for (path, p), c in zip(profile.blocks, choices, strict=True)
        ),
        inputs=profile.inputs,
        budget_bytes=budget,
        none_bytes=profile.none_bytes,
        min_bytes=minimum,
        base_bytes=profile.min_bytes,
        offload=recorded(config) if config is not None else None,
        freed_bytes=moved.freed,
        window_bytes=moved.window,
        containers=containers,
        cost=cost,
        device=where.name if where is not None else None,
        none_seconds=none_step_seconds(profile, where) if where is not None else None,
    )
