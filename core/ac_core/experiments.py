"""Experiments on the compiled route, built from the measurements: each route side by side (``ac-core compare``),
ac-core's memory-budget plans against torch's ``activation_memory_budget`` (``ac-core compare --budget``), and both
frontiers of saved bytes against recompute at equal saved bytes (``ac-core compare --frontier``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .blocks import resolve_blocks
from .budget import (
    Budget,
    CheckpointPlan,
    MemoryBudget,
    ModelProfile,
    OpOccurrence,
    plan_activation_checkpointing,
    plan_from_profile,
    profile_model,
)
from .budget.checkpoint_plan import COMPILE_OUTSIDE
from .budget.devices import Device
from .budget.planner import DeviceLike, named_containers, resolve_device
from .budget.roofline import op_time
from .checkpointing import apply_activation_checkpointing
from .measure.captured import route_measurer
from .measure.compiled import CompiledActivations, compiled_activations, with_and_without_pass
from .policies import Full, GraphDecisions, GraphRequest, Ops, graph_decisions
from .spec import ModelCase
from .units import human_bytes

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


def frontier_fractions(points: int) -> tuple[float, ...]:
    """Where a frontier of ``points`` samples torch's ``activation_memory_budget``: evenly over [0.1, 0.9] (one
    point: 0.5)."""
    if points < 1:
        raise ValueError(f"a frontier needs at least one point, got {points}")
    if points == 1:
        return (0.5,)
    return tuple(round(0.1 + 0.8 * i / (points - 1), 6) for i in range(points))


# The compiled layouts a frontier fits plans in (CheckpointPlan's compile_outside, compile_free and
# compile_block_inputs): the code outside the blocks held or recomputed whole, and either the block inputs held
# with the ops without FLOPs at fewest bytes or by torch's rules, or the block inputs recomputable too (at fewest
# bytes: torch's rules spend bytes for time, recomputable inputs spend FLOPs for bytes).
_LAYOUTS = tuple(
    (outside, free, inputs)
    for outside in COMPILE_OUTSIDE
    for free, inputs in (("fewest_bytes", "held"), ("torch_rules", "held"), ("fewest_bytes", "recomputable"))
)

# Budgets tried per point to land ac-core's compiled bytes within torch's (see _Fitter.fit): a grid, then halvings
# of the gap after the best, down to _CLOSE bytes.
_GRID = 6
_HALVINGS = 3
_CLOSE = 2**16


@dataclass(frozen=True)
class FrontierPoint:
    """One point of both frontiers: torch's ``activation_memory_budget`` at ``fraction`` (measured: ``torch``), and
    ac-core's plan at the bytes torch saved there (``plan``, measured: ``ours``, within those bytes, as
    ``ac_core.compile(model, plan)`` compiles it: the plan carries its layout), or None with the reason in
    ``refused``. With a device, ``torch_seconds`` and ``ours_seconds`` are the roofline's predicted seconds of what
    each backward recomputes."""

    fraction: float
    torch: CompiledActivations
    plan: CheckpointPlan | None = None
    ours: CompiledActivations | None = None
    refused: str | None = None
    torch_seconds: float | None = None
    ours_seconds: float | None = None

    @property
    def outside_recomputed(self) -> bool:
        """Whether ac-core's step recomputes the code outside the blocks whole (the plan's ``compile_outside``)
        rather than holding its matmuls' outputs."""
        return self.plan is not None and self.plan.compile_outside == "recomputed"

    @property
    def flops_ratio(self) -> float | None:
        """ac-core's recompute FLOPs over torch's (at most 1: at or below torch's frontier); 1.0 where neither
        recomputes any; None without a plan or where only ac-core recomputes."""
        return _ratio(None if self.ours is None else self.ours.recompute_flops, self.torch.recompute_flops)

    @property
    def seconds_ratio(self) -> float | None:
        """The same for the predicted recompute seconds (None without a device)."""
        return _ratio(self.ours_seconds, self.torch_seconds)


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    if ours is None or theirs is None:
        return None
    if not theirs:
        return 1.0 if not ours else None
    return ours / theirs


