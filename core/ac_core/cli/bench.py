"""``ac-core bench``: one training step per adapter x model class x policy, measured side by side.

This module reads the command line and runs the job; :mod:`.rows` says what a row is, :mod:`.runner`
how rows are measured, :mod:`.report` how they are shown.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch

from ..budget import MemoryBudget
from ..budget.devices import Device, calibration_path
from ..budget.planner import resolve_device
from ..budget.step_budget import OPTIMIZERS
from ..offload import OffloadConfig
from ..policies import BlockSkip, Full
from ..spec import AdapterSpec, ModelSpec
from ._common import (
    DTYPES,
    TINY,
    CLIError,
    add_size_arguments,
    check_outputs,
    check_size_arguments,
    environment,
    library_notices_silenced,
    models_for,
    non_negative,
    positive,
    presets_of,
    select_adapters,
    split_names,
    stderr,
    stdout,
)
from .allocator import allocator_note
from .plan import budget_value, memory_value
from .rows import BUDGET, CLOCKS, LIBRARY, NONE, STEP, Row, row_names, variants

DEVICES = ("cpu", "cuda")
DEFAULT_BUDGETS = "0.25,0.5,0.75"


def _budgets(value: str) -> list[MemoryBudget]:
    """``--budget``: comma-separated fractions of none's held-for-backward, bytes or sizes."""
    try:
        return [budget_value(name) for name in split_names(value)]
    except argparse.ArgumentTypeError as exc:
        raise CLIError(f"--budget: {exc}") from None


def _memories(value: str) -> list[int | str]:
    """``--memory``: comma-separated step budgets, one rank's memory as bytes or sizes (not fractions)."""
    try:
        memories = [memory_value(name) for name in split_names(value)]
    except argparse.ArgumentTypeError as exc:
        raise CLIError(f"--memory: {exc}") from None
    if not memories:
        raise CLIError("--memory names no step budget; e.g. --memory 2GiB,3GiB (one rank's memory for a whole step)")
    return memories


def _figures(name: str, flag: str) -> Device:
    """The device figures ``flag`` asks for: a device table name, ``cpu`` as ``ac-core calibrate`` measured it
    (never measured on the fly: the figures would change from run to run), or ``cuda`` by its name."""
    if name.strip().lower() == "cpu" and not calibration_path().exists():
        raise CLIError(
            f"{flag} cpu: no calibration at {calibration_path()}; run `ac-core calibrate` first (or point "
            "AC_CORE_CALIBRATION at its file)"
        )
    try:
        return resolve_device(name)
    except ValueError as exc:
        raise CLIError(f"{flag}: {exc}") from None


def _n_layers(value: str) -> list[int]:
    """``--n-layer``: one n, or several comma-separated (one block_skip row each)."""
    try:
        numbers = [positive(name) for name in split_names(value)]
    except ValueError:
        numbers = []
    if not numbers:
        raise argparse.ArgumentTypeError(f"takes ints >= 1, comma-separated, got {value!r}")
    return numbers


