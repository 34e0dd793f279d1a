"""How bench rows run: each model built once, each variant set up on it, measured, and undone."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from statistics import median
from typing import Any

import torch
from torch import nn

from .. import _chain
from ..blocks import resolve_blocks
from ..budget import CheckpointPlan, MemoryBudget, ModelProfile, plan_from_profile, profile_model
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
from ..policies import BlockMode
from ..spec import AdapterSpec, ModelCase, ModelSpec
from ._common import ac_core_logs_to, build_case, missing_library, stderr, version_status
from .rows import BUDGET, LIBRARY, NONE, Row, Variant, compare_with_best_fixed, on_subsets


class SkipRow(Exception):
    """A row that cannot run on this model, with the reason."""


class SaveOnCpu(_chain.ForwardLayer):
    """The model's forward under torch's ``save_on_cpu(pin_memory=True)``: the synchronous offload baseline."""

    kind = "bench_save_on_cpu"

    def forward(self, module: nn.Module, call_next: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            return call_next(*args, **kwargs)


class Planner:
    """Budget plans of one model at its inputs: the model profiled once (on its first plan), planned per budget."""

    def __init__(self, case: ModelCase, adapter: AdapterSpec) -> None:
        self.case, self.adapter = case, adapter
        self._profile: ModelProfile | None = None

    def __call__(self, budget: MemoryBudget) -> CheckpointPlan:
        if self._profile is None:
            blocks = resolve_blocks(self.case.model, self.adapter, None)
            self._profile = profile_model(blocks, dict(self.case.inputs))
        try:
            return plan_from_profile(self._profile, budget)
        except ValueError as exc:  # below the least any plan holds
            raise SkipRow(str(exc)) from None


def _modes(plan: CheckpointPlan) -> str:
    counts = {mode: sum(b.mode == mode for b in plan.blocks) for mode in BlockMode}
    return ", ".join(f"{n} {mode}" for mode, n in counts.items() if n)


def setup(variant: Variant, model: nn.Module, adapter: AdapterSpec, plan: CheckpointPlan | None = None) -> str:
    """Set ``model`` up for ``variant``; returns what was done, in words. Raises SkipRow if it cannot.

    A :data:`BUDGET` row applies ``plan`` (made by a :class:`Planner` for the row's budget).
    """
    if variant.policy == BUDGET:
        if plan is None:
            raise ValueError("a budget row needs its plan")
        apply_activation_checkpointing(model, plan, adapter=adapter)
        return f"budget plan: {_modes(plan)} blocks"
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


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a row's steps are timed, back on after.

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


@dataclass(frozen=True)
class Settings:
    """What every row of a run shares: the models' preset and size, where they run, and the steps measured.

    ``subsets``: also measure each fixed checkpointing policy on each proper subset of a model's containers.
    """

    preset: str
    layers: int | None
    seq: int | None
    device: torch.device
    dtype: torch.dtype
    steps: int
    warmup: int
    subsets: bool = False

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


def model_rows(
    adapter: AdapterSpec,
    model: ModelSpec,
    variants: Sequence[Variant],
    settings: Settings,
    advance: Callable[[int], None],
    add_steps: Callable[[int], None] = lambda n: None,
) -> list[Row]:
    """Build one model and measure every variant on it, 'none' first; then compare each budget row with the
    best fixed row that fits its budget.

    With ``settings.subsets`` the variants grow by :func:`.rows.on_subsets` once the model's containers are
    known; ``add_steps(n)`` is told the steps that adds (a progress bar's total).
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
        # neither as activations nor in the first row's time; each row's timed steps then follow its measured
        # step, which warms up its own path (and the plain model's when --warmup is 0).
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
    attention_ops = DEFAULT_RETAINED_OPS | adapter.retained_ops()
    rows: list[Row] = []
    reference: tuple[StepMeasurement, float] | None = None
    planner = Planner(case, adapter)
    for variant in variants:
        row = Row(adapter.name, label, variant.name, variant.label, "ok", tokens=tokens)
        row.containers = list(variant.containers) if variant.containers else None
        rows.append(row)
        done = 0

        def step_done() -> None:
            nonlocal done
            done += 1
            advance(1)

        try:
            plan = None
            if variant.policy == BUDGET:
                assert variant.budget is not None
                plan = planner(variant.budget)
                row.budget_bytes = plan.budget_bytes
                row.predicted_held_bytes = plan.held_bytes
                row.predicted_recompute_flops = plan.recompute_flops
            row.detail = setup(variant, case.model, adapter, plan)
            # Only the reference keeps a copy of its gradients; each later row's are compared in place.
            measured = measure_step(case, attention_ops, keep_grads=reference is None)
            reference_grads = measured.grads if reference is None else reference[0].grads
            check = compare_grads(_grads(case.model), reference_grads)
            step_done()
            with _collector_paused():
                times = time_steps(case, settings.steps, on_step=step_done)
        except SkipRow as exc:
            row.status, row.reason = "skipped", str(exc)
            continue
        except Exception as exc:
            # The library's own checkpointing is the baseline shown, not ac-core: where it cannot run this model
            # (WanAnimate2's blocks take keywords diffusers' checkpoint function refuses) the row says so.
            failed = variant.policy == LIBRARY
            row.status = "skipped" if failed else "error"
            row.reason = (
                f"{row.detail or 'the library checkpointing'} fails on this model: {exc!r}" if failed else repr(exc)
            )
            continue
        finally:
            advance(1 + settings.steps - done)
            teardown(variant, case.model)
        if reference is None and variant.policy == NONE:  # the first 'none' row (not none+offload)
            reference = (measured, median(times))
        _fill(row, measured, times, reference, check)
    _compare_budgets(variants, rows)
    return rows


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
