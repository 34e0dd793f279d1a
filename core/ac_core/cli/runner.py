"""How bench rows run: each model built once, each variant set up on it, measured, and undone; then every
variant timed, interleaved, one step each per round."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from statistics import median
from typing import Any

import torch
from torch import nn

from .. import _chain
from ..blocks import resolve_blocks
from ..budget import CheckpointPlan, ModelProfile, StepBudget, StepPlanner, plan_from_profile, profile_model
from ..budget.devices import Device
from ..budget.solve import none_step_seconds, recompute_seconds
from ..checkpointing import apply_activation_checkpointing, checkpointed_blocks, remove_activation_checkpointing
from ..libraries.checkpointing import (
    SWITCHES,
    disable_library_checkpointing,
    enable_library_checkpointing,
    library_switch,
)
from ..measure import GradCheck, StepMeasurement, compare_grads, measure_step, time_steps
from ..offload import apply_activation_offload
from ..ops import DEFAULT_RETAINED_OPS
from ..policies import BlockDecision, BlockMode, PolicyConfig, select
from ..spec import AdapterSpec, ModelCase, ModelSpec
from ._common import ac_core_logs_to, build_case, missing_library, stderr, version_status
from .rows import BUDGET, LIBRARY, NONE, STEP, Row, Variant, compare_with_best_fixed, on_subsets

logger = logging.getLogger("ac_core")


class SkipRow(Exception):
    """A row that cannot run on this model, with the reason."""


class SaveOnCpu(_chain.ForwardLayer):
    """The model's forward under torch's ``save_on_cpu(pin_memory=True)``: the synchronous offload baseline."""

    kind = "bench_save_on_cpu"

    def forward(self, module: nn.Module, call_next: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            return call_next(*args, **kwargs)


class Planner:
    """What one model's budget and step rows plan, and what ``--predict`` prices, at its inputs: the model profiled
    once (on the first need), a step budget's facts once (its memory aside, every step row's are the same): one
    :class:`~ac_core.budget.StepPlanner`, made for the first step row and sharing the profile."""

    def __init__(self, case: ModelCase, adapter: AdapterSpec, settings: Settings) -> None:
        self.case, self.adapter, self.settings = case, adapter, settings
        self._profile: ModelProfile | None = None  # until a step row makes the StepPlanner, which then keeps it
        self._steps: StepPlanner | None = None

    @property
    def profile(self) -> ModelProfile:
        if self._steps is not None:
            return self._steps.profile
        if self._profile is None:
            self._profile = profile_model(resolve_blocks(self.case.model, self.adapter, None), dict(self.case.inputs))
        return self._profile

    def step_budget(self, memory: int | str) -> StepBudget:
        """A step budget of one rank for the case's step: its own loss, the run's optimizer updating as on its
        device."""
        settings = self.settings
        return StepBudget(memory, device=settings.device.type, optimizer=settings.optimizer, loss=self.case.loss)

    def _step_planner(self, memory: int | str) -> StepPlanner:
        if self._steps is None:
            blocks = resolve_blocks(self.case.model, self.adapter, None)
            budget = self.step_budget(memory)
            device = self.settings.step_device
            self._steps = StepPlanner(blocks, dict(self.case.inputs), budget, device=device, profile=self._profile)
        return self._steps

    def __call__(self, variant: Variant) -> CheckpointPlan:
        """The plan of a :data:`BUDGET` or :data:`STEP` row; SkipRow where no plan fits."""
        try:
            if variant.policy == STEP:
                assert variant.memory is not None and variant.cost is not None
                return self._step_planner(variant.memory).plan(variant.memory, cost=variant.cost)
            # FLOP-costed as without --predict (the same plan); with it, the plan's seconds predicted there too.
            return plan_from_profile(self.profile, variant.budget, cost="flops", device=self.settings.predict)
        except ValueError as exc:  # below the least any plan holds
            raise SkipRow(str(exc)) from None

    def overhead(self, variant: Variant, plan: CheckpointPlan | None) -> float | None:
        """The roofline's step-time overhead over ``none`` on ``--predict``'s device: a plan's own; a fixed
        policy's from what its selections recompute, block by block; None for a row it does not model (the
        library's checkpointing, offload)."""
        device = self.settings.predict
        if device is None:
            return None
        if plan is not None:
            return plan.overhead
        if not variant.fixed:
            return None
        if variant.policy == NONE:
            return 0.0
        assert isinstance(variant.policy, PolicyConfig)  # a fixed row other than none
        containers = list(variant.containers) if variant.containers else None
        with _unchecked_on_purpose() if containers else nullcontext():
            selections = select(variant.policy, resolve_blocks(self.case.model, self.adapter, containers))
        if any(s.layer is not None for s in selections):
            return None  # a checkpoint layer of the policy's own: what it recomputes is its own
        decisions = [
            BlockDecision(s.block.path, s.kind, retain=s.retained)
            if s.kind == BlockMode.OPS and s.retained
            else BlockDecision(s.block.path, BlockMode.FULL)
            for s in selections
        ]
        none = none_step_seconds(self.profile, device)
        return recompute_seconds(self.profile, decisions, device) / none if none else None


