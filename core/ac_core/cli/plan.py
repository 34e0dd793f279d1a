"""``ac-core plan``: the memory-budget plan of an adapter's model at a preset, made on the ``meta`` device.

The model and its inputs are built under ``torch.device("meta")``: nothing is allocated, so a model far larger
than this machine's memory (Wan2.1-14B, 40 blocks, 81 frames of 720p) is planned from shapes, FLOPs and bytes.
The per-block table is printed; ``--json`` writes the plan, which ``CheckpointPlan.from_json`` loads back.
``--frames/--height/--width`` give the sequence as a video in pixels (the model's VAE and patch factors turn it
into tokens) and ``--cp`` divides it over context-parallel ranks (an adapter declaring context parallelism: rank 0
planned with its collectives on stand-in ranks, :mod:`.context_parallel`). ``--memory``/``--gpu`` with ``--fsdp`` and
``--optimizer`` plan for a :class:`~ac_core.StepBudget` (a whole step's peak on one rank) instead of ``--budget``:
the peak's parts are printed, and what an eighth less and more memory would cost.
``--offload`` lets the plan move checkpointed blocks' inputs to host memory (offload's default settings), as a
GPU run of the plan does. ``--measure`` (a step budget planned on real tensors) builds the preset again, applies
the plan and measures one whole training step's peak beside the predicted one (:mod:`.plan_measure`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ..blocks import resolve_blocks
from ..budget import CheckpointPlan, MemoryBudget, StepPlanner, plan_activation_checkpointing
from ..budget.devices import device as named_device
from ..budget.predict import FITS_NONE, StepPeak
from ..budget.step_budget import OPTIMIZERS, StepBudget, refuse_step_offload
from ..policies import BlockMode
from ..spec import AdapterSpec, ModelCase, ModelSpec
from ..units import human_bytes
from ._common import (
    DTYPES,
    CLIError,
    add_size_arguments,
    build_case,
    check_size_arguments,
    library_notices_silenced,
    missing_library,
    models_for,
    positive,
    presets_of,
    select_adapters,
    stdout,
)
from .context_parallel import cp_mode, planned_rank
from .geometry import RankTokens, add_geometry_arguments, rank_tokens
from .plan_measure import check_measure, measure_step

DEVICES = ("meta", "cpu", "cuda")


def budget_value(text: str) -> MemoryBudget:
    """``--budget``: a fraction (``0.5``), bytes (``1000000``) or a size (``40GiB``), parsed as the API parses it."""
    value: float | int | str
    try:
        value = int(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            value = text
    try:
        return MemoryBudget.of(value)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def memory_value(text: str) -> int | str:
    """``--memory``: one rank's memory as bytes (``85899345920``) or a size (``80GiB``); not a fraction."""
    bare = text.strip()
    if not bare.isdigit() and bare.replace(".", "", 1).isdigit():
        raise argparse.ArgumentTypeError(
            f"{text!r}: one rank's memory in bytes or a size such as 80GiB; a fraction of 'none' is --budget's"
        )
    value: int | str = int(bare) if bare.isdigit() else text
    try:
        MemoryBudget.of(value)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("memory_budget=", "")) from None
    return value


def step_budget(args: argparse.Namespace) -> StepBudget | None:
    """The step budget ``--memory``/``--gpu``/``--fsdp``/``--cp``/``--optimizer`` ask for, None where ``--budget``
    gives a budget of bytes held for backward; CLIError naming the flags where they do not go together."""
    step_only = [f for f, v in (("--fsdp", args.fsdp), ("--optimizer", args.optimizer)) if v is not None]
    if args.budget is not None:
        if args.memory is not None:
            raise CLIError(
                "--budget (bytes held for backward) and --memory (a whole step's peak on one rank) are two budgets: "
                "give one"
            )
        if step_only:
            raise CLIError(
                f"{' and '.join(step_only)}: only for a step budget; give --memory or --gpu (its memory) "
                "instead of --budget"
            )
        return None
    if args.memory is None and args.gpu is None:
        raise CLIError(
            "give --memory (a whole step's peak on one rank, e.g. 80GiB) or --gpu (its memory), or --budget "
            "(bytes held for backward: 0.5 of what 'none' holds, or a size)"
        )
    try:
        return StepBudget(
            args.memory, device=args.gpu, fsdp=args.fsdp or 1, cp=args.cp, optimizer=args.optimizer or "adamw"
        )
    except (TypeError, ValueError) as exc:
        raise CLIError(str(exc)) from None