def _validate(args: argparse.Namespace) -> tuple[list[tuple[AdapterSpec, list[ModelSpec]]], list[str]]:
    adapters = select_adapters(args.adapter)
    valid = row_names()
    policies: list[str] = []
    for name in split_names(args.policy):
        if name == "all":
            policies.extend(valid)
        elif name in valid or name == BUDGET:
            policies.append(name)
        else:
            raise CLIError(f"unknown policy {name!r}; valid values: all, {', '.join(valid)}, {BUDGET}")
    if not policies:
        raise CLIError(f"--policy names no policy; valid values: all, {', '.join(valid)}, {BUDGET}")
    if args.budget is not None and BUDGET not in policies:
        raise CLIError(f"--budget sizes the {BUDGET} rows; add {BUDGET} to --policy (e.g. --policy all,{BUDGET})")
    args.budgets = _budgets(DEFAULT_BUDGETS if args.budget is None else args.budget) if BUDGET in policies else []
    if BUDGET in policies and not args.budgets:
        raise CLIError(f"--budget names no budget; e.g. --budget {DEFAULT_BUDGETS}")
    if args.subsets and not set(policies) - {NONE, LIBRARY, BUDGET}:
        raise CLIError(
            f"--subsets measures the checkpointing policies on subsets of containers; add one of "
            f"{', '.join(n for n in valid if n not in (NONE, LIBRARY))} to --policy"
        )
    if args.clock == "cpu" and args.device != "cpu":
        raise CLIError(
            f"--clock cpu times the process's CPU time, which a {args.device} step's kernels do not spend; "
            "use --clock wall there"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        raise CLIError(f"--device cuda: CUDA is not available here (torch {torch.__version__}); valid values: cpu")
    args.memories = [] if args.memory is None else _memories(args.memory)
    if args.optimizer is not None and not args.memories:
        raise CLIError(f"--optimizer counts its state in the {STEP} rows' step budgets; give --memory SIZE[,SIZE...]")
    args.figures = None if args.predict is None else _figures(args.predict, "--predict")
    # Step rows' time-costed plans need a device's figures: --predict's, else the device the rows run on.
    args.step_figures = args.figures
    if args.memories and args.step_figures is None:
        args.step_figures = _figures(args.device, f"--memory (its {STEP} rows costed in time on --device)")
    check_size_arguments(args, adapters)
    selected = [(adapter, models_for(adapter, args.preset)) for adapter in adapters]
    if args.adapter.strip() == "all":
        selected = [(adapter, models) for adapter, models in selected if models]
    lacking = [adapter for adapter, models in selected if not models]
    if lacking or not selected:
        names = ", ".join(adapter.name for adapter in lacking) or args.adapter
        raise CLIError(
            f"preset {args.preset!r} is not offered by adapter(s) {names}; "
            f"valid values: {', '.join(presets_of(lacking or adapters))}"
        )
    check_outputs(args.plot, args.json)
    return selected, policies


def run(args: argparse.Namespace) -> int:
    selected, policies = _validate(args)
    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, selected, policies)
    finally:
        torch.set_num_threads(threads)  # main() may be called in-process (tests, notebooks)


def _run(args: argparse.Namespace, selected: list[tuple[AdapterSpec, list[ModelSpec]]], policies: list[str]) -> int:
    from .report import print_table, write_json, write_plot
    from .runner import Settings, run_rows

    offload = None if args.offload is None else OffloadConfig(min_tokens=args.offload)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    settings = Settings(
        args.preset,
        args.layers,
        args.seq,
        device,
        dtype,
        args.steps,
        args.warmup,
        args.subsets,
        predict=args.figures,
        step_device=args.step_figures,
        clock=args.clock,
        optimizer=args.optimizer or "adamw",
    )
    chosen = variants(policies, args.n_layer, offload, args.budgets, args.memories)
    with library_notices_silenced({adapter.library for adapter, _ in selected if adapter.library}):
        rows = run_rows(selected, chosen, settings)
    env = environment(
        device,
        dtype,
        preset=args.preset,
        seq=args.seq,
        layers=args.layers,
        steps=args.steps,
        warmup=args.warmup,
        clock=args.clock,
        n_layer=args.n_layer[0] if len(args.n_layer) == 1 else args.n_layer,  # one n: an int, as before lists
        subsets=args.subsets,
        offload_min_tokens=args.offload,
        budgets=[budget.given for budget in args.budgets] or None,  # as written: JSON takes no MemoryBudget
        memories=args.memories or None,
        optimizer=(args.optimizer or "adamw") if args.memories else None,
        predict=args.figures.name if args.figures is not None else None,
        step_device=args.step_figures.name if args.step_figures is not None else None,
        glibc_tunables=os.environ.get("GLIBC_TUNABLES"),
    )
    console = stdout()
    print_table(console, rows, env)
    note = None if args.preset == TINY else allocator_note(device)  # tiny steps time the host anyway
    if note is not None:
        console.print(note)
    written = []
    if args.json is not None:
        write_json(args.json, rows, env)
        written.append(args.json)
    if args.plot is not None:
        write_plot(args.plot, rows, env)
        written.append(args.plot)
    if written:
        console.print(f"wrote {', '.join(str(path) for path in written)}")
    failed = any(r.status == "error" or r.grad_ok is False for r in rows)
    unmeasured = _unmeasured(args.adapter, [adapter.name for adapter, _ in selected], rows)
    if unmeasured:
        stderr().print(
            f"ac-core bench: nothing was measured for {', '.join(unmeasured)}: every row was skipped (see the notes "
            "above)"
        )
    return 1 if failed or unmeasured else 0