def _modes(plan: CheckpointPlan) -> str:
    counts = {mode: sum(b.mode == mode for b in plan.blocks) for mode in BlockMode}
    return ", ".join(f"{n} {mode}" for mode, n in counts.items() if n)


def setup(variant: Variant, model: nn.Module, adapter: AdapterSpec, plan: CheckpointPlan | None = None) -> str:
    """Set ``model`` up for ``variant``; returns what was done, in words. Raises SkipRow if it cannot.

    A :data:`BUDGET` or :data:`STEP` row applies ``plan`` (made by a :class:`Planner` for the row's budget).
    """
    if variant.policy in (BUDGET, STEP):
        if plan is None:
            raise ValueError(f"a {variant.policy} row needs its plan")
        apply_activation_checkpointing(model, plan, adapter=adapter)
        return f"{variant.policy} plan: {_modes(plan)} blocks"
    if variant.policy == NONE:
        if variant.offload is None:
            return "no checkpointing"
        apply_activation_offload(model, variant.offload, adapter=adapter)
        return f"no checkpointing, offload from {variant.offload.min_tokens} tokens"
    if variant.policy == LIBRARY:
        switch = library_switch(model)
        if switch is None:
            names = ", ".join(f"{enable}()" for enable, _ in SWITCHES)
            raise SkipRow(f"{type(model).__name__} has no library checkpointing ({names})")
        try:
            enable_library_checkpointing(model)
        except (ValueError, NotImplementedError) as exc:
            raise SkipRow(f"{switch[0]}() refused: {exc}") from None
        return f"{switch[0]}()"
    if variant.save_on_cpu:
        device = next(model.parameters()).device
        if device.type != "cuda":
            raise SkipRow(f"save_on_cpu(pin_memory=True) needs CUDA (the model is on {device.type})")
        apply_activation_checkpointing(model, variant.policy, adapter=adapter)
        _chain.add(model, SaveOnCpu())
        return f"{len(checkpointed_blocks(model))} blocks checkpointed, forward under save_on_cpu"
    blocks = list(variant.containers) if variant.containers else None
    with _unchecked_on_purpose() if blocks else nullcontext():
        apply_activation_checkpointing(model, variant.policy, adapter=adapter, blocks=blocks, offload=variant.offload)
    where = f" in {', '.join(variant.containers)}" if variant.containers else ""
    offloaded = f", offload from {variant.offload.min_tokens} tokens" if variant.offload else ""
    return f"{len(checkpointed_blocks(model))} blocks checkpointed{where}{offloaded}"


