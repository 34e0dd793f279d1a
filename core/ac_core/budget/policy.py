"""The memory-budget policies and their handlers: a :class:`~.checkpoint_plan.CheckpointPlan` applied like any
policy config, and :class:`Budget`, which plans (:mod:`.planner`) and applies in one call; on the eager route and
on ``ac_core.compile``'s graph route (:mod:`.graph_route`)."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn

from ..blocks import ModelBlocks
from ..offload import OffloadConfig
from ..policies import (
    BlockMode,
    BlockSelection,
    GraphDecisions,
    GraphRequest,
    PolicyConfig,
    PolicyTraits,
    register_policy,
)
from ._layer import PlannedLayer, PlanOffload
from .checkpoint_plan import CheckpointPlan
from .graph_route import check_solver, plan_decisions, refuse_offload, torch_budget
from .memory_budget import MemoryBudget
from .offload_cost import offload_request
from .planning import plan_blocks
from .profile import Signature
from .step_budget import StepBudget, refuse_step_offload

logger = logging.getLogger("ac_core")


@dataclass(frozen=True)
class Budget(PolicyConfig):
    """Plan for ``memory_budget`` at ``example_inputs`` and apply it (see :func:`plan_activation_checkpointing`):
    planning inside ``apply_activation_checkpointing`` leaves the model, the inputs, the RNG and the hooks as they
    were, as planning does. ``memory_budget`` is kept parsed, as a :class:`MemoryBudget`, or a
    :class:`~ac_core.StepBudget` as given (the whole step's peak; without offload)."""

    @property
    def budget(self) -> MemoryBudget | StepBudget:
        """The parsed ``memory_budget``."""
        assert isinstance(self.memory_budget, MemoryBudget | StepBudget)  # parsed in __post_init__
        return self.memory_budget

    memory_budget: MemoryBudget | StepBudget | float | int | str | None = None
    example_inputs: Any = field(default=None, compare=False, repr=False)
    offload: bool | OffloadConfig | None = None
    name: ClassVar[str] = "budget"

    def __post_init__(self) -> None:
        if self.memory_budget is None:
            raise ValueError("Budget needs memory_budget: a fraction of 'none' (0.5), bytes, or a size ('40GiB')")
        if isinstance(self.memory_budget, StepBudget):
            refuse_step_offload(self.offload)
        else:
            object.__setattr__(self, "memory_budget", MemoryBudget.of(self.memory_budget))
        if self.example_inputs is None:
            raise ValueError("Budget needs example_inputs=: one forward's inputs (a dict, a tensor or a tuple)")
        offload_request(self.offload)


def _make_layer(
    keep: tuple[tuple[str, int], ...], planned: Signature, offload: PlanOffload | None, kind: Any, retained: Any,
    path: str, expects_attention: bool = True, *, root: nn.Module | None = None, preserve_rng_state: bool = True,
) -> PlannedLayer:  # fmt: skip
    if offload is not None:
        offload.install()  # built when the verb installs layers: after it took earlier offload off the model
    return PlannedLayer(
        keep, planned, path, expects_attention, root=root, offload=offload is not None,
        preserve_rng_state=preserve_rng_state,
    )  # fmt: skip


def _plan_on_the_graph(config: CheckpointPlan, request: GraphRequest) -> GraphDecisions:
    return plan_decisions(config, request)


def _budget_on_the_graph(config: Budget, request: GraphRequest) -> GraphDecisions:
    check_solver(request.solver)
    refuse_offload(bool(config.offload))
    plan = plan_blocks(request.blocks(), config.example_inputs, config.budget, None)
    if request.solver == "torch":
        # torch's budget is a fraction of 'none': a step budget's is the held bytes the plan was left.
        held = config.budget if isinstance(config.budget, MemoryBudget) else MemoryBudget.of(plan.budget_bytes)
        return torch_budget(held, plan)
    logger.info("ac-core: budget plan for the compiled route\n%s", plan)
    return plan_decisions(plan, request)


@register_policy(CheckpointPlan, traits=PolicyTraits(from_name=False, budgeted=True), graph=_plan_on_the_graph)
def _plan_selections(config: CheckpointPlan, blocks: ModelBlocks) -> list[BlockSelection]:
    config.check_fits(blocks)
    by_path = {b.path: b for b in blocks}
    offload = PlanOffload(blocks.model, config.offload) if config.offload is not None else None
    selections = []
    for planned in config.blocks:
        if planned.mode == BlockMode.NONE:
            continue
        # The layer keeps the planned occurrences; the verb installs it in place of a CheckpointLayer.
        factory = functools.partial(_make_layer, planned.keep, planned.inputs, offload if planned.offload else None)
        selections.append(BlockSelection(by_path[planned.path], BlockMode.FULL, layer=factory))
    return selections


@register_policy(Budget, traits=PolicyTraits(from_name=False, budgeted=True), graph=_budget_on_the_graph)
def _budget_selections(config: Budget, blocks: ModelBlocks) -> list[BlockSelection]:
    plan = plan_blocks(blocks, config.example_inputs, config.budget, config.offload)
    logger.info("ac-core: budget plan\n%s", plan)
    return _plan_selections(plan, blocks)
