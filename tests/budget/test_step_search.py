"""A step budget's plan is the least recompute among the plans that fit, though the step's peak is not monotone in
the held budget: leaving a late block unchecked holds its activations but spares backward its recompute, the
largest transient, so a plan holding more can peak lower. Checked against every plan of a dense grid of held
budgets, at step budgets where bisecting the held budget alone (the search before) came out up to 42% dearer."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from ac_core import StepBudget, resolve_blocks
from ac_core.budget import CheckpointPlan, MemoryBudget, profile_model
from ac_core.budget.devices import device
from ac_core.budget.planner import plan_from_profile
from ac_core.budget.predict import StepFacts, peak_of, plan_for_step, plan_peak, step_facts
from ac_core.budget.profile import ModelProfile
from ac_core.policies import BlockMode
from ac_core.testing import TOY_ADAPTER, toy_case

H100 = device("h100")
GRID = 200
BUDGET = StepBudget("1GiB", device="h100", optimizer="sgd", margin=0.0)


@functools.cache
def _measured(dim: int, depth: int, tokens: int) -> tuple[ModelProfile, StepFacts, int, tuple[CheckpointPlan, ...]]:
    """The toy's profile and step facts on meta, none's peak, and the time-costed plan at each of GRID + 1 held
    budgets from the least to none's."""
    with torch.device("meta"):
        case = toy_case(dim=dim, depth=depth, tokens=tokens, heads=4)
    blocks = resolve_blocks(case.model, TOY_ADAPTER, None)
    profile = profile_model(blocks, dict(case.inputs))
    facts = step_facts(blocks, dict(case.inputs), BUDGET)
    none = [(BlockMode.NONE, p.none_bytes) for _, p in profile.blocks]
    none_peak = peak_of(facts, BUDGET, profile.none_bytes, none).total
    low, high = profile.min_bytes + profile.routing_bytes, profile.none_bytes
    plans = tuple(
        plan_from_profile(
            profile, MemoryBudget("grid", nbytes=low + (high - low) * i // GRID), cost="time", device=H100, quiet=True
        )
        for i in range(GRID + 1)
    )
    return profile, facts, none_peak, plans


@pytest.mark.parametrize(
    ("toy", "fraction"), [((64, 4, 256), 0.7), ((64, 4, 256), 0.75), ((128, 6, 512), 0.75), ((128, 6, 512), 0.8)]
)
def test_the_plan_recomputes_no_more_than_any_plan_that_fits(toy, fraction):
    profile, facts, none_peak, grid = _measured(*toy)
    budget = dataclasses.replace(BUDGET, memory=int(none_peak * fraction))
    fitting = [p for p in grid if plan_peak(dataclasses.replace(p, step_budget=budget), facts, budget).fits]
    assert fitting  # the grid has plans that fit: the case is one to search
    plan = plan_for_step(profile, facts, budget, None, cost="time", device=H100)
    assert plan_peak(plan, facts, budget).fits
    best = min(p.recompute_seconds or 0.0 for p in fitting)
    assert plan.recompute_seconds is not None and plan.recompute_seconds <= best
