"""The memory-budget check: a plan's measured bytes stay within its budget, it trains like the plain model, and
its JSON round trip gives the same plan."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ac_core import apply_activation_checkpointing, remove_activation_checkpointing
from ac_core.budget import CheckpointPlan, plan_from_profile, profile_model
from ac_core.measure import held_for_backward

from ..subjects import Subject
from ..training import EAGER_TOLERANCE, Tolerance, assert_same_step, build, plain_step
from ..training import step as train_step

SLACK = 0.05
"""How far above its budget a plan's measured held-for-backward may land (the issue's +5%)."""


@dataclass(frozen=True)
class BudgetReport:
    """What :func:`check_budget` planned and measured, in bytes and FLOPs."""

    plan: CheckpointPlan
    none_bytes: int
    budget_bytes: int
    predicted_bytes: int
    measured_bytes: int


def check_budget(
    subject: Subject, fraction: float = 0.5, device: str = "cpu", *, tolerance: Tolerance = EAGER_TOLERANCE
) -> BudgetReport:
    """Plan the subject's tiny model for ``fraction`` of what ``none`` holds for backward, apply it and fail
    unless: the bytes its forward holds for backward stay within the budget +5%; loss and gradients equal the
    plain model's within ``tolerance``; ``CheckpointPlan.from_json(plan.to_json())`` is the same plan.

    Where ``fraction`` of ``none`` is below the least any plan holds (every block checkpointed, its inputs
    kept), the budget is that least.
    """
    adapter = replace(subject.adapter, models=(subject.model,))
    expected = plain_step(subject, device)
    case = build(subject, device)
    inputs = dict(case.inputs)
    profile = profile_model(subject.plan(case.model), inputs)
    budget = max(math.floor(fraction * profile.none_bytes), profile.min_bytes)
    plan = plan_from_profile(profile, budget)
    what = f"{subject.id} on {device}, budget {budget:,} B ({fraction:.0%} of none's {profile.none_bytes:,} B)"
    again = CheckpointPlan.from_json(plan.to_json())
    assert again == plan, f"{what}: the plan read back from its JSON differs:\n{again}\nvs\n{plan}"
    apply_activation_checkpointing(case.model, plan, adapter=adapter)
    try:
        _, held = held_for_backward(lambda: case.model(**case.inputs))
        assert held <= (1 + SLACK) * budget, (
            f"{what}: the plan holds {held:,} B for backward (predicted {plan.held_bytes:,} B), over the budget "
            f"+{SLACK:.0%}\n{plan}"
        )
        got = train_step(case)
    finally:
        remove_activation_checkpointing(case.model)
    assert_same_step(got, expected, tolerance, f"{what}: the planned model vs plain")
    return BudgetReport(plan, profile.none_bytes, budget, plan.held_bytes, held)


__all__ = ["SLACK", "BudgetReport", "check_budget"]
