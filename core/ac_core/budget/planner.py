"""Planning for a memory budget: profile the model, solve the knapsack, and say it as a :class:`CheckpointPlan`."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from torch import nn

from ..blocks import ModelBlocks, resolve_blocks
from ..offload import OffloadConfig
from ..policies import BlockMode
from ..spec import AdapterSpec
from ..units import human_bytes
from .checkpoint_plan import CheckpointPlan, PlannedBlock
from .memory_budget import MemoryBudget
from .offload_cost import Moved, OffloadCost, offload_request, recorded
from .profile import ModelProfile, profile_model
from .solve import Choice, solve

logger = logging.getLogger("ac_core")


def plan_blocks(
    blocks: ModelBlocks, example_inputs: Any, memory_budget: MemoryBudget, offload: bool | OffloadConfig | None
) -> CheckpointPlan:
    """The plan for ``memory_budget`` on resolved ``blocks`` (what the policies' handlers call)."""
    offload_request(offload)  # a bad offload= fails before the model runs
    profile = profile_model(blocks, example_inputs)
    return plan_from_profile(profile, memory_budget, offload=offload, containers=named_containers(blocks))


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
) -> CheckpointPlan:
    """The plan for ``memory_budget`` from a model's profile (:func:`~ac_core.budget.profile_model`): profile
    once, plan at several budgets (what ``ac-core bench --policy budget`` does). ``containers``: those
    ``blocks=`` named (see :func:`named_containers`), recorded in the plan."""
    memory_budget = MemoryBudget.of(memory_budget)
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
        logger.warning(
            "ac-core: memory_budget=%r (%d bytes) is at or above what 'none' holds for backward (%d bytes): "
            "the plan checkpoints no block",
            memory_budget.given,
            budget,
            profile.none_bytes,
        )
        choices = [Choice(BlockMode.NONE, (), p.none_bytes, 0) for _, p in profile.blocks]
    else:
        choices = solve(profile, budget, model)
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
    )


def plan_activation_checkpointing(
    model: nn.Module,
    example_inputs: Any,
    memory_budget: MemoryBudget | float | int | str,
    *,
    adapter: AdapterSpec | str | None = None,
    blocks: Sequence[str] | None = None,
    offload: bool | OffloadConfig | None = None,
) -> CheckpointPlan:
    """The plan with the least recompute FLOPs whose bytes held for backward stay within ``memory_budget``.

    ``example_inputs``: one forward's inputs (a dict of keyword arguments, a tuple of positional ones, or a
    tensor), real, on ``meta`` or fake: the plan is made from shapes, FLOPs and bytes. ``memory_budget``: a
    fraction of what ``none`` holds (a float, 0 < f <= 1), bytes (an int) or a size string (``"40GiB"``). A
    budget below the least possible is an error naming it in bytes; one at or above ``none`` plans no
    checkpointing (and says so). Blocks come from the adapter or ``blocks=``, as for the fixed policies.

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
    parsed = MemoryBudget.of(memory_budget)  # a bad budget fails before the blocks are resolved
    return plan_blocks(resolve_blocks(model, adapter, blocks), example_inputs, parsed, offload)
