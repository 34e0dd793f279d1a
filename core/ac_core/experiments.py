"""Experiments on the compiled route, built from the measurements: each route side by side (``ac-core compare``),
and ac-core's memory-budget plans against torch's ``activation_memory_budget`` (``ac-core compare --budget``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .budget import Budget, CheckpointPlan, MemoryBudget, plan_activation_checkpointing
from .checkpointing import apply_activation_checkpointing
from .measure.compiled import CompiledActivations, compiled_activations, with_and_without_pass
from .policies import Full, Ops
from .spec import ModelCase

EAGER_POLICIES = (Full(), Ops())
ROUTES = ("no pass", "graph pass", *(f"eager {policy.name}" for policy in EAGER_POLICIES))


def compare_routes(
    make_case: Callable[[], ModelCase],
    *,
    adapter: Any = None,
    blocks: Sequence[str] | None = None,
    backend: str = "aot_eager",
) -> dict[str, CompiledActivations]:
    """A measurement for each of :data:`ROUTES`, each on a fresh case from ``make_case``.

    ``"graph pass"`` is :func:`ac_core.compile`'s route, the eager routes apply
    :func:`ac_core.apply_activation_checkpointing` (:data:`EAGER_POLICIES`), all with ``adapter`` or ``blocks``.
    """
    results: dict[str, CompiledActivations] = {}
    if backend == "aot_eager":
        results["no pass"], results["graph pass"] = with_and_without_pass(make_case(), adapter=adapter, blocks=blocks)
    else:
        results["no pass"] = compiled_activations(make_case(), backend=backend)
        results["graph pass"] = compiled_activations(
            make_case(), sac=True, adapter=adapter, blocks=blocks, backend=backend
        )
    for policy in EAGER_POLICIES:
        case = make_case()
        apply_activation_checkpointing(case.model, policy, adapter=adapter, blocks=blocks)
        results[f"eager {policy.name}"] = compiled_activations(case, backend=backend)
    return results


@dataclass(frozen=True)
class BudgetComparison:
    """One memory budget on the compiled route, solved both ways on the same model and inputs: ``plan`` (ac-core's,
    with its predicted held-for-backward and recompute), ``ours`` (the plan's decisions in the graph pass) and
    ``torch`` (torch's ``activation_memory_budget`` at the same fraction of none), each measured."""

    budget: MemoryBudget | float | int | str
    plan: CheckpointPlan
    ours: CompiledActivations
    torch: CompiledActivations

    @property
    def recompute_ratio(self) -> float | None:
        """ac-core's recompute FLOPs over torch's (below 1: ac-core recomputes less); None where torch's are 0."""
        return self.ours.recompute_flops / self.torch.recompute_flops if self.torch.recompute_flops else None


def compare_budgets(
    make_case: Callable[[], ModelCase],
    budgets: Sequence[MemoryBudget | float | int | str],
    *,
    adapter: Any = None,
    blocks: Sequence[str] | None = None,
    backend: str = "aot_eager",
) -> list[BudgetComparison]:
    """For each budget, ac-core's plan and torch's ``activation_memory_budget`` compiled on fresh cases from
    ``make_case`` (which must build the same model each time) and measured side by side."""
    results = []
    for budget in budgets:
        case = make_case()
        plan = plan_activation_checkpointing(case.model, dict(case.inputs), budget, adapter=adapter, blocks=blocks)
        ours = compiled_activations(case, sac=True, policy=plan, adapter=adapter, blocks=blocks, backend=backend)
        other = make_case()
        theirs = compiled_activations(
            other,
            sac=True,
            policy=Budget(budget, example_inputs=dict(other.inputs)),
            solver="torch",
            adapter=adapter,
            blocks=blocks,
            backend=backend,
        )
        results.append(BudgetComparison(budget, plan, ours, theirs))
    return results