def _check_gpu(name: str | None) -> None:
    if name is None:
        return
    try:
        named_device(name)
    except ValueError as exc:
        raise CLIError(f"--gpu: {exc}") from None


def _model(adapter: AdapterSpec, preset: str, name: str | None) -> ModelSpec:
    models = models_for(adapter, preset)
    if not models:
        raise CLIError(
            f"preset {preset!r} is not offered by adapter {adapter.name}; "
            f"valid values: {', '.join(presets_of([adapter]))}"
        )
    if name is None:
        return models[0]
    for model in models:
        if name in (adapter.model_label(model), model.class_name):
            return model
    labels = ", ".join(adapter.model_label(m) for m in models)
    raise CLIError(f"no model class {name!r} at preset {preset!r} of {adapter.name}; valid values: {labels}")


def build_planned_case(
    model: ModelSpec,
    preset: str,
    *,
    layers: int | None,
    seq: int | None,
    device: str,
    dtype: torch.dtype,
    grid: tuple[int, int, int] | None = None,
    depth: Mapping[str, int] | None = None,
) -> ModelCase:
    """``model`` at ``preset``, built on ``device`` (``meta``: shapes only, nothing allocated), cast to ``dtype``;
    ``grid``: the video's (frames, height, width) in tokens instead of ``seq``; ``depth``: the preset's keyword
    options of the real model's depth (``ModelSpec.depths``), where ``layers`` is None."""
    options: dict[str, Any] = dict(depth) if depth is not None and layers is None else {}
    if grid is not None:
        options["grid"] = grid
    layers = options.pop("layers", layers)
    with torch.device(device):
        case = build_case(model, preset, layers=layers, seq=seq, **options)
    current = next((p.dtype for p in case.model.parameters() if p.is_floating_point()), dtype)
    case.to(device, dtype if dtype != current else None)
    case.model.train()
    return case


def _plan_case(
    case: ModelCase, adapter: AdapterSpec, budget: MemoryBudget | StepBudget | float | int | str, **options: Any
) -> CheckpointPlan:
    try:
        return plan_activation_checkpointing(case.model, dict(case.inputs), budget, adapter=adapter, **options)
    except ValueError as exc:
        raise CLIError(str(exc)) from None


def make_plan(
    adapter: AdapterSpec,
    model: ModelSpec,
    preset: str,
    budget: MemoryBudget | StepBudget | float | int | str,
    *,
    layers: int | None = None,
    seq: int | None = None,
    device: str = "meta",
    dtype: torch.dtype = torch.float32,
    offload: bool = False,
) -> CheckpointPlan:
    """The plan of ``adapter``'s ``model`` at ``preset`` for ``budget`` (bytes held for backward, or a
    :class:`~ac_core.StepBudget`), planned on ``device``; with ``offload``, blocks' inputs may go to host memory."""
    case = build_planned_case(model, preset, layers=layers, seq=seq, device=device, dtype=dtype)
    return _plan_case(case, adapter, budget, offload=offload)


# The neighbouring step budgets printed beside the plan: an eighth of the memory less and more.
_NEIGHBOURS = (7 / 8, 9 / 8)


