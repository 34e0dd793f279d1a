"""The compiled route of a memory budget: a checkpoint plan's decisions for the graph pass, or torch's own budget.

``ac_core.compile(model, plan)`` tags each block's ops as the plan says (see keep_planned.py);
``ac_core.compile(model, Budget(...))`` plans first, with ``solver="torch"`` it sets torch's
``activation_memory_budget`` to the same fraction of what ``none`` holds instead. Imported by
``ac_core.compile`` only, so that ``ac_core.graph`` does not import the planner.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from torch import nn

from ..budget import Budget, CheckpointPlan, parse_budget, plan_activation_checkpointing
from ..budget.profile import describe_signature, signature
from ..plan import resolve_blocks
from ..policies import PolicyConfig, select
from ..spec import AdapterSpec
from .keep_planned import BlockDecision
from .torch_compile import SOLVERS, GraphRoute

logger = logging.getLogger("ac_core")


def is_budget_config(config: PolicyConfig) -> bool:
    return isinstance(config, (Budget, CheckpointPlan))


def decisions(plan: CheckpointPlan) -> tuple[BlockDecision, ...]:
    """The plan's per-block choices, as the graph pass takes them."""
    return tuple(BlockDecision(b.path, b.mode, frozenset(b.keep)) for b in plan.blocks)


def _torch_fraction(config: Budget, plan: CheckpointPlan) -> float:
    kind, value = parse_budget(config.memory_budget)
    # A size is turned into the fraction of none it is; torch's budget takes only fractions.
    return value if kind == "fraction" else min(1.0, plan.budget_bytes / plan.none_bytes)


def _refuse_offload(config: Budget | CheckpointPlan) -> None:
    # Offload moves saved tensors through autograd's saved-tensor hooks, which a compiled backward does not run.
    offloads = any(b.offload for b in config.blocks) if isinstance(config, CheckpointPlan) else config.offload
    if offloads:
        raise ValueError(
            "this memory budget moves checkpointed blocks' inputs to host memory, which runs in eager mode only: "
            "plan without offload= for ac_core.compile, or apply the plan with "
            "ac_core.apply_activation_checkpointing(model, plan)"
        )


def budget_route(
    model: nn.Module,
    config: PolicyConfig,
    route: GraphRoute,
    solver: str,
    adapter: AdapterSpec | str | None,
    blocks: Sequence[str] | None,
) -> tuple[GraphRoute, CheckpointPlan]:
    """``route`` (from :func:`prepare_graph_route`, eager checkpointing already off ``model``) following ``config``,
    and the plan behind it.

    A :class:`CheckpointPlan` is checked against the model's class and block layout as the eager verb checks
    it. A :class:`Budget` is planned on the model at its ``example_inputs``; with ``solver="torch"`` the plan
    only turns a size into a fraction of ``none`` and torch's partitioner solves each graph itself.
    """
    if solver not in SOLVERS:
        raise ValueError(f"solver={solver!r}: choose one of {', '.join(map(repr, SOLVERS))}")
    assert isinstance(config, (Budget, CheckpointPlan)), "called for budget configs only"
    _refuse_offload(config)
    if isinstance(config, CheckpointPlan):
        if solver != "ac-core":
            raise ValueError(
                "a CheckpointPlan holds ac-core's decisions; to let torch solve the budget pass "
                "ac_core.Budget(memory_budget, example_inputs=...) with solver='torch'"
            )
        select(config, resolve_blocks(model, adapter, blocks))  # refuses another class or layout, naming it
        return dataclasses.replace(route, plan=decisions(config)), config
    assert isinstance(config, Budget) and config.memory_budget is not None  # both checked by Budget itself
    plan = plan_activation_checkpointing(
        model, config.example_inputs, config.memory_budget, adapter=adapter, blocks=blocks
    )
    if solver == "torch":
        fraction = _torch_fraction(config, plan)
        logger.info("ac-core: torch's activation_memory_budget = %.4f for this compile", fraction)
        return dataclasses.replace(route, memory_budget=fraction), plan
    logger.info("ac-core: budget plan for the compiled route\n%s", plan)
    return dataclasses.replace(route, plan=decisions(plan)), plan


class _PlannedInputs:
    """A forward pre-hook on the compiled module: refuses inputs of other shapes than the plan was made for.

    Eager plans check each block's inputs; compiled blocks cannot (the check would cost a graph break), so the
    compiled module checks the model's. A hook on torch.compile's module runs outside the compiled code.
    Positions and keywords are not compared (a caller may pass by either), only the tensors' shapes and dtypes.
    """

    def __init__(self, plan: CheckpointPlan) -> None:
        self.planned = plan.inputs

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        got = signature(args, kwargs)
        if sorted(s[1:] for s in got) != sorted(s[1:] for s in self.planned):
            raise ValueError(
                f"this compiled model's checkpoint plan was made for inputs ({describe_signature(self.planned)}) "
                f"and got ({describe_signature(got)}); plan again at these inputs and compile again"
            )


def refuse_other_inputs(compiled: nn.Module, plan: CheckpointPlan) -> None:
    """Make ``compiled`` refuse inputs of other shapes than ``plan``'s (see :class:`_PlannedInputs`)."""
    compiled.register_forward_pre_hook(_PlannedInputs(plan), with_kwargs=True)