class _UncheckedContainers(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "has blocks outside every container" not in str(record.msg)


@contextmanager
def _unchecked_on_purpose() -> Iterator[None]:
    """Drop apply's warning about containers it leaves unchecked: a subset row leaves them so on purpose."""
    logger, dropped = logging.getLogger("ac_core"), _UncheckedContainers()
    logger.addFilter(dropped)
    try:
        yield
    finally:
        logger.removeFilter(dropped)


class _Dropped(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


@contextmanager
def _ac_core_logs_dropped() -> Iterator[None]:
    """No ac-core log message within the block (a row set up again for a timed step: said at its first set-up)."""
    logger, dropped = logging.getLogger("ac_core"), _Dropped()
    logger.addFilter(dropped)
    try:
        yield
    finally:
        logger.removeFilter(dropped)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a row's step is timed, back on after (a collection then runs
    untimed, where one is due).

    With the model libraries imported a full collection takes 170-450 ms here: landing in one step of a tiny
    model, it reads as that row being twenty times slower than its sibling.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def teardown(variant: Variant, model: nn.Module) -> None:
    """Undo :func:`setup`, leaving ``model`` plain for the next row."""
    if variant.policy == LIBRARY:
        disable_library_checkpointing(model, level=None)
        return
    _chain.remove(model, SaveOnCpu.kind)
    remove_activation_checkpointing(model)  # removes offload too


def _step_seconds(case: ModelCase, clock: str) -> float:
    """One timed step of ``case`` on ``clock`` (one of :data:`.rows.CLOCKS`)."""
    if clock == "wall":
        return time_steps(case, 1)[0]
    start = time.process_time()
    time_steps(case, 1)
    return time.process_time() - start


@dataclass(frozen=True)
class Settings:
    """What every row of a run shares: the models' preset and size, where they run, and the steps measured.

    ``subsets``: also measure each fixed checkpointing policy on each proper subset of a model's containers.
    ``predict``: the device each row's step-time overhead is predicted on (``--predict``); ``step_device``: the
    one step rows are costed on in time (``--predict``'s, else the run's device's figures). ``clock``: what a
    timed step's seconds are (:data:`.rows.CLOCKS`); ``optimizer``: whose state step rows' budgets count.
    """

    preset: str
    layers: int | None
    seq: int | None
    device: torch.device
    dtype: torch.dtype
    steps: int
    warmup: int
    subsets: bool = False
    predict: Device | None = None  # --predict: each row's overhead predicted on it
    step_device: Device | None = None  # what step rows' time-costed plans are costed on (None: StepPlanner's)
    clock: str = "wall"  # or "cpu": the process's CPU time per step (see _step_seconds)
    optimizer: str = "adamw"  # whose state step rows' budgets count

    def steps_per_model(self, rows: int) -> int:
        """Forward+backward passes one model costs: warm-up once, then per row one measured step and the timed."""
        return self.warmup + rows * (1 + self.steps)


def build(model: ModelSpec, settings: Settings) -> ModelCase:
    """``model`` at the run's preset, on its device, in training mode."""
    case = build_case(model, settings.preset, layers=settings.layers, seq=settings.seq)
    current = next((p.dtype for p in case.model.parameters() if p.is_floating_point()), settings.dtype)
    # Cast only a model built in another dtype: diffusers warns on any dtype passed to .to().
    case.to(settings.device, settings.dtype if settings.dtype != current else None)
    case.model.train()
    return case


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    # The step's gradients in place: a copy of every row's would cost a model's worth of memory at real width.
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _fill(
    row: Row,
    measured: StepMeasurement,
    times: list[float],
    reference: tuple[StepMeasurement, float] | None,
    check: GradCheck,
) -> None:
    row.loss = measured.loss
    row.activation_peak_bytes = measured.activation_peak_bytes
    row.held_for_backward_bytes = measured.held_for_backward_bytes
    row.flops = measured.flops
    row.attention_flops = measured.attention_flops
    row.attention_forward_calls = measured.attention_forward_calls
    row.attention_recomputed = measured.attention_recomputed
    row.step_times_s = times
    row.step_time_s = median(times)
    if reference is None:  # 'none' failed: nothing to compare with
        return
    ref_step, ref_time = reference
    row.recompute_overhead = measured.flops / ref_step.flops - 1 if ref_step.flops else None
    row.time_ratio = row.step_time_s / ref_time if ref_time else None
    row.grad_max_abs_diff, row.grad_ok = check.max_abs_diff, check.ok


@dataclass
class _Ready:
    """A row whose measured step ran: what set it up again for each timed step, what was measured, its times."""

    row: Row
    variant: Variant
    plan: CheckpointPlan | None
    measured: StepMeasurement
    check: GradCheck
    times: list[float] = field(default_factory=list)


def model_rows(
    adapter: AdapterSpec,
    model: ModelSpec,
    variants: Sequence[Variant],
    settings: Settings,
    advance: Callable[[int], None],
    add_steps: Callable[[int], None] = lambda n: None,
) -> list[Row]:
    """Build one model and measure every variant on it, 'none' first; then time them all, interleaved; then
    compare each budget row with the best fixed row that fits its budget.

    Each row is set up, its step measured (memory, FLOPs, gradients against none's) and undone, row after row.
    Then the timed steps run round-robin: per round every measured row is set up again, runs one step and is
    undone, so that a machine's drift (another process, the clock) lands on every row alike; each row's step
    time is the median of its rounds. With ``settings.subsets`` the variants grow by :func:`.rows.on_subsets`
    once the model's containers are known; ``add_steps(n)`` is told the steps that adds (a progress bar's total).
    """
    label = adapter.model_label(model)
    per_model = settings.steps_per_model(len(variants))
    missing = missing_library(adapter)
    if missing:
        advance(per_model)
        return [Row(adapter.name, label, None, None, "skipped", missing)]
    supported, installed = version_status(model)
    if not supported:
        advance(per_model)
        reason = f"installed {installed or 'nothing'}, adapter declares {model.versions}: {adapter.install_hint}"
        return [Row(adapter.name, label, None, None, "skipped", reason)]
    try:
        case = build(model, settings)
        # Warm up plain, so that lazily built state (caches, allocator pools, first-call costs) is counted
        # neither as activations nor in the first row's time; each row's measured step then runs before any
        # timed one, which warms up its own path (and the plain model's when --warmup is 0).
        if settings.warmup:
            time_steps(case, settings.warmup, on_step=lambda: advance(1))
    except Exception as exc:
        advance(per_model)
        return [Row(adapter.name, label, None, None, "error", f"building the model failed: {exc!r}")]
    if settings.subsets:
        containers = [container.path for container in resolve_blocks(case.model, adapter, None).containers]
        grown = on_subsets(variants, containers)
        add_steps(settings.steps_per_model(len(grown)) - settings.steps_per_model(len(variants)))
        variants = grown
    tokens = adapter.token_count(case.model, case.inputs) if adapter.token_count else None
    planner = Planner(case, adapter, settings)
    rows, ready = _measured_rows(adapter, case, variants, settings, planner, tokens, label, advance)
    _timed_rounds(adapter, case, ready, settings, advance)
    none = next((r for r in ready if r.variant.policy == NONE and r.row.status == "ok"), None)
    reference = (none.measured, median(none.times)) if none is not None else None
    for entry in ready:
        if entry.row.status == "ok":
            _fill(entry.row, entry.measured, entry.times, reference, entry.check)
    _compare_budgets(variants, rows)
    return rows


def _measured_rows(
    adapter: AdapterSpec,
    case: ModelCase,
    variants: Sequence[Variant],
    settings: Settings,
    planner: Planner,
    tokens: int | None,
    label: str,
    advance: Callable[[int], None],
) -> tuple[list[Row], list[_Ready]]:
    """Every variant's row, each set up, its step measured and undone; and those ready to be timed."""
    attention_ops = DEFAULT_RETAINED_OPS | adapter.retained_ops()
    rows: list[Row] = []
    ready: list[_Ready] = []
    reference: StepMeasurement | None = None  # the first 'none' row's (not none+offload): its gradients
    for variant in variants:
        row = Row(adapter.name, label, variant.name, variant.label, "ok", tokens=tokens)
        row.containers = list(variant.containers) if variant.containers else None
        rows.append(row)
        try:
            plan = planner(variant) if variant.policy in (BUDGET, STEP) else None
            if plan is not None:
                _fill_plan(row, variant, plan, planner)
            row.detail = setup(variant, case.model, adapter, plan)
            # Only the reference keeps a copy of its gradients; each later row's are compared in place.
            measured = measure_step(case, attention_ops, keep_grads=reference is None)
            reference_grads = measured.grads if reference is None else reference.grads
            check = compare_grads(_grads(case.model), reference_grads)
        except SkipRow as exc:
            row.status, row.reason = "skipped", str(exc)
            advance(1 + settings.steps)
            continue
        except Exception as exc:
            # The library's own checkpointing is the baseline shown, not ac-core: where it cannot run this model
            # (WanAnimate2's blocks take keywords diffusers' checkpoint function refuses) the row says so.
            failed = variant.policy == LIBRARY
            row.status = "skipped" if failed else "error"
            row.reason = (
                f"{row.detail or 'the library checkpointing'} fails on this model: {exc!r}" if failed else repr(exc)
            )
            advance(1 + settings.steps)
            continue
        finally:
            teardown(variant, case.model)
        advance(1)
        if reference is None and variant.policy == NONE:
            reference = measured
        row.predicted_overhead = _predicted(planner, variant, plan, row)
        ready.append(_Ready(row, variant, plan, measured, check))
    return rows, ready


def _predicted(planner: Planner, variant: Variant, plan: CheckpointPlan | None, row: Row) -> float | None:
    """:meth:`Planner.overhead`, or None where the model cannot be profiled, with a warning naming why (the row is
    measured all the same)."""
    try:
        return planner.overhead(variant, plan)
    except ValueError as exc:
        logger.warning("ac-core bench: no predicted overhead for %s %s %s: %s", row.adapter, row.model, row.label, exc)
        return None


def _fill_plan(row: Row, variant: Variant, plan: CheckpointPlan, planner: Planner) -> None:
    row.predicted_held_bytes = plan.held_bytes
    row.predicted_recompute_flops = plan.recompute_flops
    if variant.policy == BUDGET:
        row.budget_bytes = plan.budget_bytes
    else:
        assert variant.memory is not None
        row.step_memory_bytes = planner.step_budget(variant.memory).nbytes
        row.cost = plan.cost


def _timed_rounds(
    adapter: AdapterSpec, case: ModelCase, ready: list[_Ready], settings: Settings, advance: Callable[[int], None]
) -> None:
    """``settings.steps`` rounds, each one timed step of every row in ``ready``, in order, set up again for it
    (its set-up already said what it had to: its log messages are not repeated) and undone after; the collector
    paused while a step is timed. A row whose timed step fails is an error and leaves the rounds."""
    timing = list(ready)
    for _ in range(settings.steps):
        for entry in list(timing):
            try:
                with _ac_core_logs_dropped():
                    setup(entry.variant, case.model, adapter, entry.plan)
                with _collector_paused():
                    entry.times.append(_step_seconds(case, settings.clock))
                advance(1)
            except Exception as exc:
                entry.row.status, entry.row.reason = "error", f"a timed step failed: {exc!r}"
                advance(settings.steps - len(entry.times))
                timing.remove(entry)
            finally:
                teardown(entry.variant, case.model)


def _compare_budgets(variants: Sequence[Variant], rows: Sequence[Row]) -> None:
    """Fill each budget row's best fixed row that fits, from one model's rows."""
    fixed = [row for variant, row in zip(variants, rows, strict=True) if variant.fixed]
    for row in rows:
        if row.policy == BUDGET:
            compare_with_best_fixed(row, fixed)


def run_rows(
    selected: Sequence[tuple[AdapterSpec, Sequence[ModelSpec]]], variants: Sequence[Variant], settings: Settings
) -> list[Row]:
    """Every variant on every model of ``selected``, behind a progress bar on a terminal's stderr, gone once done."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    total = sum(len(models) for _, models in selected) * settings.steps_per_model(len(variants))
    rows: list[Row] = []
    err = stderr()
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,  # a log file gets no bar (rich would leave a blank line there)
    )
    with progress, ac_core_logs_to(err):
        task = progress.add_task("steps", total=total)

        def add_steps(n: int) -> None:
            nonlocal total
            total += n
            progress.update(task, total=total)

        for adapter, models in selected:
            for model in models:
                progress.update(task, description=f"{adapter.name} {adapter.model_label(model)}")
                rows.extend(model_rows(adapter, model, variants, settings, partial(progress.advance, task), add_steps))
    return rows
