"""``ac-core compare``: what a compiled training step saves for backward and recomputes, route by route."""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..budget import MemoryBudget
from ..budget.devices import device as named_device
from ..experiments import ROUTES, BudgetComparison, Frontier, compare_budgets, compare_frontier, compare_routes
from ..measure import CompiledActivations
from ..spec import ModelCase, ModelSpec
from ..testing import toy_case
from ._common import (
    TINY,
    CLIError,
    add_size_arguments,
    build_case,
    check_outputs,
    check_size_arguments,
    environment,
    missing_library,
    models_for,
    positive,
    presets_of,
    select_adapters,
    split_names,
)
from .compare_frontier import format_frontier, frontier_value, write_json, write_plot
from .plan import budget_value


def format_table(results: Mapping[str, CompiledActivations], title: str) -> str:
    """A plain-text table of saved MiB, saved tensors and backward recomputes per route."""
    lines = [title, f"{'route':<12} {'saved MiB':>10} {'tensors':>8} {'recomputed ops':>15}"]
    for route, r in results.items():
        lines.append(f"{route:<12} {r.saved_bytes / 2**20:>10.2f} {r.saved_tensors:>8} {r.recompute_count:>15}")
    return "\n".join(lines)


def format_budgets(results: list[BudgetComparison], title: str) -> str:
    """Per budget: ac-core's plan (predicted, then measured compiled) beside torch's activation_memory_budget."""
    lines = [
        title,
        f"{'budget':<20} {'route':<23} {'saved MiB':>10} {'recompute GFLOP':>16} {'ac-core / torch':>16}",
    ]
    for r in results:
        ratio = "-" if r.recompute_ratio is None else f"{r.recompute_ratio:.3f}"
        rows = [
            ("ac-core plan, predicted", r.plan.held_bytes, r.plan.recompute_flops, ""),
            ("ac-core plan, compiled", r.ours.saved_bytes, r.ours.recompute_flops, ratio),
            ("torch memory budget", r.torch.saved_bytes, r.torch.recompute_flops, ""),
        ]
        for i, (route, saved, flops, cell) in enumerate(rows):
            budget = f"{r.budget} ({r.plan.budget_bytes / 2**20:.2f} MiB)" if i == 0 else ""
            lines.append(f"{budget:<20} {route:<23} {saved / 2**20:>10.2f} {flops / 1e9:>16.4f} {cell:>16}")
    return "\n".join(lines)


def _budget_list(value: str) -> list[MemoryBudget]:
    return [budget_value(name) for name in split_names(value)]


def _report(
    make: Callable[[], ModelCase],
    args: argparse.Namespace,
    title: str,
    frontiers: list[tuple[str, Frontier]],
    **where: Any,
) -> str:
    if args.frontier is not None:
        started = time.perf_counter()
        frontier = compare_frontier(make, args.frontier, backend=args.backend, device=args.gpu, **where)
        frontiers.append((title, frontier))
        return f"{format_frontier(frontier, title)}\nmeasured in {time.perf_counter() - started:.0f} s"
    if not args.budget:
        return format_table(compare_routes(make, backend=args.backend, **where), title)
    results, refused = [], []
    for budget in args.budget:
        try:
            results.extend(compare_budgets(make, [budget], backend=args.backend, **where))
        except ValueError as exc:  # a budget below the least possible at these inputs: say so, go on
            refused.append(f"budget {budget}: {exc}")
    return "\n".join([format_budgets(results, title), *refused])


def _training_case(model: ModelSpec, preset: str, *, layers: int | None, seq: int | None) -> ModelCase:
    case = build_case(model, preset, layers=layers, seq=seq)
    case.model.train()
    return case


def _check_frontier(args: argparse.Namespace) -> None:
    """Refuse flags that do not go together before anything is measured."""
    if args.frontier is None:
        given = [flag for flag, value in (("--plot", args.plot), ("--json", args.json), ("--gpu", args.gpu)) if value]
        if given:
            raise CLIError(f"{', '.join(given)} go with --frontier (e.g. --frontier 5), which draws both frontiers")
        return
    if args.budget:
        raise CLIError("--frontier samples its own budgets (torch's fractions); give --frontier or --budget, not both")
    if args.gpu is not None:
        try:
            named_device(args.gpu)
        except ValueError as exc:
            raise CLIError(f"--gpu: {exc}") from None
    check_outputs(args.plot, args.json)


def _write(args: argparse.Namespace, frontiers: list[tuple[str, Frontier]]) -> None:
    written = []
    if args.json is not None:
        env = environment(
            torch.device("cpu"),
            torch.float32,
            command="compare --frontier",
            adapter=args.adapter,
            preset=args.preset,
            layers=args.layers,
            seq=args.seq,
            backend=args.backend,
            gpu=args.gpu,
            torch_fractions=list(args.frontier),
        )
        write_json(args.json, frontiers, env)
        written.append(args.json)
    if args.plot is not None:
        write_plot(args.plot, frontiers)
        written.append(args.plot)
    for path in written:
        print(f"wrote {path}")


