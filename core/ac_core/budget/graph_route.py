"""The memory-budget policies on ``ac_core.compile``'s graph route: a plan's decisions, or torch's own budget.

``ac_core.compile(model, plan)`` tags each block's ops as the plan says (see ``graph/keep_planned.py``);
``ac_core.compile(model, Budget(...))`` plans first, or with ``solver="torch"`` sets torch's
``activation_memory_budget`` to the same fraction of what ``none`` holds instead.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from torch import nn

from ..policies import GraphDecisions, GraphRequest
from .checkpoint_plan import CheckpointPlan
from .memory_budget import MemoryBudget
from .profile import describe_signature, signature

logger = logging.getLogger("ac_core")

# Who turns a memory budget into save decisions on the compiled route: ac-core's plan (profiled per block,
# solved across blocks) or torch's activation_memory_budget (a knapsack per compiled graph).
SOLVERS = ("ac-core", "torch")


def check_solver(solver: str) -> None:
    if solver not in SOLVERS:
        raise ValueError(f"solver={solver!r}: choose one of {', '.join(map(repr, SOLVERS))}")


def refuse_offload(offloads: bool) -> None:
    # Offload moves saved tensors through autograd's saved-tensor hooks, which a compiled backward does not run.
    if offloads:
        raise ValueError(
            "this memory budget moves checkpointed blocks' inputs to host memory, which runs in eager mode only: "
            "plan without offload= for ac_core.compile, or apply the plan with "
            "ac_core.apply_activation_checkpointing(model, plan)"
        )


def plan_decisions(plan: CheckpointPlan, request: GraphRequest) -> GraphDecisions:
    """A plan's per-block decisions for the pass, after checking it fits the model as the eager verb checks it;
    the compiled model then refuses inputs of other shapes than planned."""
    check_solver(request.solver)
    if request.solver != "ac-core":
        raise ValueError(
            "a CheckpointPlan holds ac-core's decisions; to let torch solve the budget pass "
            "ac_core.Budget(memory_budget, example_inputs=...) with solver='torch'"
        )
    refuse_offload(any(b.offload for b in plan.blocks))
    plan.check_fits(request.blocks())
    # A budget counts bytes held: what recomputes without FLOPs (a final norm, a residual summed from kept outputs)
    # is better recomputed than held, which leaves those bytes to the blocks; the plan's layout says how.
    return GraphDecisions(
        blocks=plan.blocks,
        recompute_free=True,
        recompute_outside=plan.compile_outside == "recomputed",
        free_by_torch=plan.compile_free == "torch_rules",
        recompute_block_inputs=plan.compile_block_inputs == "recomputable",
        on_compiled=functools.partial(refuse_other_inputs, plan=plan),
    )


def torch_budget(budget: MemoryBudget, plan: CheckpointPlan) -> GraphDecisions:
    """torch's partitioner solving ``budget`` as the fraction of ``none`` it is (torch's budget takes fractions)."""
    fraction = budget.fraction_of(plan.none_bytes)
    logger.info("ac-core: torch's activation_memory_budget = %.4f for this compile", fraction)
    return GraphDecisions(torch_budget=fraction, on_compiled=functools.partial(refuse_other_inputs, plan=plan))


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