@dataclass(frozen=True)
class Frontier:
    """Both frontiers on one model (:func:`compare_frontier`), points in the order of torch's fractions.
    ``least_bytes``: what ac-core's least plan (every block recomputed whole, and the code outside them) saves on
    this route; ``cost`` and
    ``device`` (its name): what ac-core's plans minimised and where; ``backend``: the compiler."""

    points: tuple[FrontierPoint, ...]
    least_bytes: int
    cost: str
    device: str | None
    backend: str


def _priced(measured: CompiledActivations, device: Device) -> float:
    """Predicted seconds on ``device`` of what a compiled backward recomputes: each op's roofline."""
    return sum(
        op_time(OpOccurrence(op.op, 0, 0, op.flops, op.bytes_moved, op.dtype), device).seconds
        for op in measured.recomputed_ops
    )


class _Fitter:
    """ac-core's plans on the compile route at a target of saved bytes: ``profile`` with its fixed part as the
    route compiles it, each plan measured by ``measure`` (once per distinct plan)."""

    def __init__(
        self,
        profile: ModelProfile,
        plan: Callable[[ModelProfile, int], CheckpointPlan],
        measure: Callable[[CheckpointPlan], CompiledActivations],
        device: Device | None,
    ) -> None:
        self.plan = plan
        self.measure_plan = measure
        self.device = device
        self.seen: dict[tuple, CompiledActivations] = {}
        least = self.least_plan = plan(profile, profile.min_bytes + profile.routing_bytes)
        self.least = self.measure(least)
        # What the route saves beyond the eager profile's prediction once every block is recomputed: block inputs
        # and the code outside the blocks, which the partitioner lays out its own way.
        offset = self.least.saved_bytes - least.held_bytes
        self.profile = dataclasses.replace(profile, full_bytes=profile.min_bytes + offset)

    def measure(self, plan: CheckpointPlan) -> CompiledActivations:
        key = tuple((b.path, b.mode, b.keep) for b in plan.blocks)
        if key not in self.seen:
            self.seen[key] = self.measure_plan(plan)
        return self.seen[key]

    def cost(self, measured: CompiledActivations) -> float:
        return measured.recompute_flops if self.device is None else _priced(measured, self.device)

    def fit(self, target: int) -> tuple[CheckpointPlan, CompiledActivations] | str:
        """The plan recomputing least, of those tried, whose compiled step saves at most ``target`` bytes, or why
        there is none.

        A plan may compile to fewer bytes than it predicts (a block input summed from kept outputs is not held; see
        :func:`~ac_core.apply_sac_pass`), at most what the least plan saves, so budgets from ``target`` up to
        ``target`` plus that are tried on a grid (below ``target`` by the excess where none fit), then halved between
        the best that fit and the next that did not.
        """
        if target < self.least.saved_bytes:
            return (
                f"torch saves {human_bytes(target, digits=2)} here, less than ac-core's least plan saves on this "
                f"route ({human_bytes(self.least.saved_bytes, digits=2)}: every block recomputed whole, "
                f"{_least_holds(self.least_plan)})"
            )
        tried: dict[int, CompiledActivations] = {}
        best: tuple[tuple[float, int], int, CheckpointPlan, CompiledActivations] | None = None

        def attempt(budget: int) -> None:
            nonlocal best
            plan = self.plan(self.profile, budget)
            measured = tried[budget] = self.measure(plan)
            score = (self.cost(measured), measured.saved_bytes)
            if measured.saved_bytes <= target and (best is None or score < best[0]):
                best = (score, budget, plan, measured)

        span = self.least.saved_bytes
        for i in range(_GRID):
            attempt(target + span * i // (_GRID - 1))
        for _ in range(_HALVINGS):  # every plan compiled to more than it predicted: lower the budget by the excess
            if best is not None:
                break
            lowest = min(tried)
            attempt(max(self.least.saved_bytes, lowest - (tried[lowest].saved_bytes - target)))
        for _ in range(_HALVINGS):
            if best is None:
                break
            above = [b for b in sorted(tried) if b > best[1]]
            if not above or above[0] - best[1] <= _CLOSE:
                break
            attempt((best[1] + above[0]) // 2)
        if best is None:
            return f"every plan tried compiled to more than torch's {human_bytes(target, digits=2)}"
        return best[2], best[3]


def _least_holds(plan: CheckpointPlan) -> str:
    """What a plan recomputing every block whole still saves, in words, by its compiled layout."""
    held = ["each block's inputs"] if plan.compile_block_inputs == "held" else []
    if plan.compile_outside == "held":
        held.append("the matmuls, convolutions and attention outside the blocks")
    return f"{' and '.join(held)} saved" if held else "what backward needs saved at the partitioner's fewest bytes"


def compare_frontier(
    make_case: Callable[[], ModelCase],
    fractions: Sequence[float],
    *,
    adapter: Any = None,
    blocks: Sequence[str] | None = None,
    backend: str = "aot_eager",
    device: DeviceLike | None = None,
) -> Frontier:
    """torch's ``activation_memory_budget`` at each of ``fractions`` and ac-core's plan at the bytes torch saved
    there, on the graph route of the model ``make_case`` builds (the same model each call), measured side by side.

    One profile serves every plan and, on ``aot_eager``, one captured step every measurement (see
    :func:`~ac_core.measure.captured.route_measurer`). ac-core's plans count what the compiled step saves (what
    recomputes without FLOPs left to the partitioner, see :class:`~ac_core.GraphDecisions`), in six of the
    plan's compiled layouts (see ``_LAYOUTS``): the code outside the blocks held or recomputed whole; the ops
    without FLOPs at fewest bytes or by torch's rules; the block inputs held or recomputable. Per layout, the
    profile's fixed part (block inputs, the code outside the blocks) is what its compiled least plan saves, every
    block recomputed. Each point's plans are made at budgets from torch's bytes up (at most a dozen per layout,
    see ``_Fitter.fit``), and the least recompute whose compiled step saves no more than torch's is kept, with
    its layout. With ``device`` (a name such as ``"h100"``, or a :class:`~ac_core.budget.devices.Device`), plans
    minimise the roofline's predicted recompute seconds there (``cost="time"``) and both sides' recomputes are
    priced on it; else FLOPs.
    """
    case = make_case()
    resolved = resolve_blocks(case.model, adapter, blocks)
    profile = profile_model(resolved, dict(case.inputs))
    where = None if device is None else resolve_device(device)
    cost = "flops" if where is None else "time"
    containers = named_containers(resolved)
    request = GraphRequest(case.model, adapter, blocks)
    measure = route_measurer(make_case, adapter=adapter, blocks=blocks, backend=backend)

    def planner(layout: tuple[str, str, str]) -> Callable[[ModelProfile, int], CheckpointPlan]:
        outside, free, inputs = layout

        def plan(model_profile: ModelProfile, budget: int) -> CheckpointPlan:
            made = plan_from_profile(model_profile, budget, containers=containers, cost=cost, device=where, quiet=True)
            return dataclasses.replace(made, compile_outside=outside, compile_free=free, compile_block_inputs=inputs)

        return plan

    def planned(p: CheckpointPlan) -> CompiledActivations:
        return measure(graph_decisions(p, request))

    layouts = list(_LAYOUTS)
    fitters = {layout: _Fitter(profile, planner(layout), planned, where) for layout in layouts}
    points = []
    for fraction in fractions:
        theirs = measure(GraphDecisions(torch_budget=fraction))
        fits = {layout: fitter.fit(theirs.saved_bytes) for layout, fitter in fitters.items()}
        found = [f for f in fits.values() if not isinstance(f, str)]
        if not found:
            tightest = min(layouts, key=lambda layout: fitters[layout].least.saved_bytes)  # why the least can't
            points.append(
                FrontierPoint(fraction, theirs, refused=str(fits[tightest]), torch_seconds=_seconds(theirs, where))
            )
            continue
        # Least recompute, then fewest bytes; ties go to the first layout (the default one).
        chosen, ours = min(found, key=lambda fit: (fitters[layouts[0]].cost(fit[1]), fit[1].saved_bytes))
        points.append(
            FrontierPoint(
                fraction,
                theirs,
                plan=chosen,
                ours=ours,
                torch_seconds=_seconds(theirs, where),
                ours_seconds=_seconds(ours, where),
            )
        )
    least = min(fitter.least.saved_bytes for fitter in fitters.values())
    return Frontier(tuple(points), least, cost, None if where is None else where.name, backend)


def _seconds(measured: CompiledActivations, device: Device | None) -> float | None:
    return None if device is None else _priced(measured, device)
