"""What a bench row is: the variants measured on each model, and the figures of one row.

The variants are ac-core's registered policies plus two rows that are not ac-core policies: ``none`` (no
checkpointing, the reference every other row is compared with) and ``library`` (the model library's own
checkpointing, as a baseline). ``budget`` rows (not in ``all``) plan the memory-budget policy for each budget
asked for on the row's model and inputs (:mod:`ac_core.budget`), each compared with the best fixed row that
fits its budget (:func:`best_fixed`). ``step`` rows (``--memory``) plan a whole training step's peak on one rank
(a :class:`~ac_core.StepBudget`) twice per size, the recompute costed in predicted time and in FLOPs, so that the
two costs meet at an equal step budget in one run. With ``--subsets``, each fixed checkpointing policy is also
measured on each proper subset of a model's block containers (:func:`on_subsets`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from itertools import combinations
from typing import Any

from ..budget import MemoryBudget
from ..budget.solve import Cost
from ..offload import OffloadConfig
from ..policies import CheckpointType, PolicyConfig, policy_config, policy_traits, registered_policies
from ..units import human_bytes

NONE, LIBRARY, BUDGET, STEP = "none", "library", "budget", "step"
COSTS: tuple[Cost, ...] = ("time", "flops")  # a step row per size in each, in this order
# What a timed step's seconds are, by --clock. On a CPU shared with other processes, wall time counts the time this
# one waited for a core; the process's CPU time only the step's own work (all its threads': --threads 1, one core's).
CLOCKS = ("wall", "cpu")


def row_names() -> tuple[str, ...]:
    """What ``--policy`` chooses from, in the order rows run: ``none``, the registered policies, ``library``."""
    return (NONE, *registered_policies(), LIBRARY)


@dataclass(frozen=True)
class Variant:
    """How one row's model is set up: the policy, and whether activations leave the device.

    ``policy`` is a registered policy's config, or :data:`NONE` / :data:`LIBRARY`. ``offload`` is ac-core's
    activation offload (with ``none`` it runs without checkpointing); ``save_on_cpu`` is the synchronous
    baseline: ``full`` with torch's ``save_on_cpu(pin_memory=True)`` around the forward, as trainers that
    wrap it (FastVideo's seed) do. ``containers`` limits a policy to those block containers (FQNs); None:
    every container the adapter declares. A :data:`STEP` row plans for one rank's ``memory`` (bytes or a size) in
    ``cost``.
    """

    policy: PolicyConfig | str
    offload: OffloadConfig | None = None
    save_on_cpu: bool = False
    budget: MemoryBudget | None = None  # a BUDGET row's memory budget (fraction of none, bytes or size)
    containers: tuple[str, ...] | None = None
    memory: int | str | None = None  # a STEP row's step budget
    cost: Cost | None = None  # and what its plan minimises

    @property
    def name(self) -> str:
        return self.policy if isinstance(self.policy, str) else self.policy.name

    @property
    def fixed(self) -> bool:
        """``none`` or a registered policy, kept on the device: what a budget row is compared with."""
        return self.policy not in (LIBRARY, BUDGET, STEP) and self.offload is None and not self.save_on_cpu

    @property
    def label(self) -> str:
        if self.policy == BUDGET:
            return f"{BUDGET}({self.budget})"
        if self.policy == STEP:
            memory = human_bytes(self.memory, digits=2) if isinstance(self.memory, int) else self.memory
            return f"{STEP}({memory},{self.cost})"
        knob = None if isinstance(self.policy, str) else policy_traits(self.policy).n_layer_field
        base = f"{self.name}(n={getattr(self.policy, knob)})" if knob is not None else self.name
        where = f"[{','.join(self.containers)}]" if self.containers else ""
        return base + where + ("+offload" if self.offload else "") + ("+save_on_cpu" if self.save_on_cpu else "")


def _configs(name: str, n_layers: Sequence[int]) -> list[PolicyConfig | str]:
    # --n-layer sets the knob a policy's traits name (block_skip's every-n-th block; one row per n); every other
    # policy takes its defaults.
    if name not in registered_policies():
        return [name]
    if policy_traits(registered_policies()[name]).n_layer_field is not None:
        return [policy_config(name, n) for n in n_layers]
    return [policy_config(name)]


def variants(
    names: Sequence[str],
    n_layers: Sequence[int],
    offload: OffloadConfig | None = None,
    budgets: Sequence[MemoryBudget] = (),
    memories: Sequence[int | str] = (),
) -> list[Variant]:
    """The rows to measure for each model, ``none`` first (the reference every other row is compared with).

    ``block_skip`` gets one row per n of ``n_layers``. With ``offload``, each chosen row but ``library``
    gets a ``+offload`` row after it, and ``full`` (when chosen) a synchronous ``+save_on_cpu`` row, the
    baseline offload is measured against. With :data:`BUDGET` in ``names``, one row per budget of
    ``budgets`` comes next (without offload), and last, per step budget of ``memories``, a :data:`STEP` row in
    each of :data:`COSTS` (without offload).
    """
    rows: list[Variant] = []
    chosen = (NONE, *(n for n in row_names() if n in names and n != NONE))
    for policy in (config for name in chosen for config in _configs(name, n_layers)):
        rows.append(Variant(policy))
        if offload is not None and policy != LIBRARY:
            rows.append(Variant(policy, offload=offload))
        if offload is not None and not isinstance(policy, str) and policy.name == CheckpointType.FULL:
            rows.append(Variant(policy, save_on_cpu=True))
    if BUDGET in names:
        rows.extend(Variant(BUDGET, budget=budget) for budget in budgets)
    rows.extend(Variant(STEP, memory=memory, cost=cost) for memory in memories for cost in COSTS)
    return rows


def on_subsets(variants: Sequence[Variant], containers: Sequence[str]) -> list[Variant]:
    """``variants`` with, after each fixed checkpointing row, its policy on each proper non-empty subset of
    ``containers`` (a model's block containers); unchanged for a model of fewer than two containers."""
    subsets = [subset for size in range(1, len(containers)) for subset in combinations(containers, size)]
    rows: list[Variant] = []
    for variant in variants:
        rows.append(variant)
        if variant.fixed and variant.policy != NONE and variant.containers is None:
            rows.extend(replace(variant, containers=subset) for subset in subsets)
    return rows


@dataclass
class Row:
    """Every figure of one benchmark row; ``None`` where a figure does not apply (a skipped row)."""

    adapter: str
    model: str  # AdapterSpec.model_label: the class name, told apart where a class is declared twice
    policy: str | None
    label: str | None
    status: str  # "ok", "skipped" or "error"
    reason: str | None = None
    detail: str | None = None
    tokens: int | None = None
    loss: float | None = None
    activation_peak_bytes: int | None = None
    held_for_backward_bytes: int | None = None
    flops: int | None = None
    attention_flops: int | None = None
    recompute_overhead: float | None = None
    attention_forward_calls: int | None = None
    attention_recomputed: int | None = None
    step_time_s: float | None = None
    step_times_s: list[float] | None = None
    time_ratio: float | None = None
    grad_max_abs_diff: float | None = None
    grad_ok: bool | None = None
    # budget rows only: the budget in bytes, and what the plan predicted it holds for backward and recomputes
    budget_bytes: int | None = None
    predicted_held_bytes: int | None = None
    predicted_recompute_flops: int | None = None
    # step rows only: the step budget (one rank's memory) and what the plan minimised ("time" or "flops")
    step_memory_bytes: int | None = None
    cost: str | None = None
    # with --predict: the step-time overhead over none the roofline predicts (None: a row it does not predict)
    predicted_overhead: float | None = None
    # and the fixed row (none or a policy, on any containers) of least recompute whose measured held fits the budget
    best_fixed_label: str | None = None
    best_fixed_held_bytes: int | None = None
    best_fixed_recompute_overhead: float | None = None
    containers: list[str] | None = None  # the block containers a policy was limited to (None: all)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def best_fixed(budget_row: Row, fixed: Iterable[Row]) -> Row | None:
    """The measured row of ``fixed`` with the least recompute overhead (then the least held) whose measured
    held-for-backward bytes fit ``budget_row``'s budget; None when none fits."""
    budget = budget_row.budget_bytes
    if budget is None:
        return None
    fits = [
        row
        for row in fixed
        if row.status == "ok"
        and row.recompute_overhead is not None
        and row.held_for_backward_bytes is not None
        and row.held_for_backward_bytes <= budget
    ]
    # Both figures are set on every row that fits (the `or 0` only satisfies the type checker).
    return min(fits, key=lambda row: (row.recompute_overhead or 0.0, row.held_for_backward_bytes or 0), default=None)


def compare_with_best_fixed(budget_row: Row, fixed: Iterable[Row]) -> None:
    """Fill ``budget_row``'s best-fixed fields from :func:`best_fixed` (left None when no fixed row fits)."""
    best = best_fixed(budget_row, fixed)
    if best is not None:
        budget_row.best_fixed_label = best.label
        budget_row.best_fixed_held_bytes = best.held_for_backward_bytes
        budget_row.best_fixed_recompute_overhead = best.recompute_overhead


ROW_FIELDS = tuple(Row.__dataclass_fields__)