def _unmeasured(asked: str, adapters: list[str], rows: list[Row]) -> list[str]:
    """Adapters named on the command line none of whose rows ran; with ``all``, every adapter when none ran."""
    ran = {row.adapter for row in rows if row.status == "ok"}
    if asked.strip() == "all":
        return [] if ran else adapters
    return [name for name in adapters if name not in ran]


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="measure memory, FLOPs, recompute and step time of every policy",
        description=(
            "One training step (forward, loss, backward) per adapter x model class x policy, measured side by side: "
            "activation memory (peak beyond parameters and gradients; bytes held for backward), FLOPs and the "
            "recompute overhead over 'none', attention kernels re-run in backward, median step time and its ratio "
            "to 'none', and gradients checked against 'none' (always measured first, as the reference). "
            "Each row's step is measured in turn; then the rows are timed interleaved, one step each per round. "
            "On the tiny preset (the default) the step-time columns are headed 'host overhead': models a few KiB "
            "wide time Python and dispatch, not device work; time a real-width --preset for step-time ratios. "
            "Exits with 1 when a row fails or its gradients differ from 'none''s."
        ),
    )
    parser.add_argument("--adapter", default="all", help="adapter name(s), comma-separated, or 'all' (default)")
    parser.add_argument(
        "--policy",
        default="all",
        help=f"policies, comma-separated, or 'all' (default): {', '.join(row_names())}; and {BUDGET} (not in all: "
        "the memory-budget plan at each --budget)",
    )
    parser.add_argument(
        "--budget",
        default=None,
        metavar="B[,B...]",
        help=f"memory budgets of the {BUDGET} rows: fractions of none's held-for-backward, bytes or sizes such as "
        f"40GiB, comma-separated ({DEFAULT_BUDGETS}); one row each, planned on the row's model and inputs",
    )
    parser.add_argument(
        "--memory",
        default=None,
        metavar="SIZE[,SIZE...]",
        help=f"step budgets: one rank's memory for a whole step (bytes or sizes such as 2GiB, not fractions), "
        f"comma-separated; per size two {STEP} rows, planned for the step's predicted peak (ac_core.StepBudget, "
        "--optimizer's state and the preset's loss counted) with the recompute costed in predicted time and in FLOPs, "
        "labelled step(SIZE,time) and step(SIZE,flops); time is predicted on --predict's device, else --device's",
    )
    parser.add_argument(
        "--optimizer",
        choices=tuple(OPTIMIZERS),
        default=None,
        help=f"the optimizer whose state the {STEP} rows' step budgets count (adamw); bench's own step runs none: "
        "'none' sizes the budget for the step measured",
    )
    parser.add_argument(
        "--predict",
        default=None,
        metavar="DEVICE",
        help="predict each row's step-time overhead over none by roofline on DEVICE (cpu: ac-core calibrate's "
        "figures; h100, a100, l40s ... from the device table; cuda: this GPU's entry) and print it beside the "
        "measured ratio, with the rank correlation of the two over each model's rows",
    )
    parser.add_argument(
        "--n-layer",
        type=_n_layers,
        default=[2],
        metavar="N[,N...]",
        help=f"{BlockSkip.name} checkpoints every n-th block (2); several, comma-separated, give a row each",
    )
    parser.add_argument(
        "--subsets",
        action="store_true",
        help="also measure each checkpointing policy on each proper subset of a model's block containers (models "
        "with two or more, e.g. Flux's double- and single-stream blocks), labelled policy[containers]; each "
        f"{BUDGET} row is compared with the fixed row of least recompute that fits its budget",
    )
    add_size_arguments(parser, "wan2.1-1.3b")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--device", choices=DEVICES, default="cpu")
    parser.add_argument(
        "--steps",
        type=positive,
        default=3,
        help="timed steps per row, one per round over the rows in turn; the median is reported (3)",
    )
    parser.add_argument(
        "--clock",
        choices=CLOCKS,
        default="wall",
        help="what a timed step's seconds are: wall (default), or cpu: the process's CPU time (CPU runs only), "
        "which leaves out the time waiting for a core on a machine other processes share; with --threads 1 "
        "it is one core's work",
    )
    parser.add_argument(
        "--warmup",
        type=non_negative,
        default=1,
        help="untimed steps of each plain model before its first row (1); every row's measured step also runs "
        "before the timed rounds",
    )
    parser.add_argument(
        "--offload",
        type=positive,
        default=None,
        metavar="MIN_TOKENS",
        help="also measure each policy with activation offload from MIN_TOKENS tokens, and "
        f"{Full.name} with torch's synchronous save_on_cpu (CUDA only)",
    )
    parser.add_argument("--threads", type=positive, default=None, help="CPU threads for torch (its default)")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="write every figure as JSON")
    parser.add_argument("--plot", type=Path, default=None, metavar="FILE.png", help="plot memory against recompute")
    parser.set_defaults(run=run, command_name=parser.prog.split()[-1])