class _NotFitsNone(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != FITS_NONE


@contextmanager
def _fits_none_unsaid() -> Iterator[None]:
    """Within the block, the planner's "fits none's predicted peak" is not logged: said once, for the plan itself."""
    logger = logging.getLogger("ac_core")
    quiet = _NotFitsNone()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _cost(plan: CheckpointPlan) -> str:
    if plan.overhead is not None:
        return f"{plan.overhead:+.1%} predicted step time"
    return f"{plan.recompute_flops:,} FLOPs recomputed"


def _step_report(planner: StepPlanner, plan: CheckpointPlan, budget: StepBudget, peak: StepPeak) -> list[str]:
    """The plan's predicted step ``peak`` by part, and what the step budgets an eighth below and above would
    cost (planned from the same profile)."""
    lines = [str(peak)]
    checkpointed = sum(block.mode != BlockMode.NONE for block in plan.blocks)
    lines.append(f"fits {len(plan.blocks)} blocks, {checkpointed} checkpointed, at {_cost(plan)}")
    for factor in _NEIGHBOURS:
        memory = int(budget.nbytes * factor)
        try:
            with _fits_none_unsaid():
                neighbour = planner.plan(memory)
        except ValueError as exc:
            lines.append(f"at {human_bytes(memory, digits=2)}: {exc}")
            continue
        lines.append(f"at {human_bytes(memory, digits=2)} it would need {_cost(neighbour)}")
    return lines


def _step_plan(
    case: ModelCase, adapter: AdapterSpec, budget: StepBudget, args: argparse.Namespace
) -> tuple[CheckpointPlan, StepPeak, list[str]]:
    """The step budget's plan, its predicted peak and the report lines, from one profile of ``case``."""
    try:
        refuse_step_offload(args.offload)
        planner = StepPlanner(resolve_blocks(case.model, adapter, None), dict(case.inputs), budget, device=args.gpu)
        plan = planner.plan()
        predicted = planner.predict(plan)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    return plan, predicted, _step_report(planner, plan, budget, predicted)


def _depth_words(preset: str, depth: Mapping[str, int] | None, plan: CheckpointPlan) -> str | None:
    """The header's words on the depth built, ``40 blocks (wan2.1-14b's depth)``, with the options where there
    are several; None without a depth."""
    if depth is None:
        return None
    options = f": {', '.join(f'{k}={v}' for k, v in depth.items())}" if len(depth) > 1 else ""
    return f"{len(plan.blocks)} blocks ({preset}'s depth{options})"


def run(args: argparse.Namespace) -> int:
    adapters = select_adapters(args.adapter)
    if len(adapters) != 1:
        raise CLIError(f"plan takes one adapter; {args.adapter!r} names {len(adapters)}")
    adapter = adapters[0]
    missing = missing_library(adapter)
    if missing:
        raise CLIError(missing)
    check_size_arguments(args, [adapter])
    if args.json is not None and not args.json.parent.exists():
        raise CLIError(f"cannot write {args.json}: folder {args.json.parent} does not exist")
    model = _model(adapter, args.preset, args.model)
    tokens = rank_tokens(adapter, model, args)
    _check_gpu(args.gpu)
    check_measure(args)
    budget = step_budget(args)
    # A step budget counts the model states of the blocks built: without --layers, the real model's depth.
    depth = model.depths.get(args.preset) if budget is not None and args.layers is None else None
    mode = cp_mode(adapter, args)
    silenced = {adapter.library} if adapter.library else set()
    start = time.perf_counter()
    step: list[str] = []
    predicted = None
    with (
        library_notices_silenced(silenced),
        planned_rank(adapter, mode, args.cp, lambda whole: _build(model, args, tokens, depth, whole=whole)) as rank,
    ):
        if budget is not None:
            # The step runs the preset's loss (an LLM's cross-entropy over its logits): the plan counts what it holds.
            budget = dataclasses.replace(budget, loss=rank.case.loss)
        if budget is None:
            plan = _plan_case(rank.case, adapter, args.budget, offload=args.offload, device=args.gpu)
        else:
            plan, predicted, step = _step_plan(rank.case, adapter, budget, args)
        rank_words, parallel = rank.words, rank.parallel
    del rank  # the planning copy: a measured step builds the preset again
    elapsed = time.perf_counter() - start
    console = stdout()
    described = [_depth_words(args.preset, depth, plan), tokens.describe(split=not parallel), rank_words]
    if any(text is not None for text in described):
        words = "; ".join(text for text in described if text is not None)
        console.print(f"{model.class_name} at {args.preset}: {words}", markup=False)
    console.print(str(plan), markup=False)
    for line in step:
        console.print(line, markup=False)
    console.print(f"planned on {args.device} in {elapsed:.1f} s")
    written = plan.to_json()
    if args.measure and predicted is not None:
        start = time.perf_counter()
        with library_notices_silenced(silenced):
            measured = measure_step(
                _build(model, args, tokens, depth), adapter, plan, predicted, args.optimizer or "adamw", args.device
            )
        console.print(f"{measured} (one step in {time.perf_counter() - start:.1f} s)", markup=False)
        data = json.loads(written)
        data["measured"] = measured.to_dict()
        written = json.dumps(data)
    if args.json is not None:
        args.json.write_text(written + "\n")
        console.print(f"wrote {args.json}")
    return 0


def _build(
    model: ModelSpec,
    args: argparse.Namespace,
    tokens: RankTokens,
    depth: Mapping[str, int] | None,
    *,
    whole: bool = False,
) -> ModelCase:
    """The preset's case as the arguments size it, on ``--device`` in ``--dtype``: at one rank's tokens, or with
    ``whole`` at the whole sequence (a context-parallel model splits it itself)."""
    grid = tokens.grid if whole else tokens.rank_grid
    return build_planned_case(
        model,
        args.preset,
        layers=args.layers,
        seq=None if grid is not None else tokens.tokens if whole else tokens.per_rank,
        grid=grid,
        depth=depth,
        device=args.device,
        dtype=DTYPES[args.dtype],
    )


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="plan checkpointing for a memory budget (least recompute that fits), on the meta device",
        description=(
            "Plan activation checkpointing of an adapter's model for a memory budget: per block, left unchecked, "
            "checkpointed whole, or checkpointed keeping some op outputs, with the least recompute (predicted "
            "time on --gpu, else FLOPs) whose bytes held for backward fit --budget, or whose whole training step's "
            "predicted peak fits --memory (with the peak by part and the plans an eighth below and above). The "
            "model is built on the meta device (no allocation), so a "
            "model at full size plans on a laptop. Prints the per-block table; --json writes the plan "
            "(ac_core.CheckpointPlan.from_json loads it; apply_activation_checkpointing(model, plan) applies it)."
        ),
    )
    parser.add_argument("adapter", help="adapter name or module:attribute of an AdapterSpec")
    add_size_arguments(parser, "wan2.1-14b")
    add_geometry_arguments(parser)
    parser.add_argument(
        "--model", default=None, help="model class, where the adapter has several at the preset (default: its first)"
    )
    parser.add_argument(
        "--budget",
        type=budget_value,
        default=None,
        help="bytes held for backward: a fraction of what 'none' holds (0.5), bytes (an int), or a size such as "
        "40GiB (instead of --memory)",
    )
    parser.add_argument(
        "--memory",
        type=memory_value,
        default=None,
        help="a whole training step's peak on one rank, bytes or a size such as 80GiB (default with --gpu: its memory)",
    )
    parser.add_argument(
        "--gpu",
        default=None,
        metavar="NAME",
        help="the device the plan's time is predicted on and whose memory --memory defaults to (h100, a100, ...)",
    )
    parser.add_argument(
        "--fsdp", type=positive, default=None, help="ranks FSDP shards parameters, gradients and optimizer state over"
    )
    parser.add_argument(
        "--optimizer", choices=tuple(OPTIMIZERS), default=None, help="the optimizer whose state counts (adamw)"
    )
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument(
        "--device", choices=DEVICES, default="meta", help="where the model is built: meta (default, no allocation)"
    )
    parser.add_argument(
        "--measure",
        action="store_true",
        help="with --memory/--gpu on --device cpu or cuda: build the preset again, apply the plan, run one whole "
        "training step (forward, the preset's loss, backward, --optimizer's step) and print its measured peak "
        "against the predicted (the plan counts the loss; --json adds the figures under 'measured')",
    )
    parser.add_argument(
        "--offload",
        action="store_true",
        help="let the plan move checkpointed blocks' inputs to host memory (a GPU run; OffloadConfig's defaults)",
    )
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the plan as JSON")
    parser.set_defaults(run=run, command_name=parser.prog.split()[-1])
