"""``ac-core plan``: the memory-budget plan of an adapter's model at a preset, made on the ``meta`` device.

The model and its inputs are built under ``torch.device("meta")``: nothing is allocated, so a model far larger
than this machine's memory (Wan2.1-14B, 40 blocks, 81 frames of 720p) is planned from shapes, FLOPs and bytes.
The per-block table is printed; ``--json`` writes the plan, which ``CheckpointPlan.from_json`` loads back.
``--offload`` lets the plan move checkpointed blocks' inputs to host memory (offload's default settings), as a
GPU run of the plan does.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from ..budget import CheckpointPlan, MemoryBudget, plan_activation_checkpointing
from ..spec import AdapterSpec, ModelCase, ModelSpec
from ._common import (
    DTYPES,
    CLIError,
    add_size_arguments,
    build_case,
    check_size_arguments,
    library_notices_silenced,
    missing_library,
    models_for,
    presets_of,
    select_adapters,
    stdout,
)

DEVICES = ("meta", "cpu")


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
    model: ModelSpec, preset: str, *, layers: int | None, seq: int | None, device: str, dtype: torch.dtype
) -> ModelCase:
    """``model`` at ``preset``, built on ``device`` (``meta``: shapes only, nothing allocated), cast to ``dtype``."""
    with torch.device(device):
        case = build_case(model, preset, layers=layers, seq=seq)
    current = next((p.dtype for p in case.model.parameters() if p.is_floating_point()), dtype)
    case.to(device, dtype if dtype != current else None)
    case.model.train()
    return case


def make_plan(
    adapter: AdapterSpec,
    model: ModelSpec,
    preset: str,
    budget: float | int | str,
    *,
    layers: int | None = None,
    seq: int | None = None,
    device: str = "meta",
    dtype: torch.dtype = torch.float32,
    offload: bool = False,
) -> CheckpointPlan:
    """The plan of ``adapter``'s ``model`` at ``preset`` for ``budget``, planned on ``device``; with ``offload``,
    blocks' inputs may go to host memory."""
    case = build_planned_case(model, preset, layers=layers, seq=seq, device=device, dtype=dtype)
    try:
        return plan_activation_checkpointing(case.model, dict(case.inputs), budget, adapter=adapter, offload=offload)
    except ValueError as exc:
        raise CLIError(str(exc)) from None


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
    start = time.perf_counter()
    with library_notices_silenced({adapter.library} if adapter.library else set()):
        plan = make_plan(
            adapter,
            model,
            args.preset,
            args.budget,
            layers=args.layers,
            seq=args.seq,
            device=args.device,
            dtype=DTYPES[args.dtype],
            offload=args.offload,
        )
    elapsed = time.perf_counter() - start
    console = stdout()
    console.print(str(plan), markup=False)
    console.print(f"planned on {args.device} in {elapsed:.1f} s")
    if args.json is not None:
        args.json.write_text(plan.to_json() + "\n")
        console.print(f"wrote {args.json}")
    return 0


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="plan checkpointing for a memory budget (least recompute that fits), on the meta device",
        description=(
            "Plan activation checkpointing of an adapter's model for a memory budget: per block, left unchecked, "
            "checkpointed whole, or checkpointed keeping some op outputs, with the least recompute FLOPs whose "
            "bytes held for backward fit the budget. The model is built on the meta device (no allocation), so a "
            "model at full size plans on a laptop. Prints the per-block table; --json writes the plan "
            "(ac_core.CheckpointPlan.from_json loads it; apply_activation_checkpointing(model, plan) applies it)."
        ),
    )
    parser.add_argument("adapter", help="adapter name or module:attribute of an AdapterSpec")
    add_size_arguments(parser, "wan2.1-14b")
    parser.add_argument(
        "--model", default=None, help="model class, where the adapter has several at the preset (default: its first)"
    )
    parser.add_argument(
        "--budget",
        type=budget_value,
        required=True,
        help="a fraction of what 'none' holds for backward (0.5), bytes (an int), or a size such as 40GiB",
    )
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument(
        "--device", choices=DEVICES, default="meta", help="where the model is built: meta (default, no allocation)"
    )
    parser.add_argument(
        "--offload",
        action="store_true",
        help="let the plan move checkpointed blocks' inputs to host memory (a GPU run; OffloadConfig's defaults)",
    )
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the plan as JSON")
    parser.set_defaults(run=run, command_name=parser.prog.split()[-1])