def run(args: argparse.Namespace) -> int:
    _check_frontier(args)
    frontiers: list[tuple[str, Frontier]] = []
    _compare(args, frontiers)
    if args.frontier is not None:
        _write(args, frontiers)
    return 0


def _compare(args: argparse.Namespace, frontiers: list[tuple[str, Frontier]]) -> None:
    if args.adapter is None:
        make = functools.partial(
            toy_case, dim=args.dim, heads=args.heads, depth=args.depth, tokens=args.tokens, batch=args.batch
        )
        title = (
            f"toy stack: {args.depth} blocks, width {args.dim}, {args.heads} heads, {args.batch}x{args.tokens} tokens"
        )
        print(_report(make, args, title, frontiers, blocks=["layers"]))
        return
    adapters = select_adapters(args.adapter)
    check_size_arguments(args, adapters)
    for adapter in adapters:
        missing = missing_library(adapter)
        if not models_for(adapter, args.preset):
            valid = ", ".join(presets_of([adapter]))
            print(f"{adapter.name}: no model at preset {args.preset!r}; valid values: {valid}")
        for model in models_for(adapter, args.preset):
            title = f"{adapter.name}: {args.preset} {adapter.model_label(model)}"
            if args.preset != TINY:
                title += f", {args.layers or 4} blocks per container, seq {args.seq or 'default'}"
            if missing:
                print(f"{title}\nskipped: {missing}\n")
            elif model.compile_unsupported:
                print(f"{title}\nskipped: torch.compile cannot train it (declared: {model.compile_unsupported})\n")
            else:
                make = functools.partial(_training_case, model, args.preset, layers=args.layers, seq=args.seq)
                print(f"{_report(make, args, title, frontiers, adapter=adapter)}\n")


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "compare",
        help="compare what a compiled step saves and recomputes, per route",
        description=(
            f"Compile one training step per route ({', '.join(ROUTES)}) and print, per route, the activations "
            "the partitioner saves for backward (MiB and tensors) and the forward ops backward recomputes: for "
            "the toy stack, or for each model of --adapter at --preset. With --budget, per memory budget instead: "
            "ac-core's plan in the graph pass beside torch's activation_memory_budget, measured side by side. "
            "With --frontier, both frontiers at equal saved bytes: torch's budget at each of its fractions, and "
            "ac-core's plan at the bytes torch saved there (--plot draws them, --json writes them)."
        ),
    )
    parser.add_argument("--adapter", help="adapter name(s), comma-separated, or 'all': their tiny models, not the toy")
    parser.add_argument("--backend", default="aot_eager", choices=("aot_eager", "inductor"), help="compiler")
    add_size_arguments(parser, "wan2.1-1.3b (with --adapter)")
    parser.add_argument(
        "--budget",
        type=_budget_list,
        default=None,
        metavar="B[,B...]",
        help="instead of the routes: per memory budget (fractions of none's held-for-backward, bytes or sizes), "
        "ac-core's plan in the graph pass beside torch's activation_memory_budget at the same fraction, measured",
    )
    parser.add_argument(
        "--frontier",
        type=frontier_value,
        nargs="?",
        const=frontier_value("5"),
        default=None,
        metavar="N|F[,F...]",
        help="both frontiers at equal saved bytes: torch's activation_memory_budget at N fractions from 0.1 to 0.9 "
        "(5 when no value is given) or at the fractions given, and ac-core's plan at the bytes torch saved at each, "
        "both measured compiled: saved MiB, recomputed GFLOP and their ratio per point",
    )
    parser.add_argument(
        "--gpu",
        default=None,
        metavar="NAME",
        help="with --frontier: plan for the least predicted recompute time on this device (h100, a100, ...; "
        "'cpu' after ac-core calibrate) and price both sides' recompute with its roofline",
    )
    parser.add_argument(
        "--plot", type=Path, default=None, metavar="FILE.png", help="with --frontier: draw both frontiers"
    )
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="with --frontier: write the points")
    parser.add_argument("--depth", type=positive, default=4, help="toy stack: blocks (4)")
    parser.add_argument("--dim", type=positive, default=256, help="toy stack: width (256)")
    parser.add_argument("--heads", type=positive, default=4, help="toy stack: attention heads (4)")
    parser.add_argument("--batch", type=positive, default=4, help="toy stack: samples (4)")
    parser.add_argument("--tokens", type=positive, default=128, help="toy stack: tokens per sample (128)")
    parser.set_defaults(run=run, command_name=parser.prog.split()[-1])
