"""``ac-core compare``: what a compiled training step saves for backward and recomputes, route by route."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Mapping
from typing import Any

from ..measure.compiled import ROUTES, CompiledActivations, compare_routes
from ..testing import toy_case
from ._common import missing_library, positive, select_adapters


def format_table(results: Mapping[str, CompiledActivations], title: str) -> str:
    """A plain-text table of saved MiB, saved tensors and backward recomputes per route."""
    lines = [title, f"{'route':<12} {'saved MiB':>10} {'tensors':>8} {'recomputed ops':>15}"]
    for route, r in results.items():
        lines.append(f"{route:<12} {r.saved_bytes / 2**20:>10.2f} {r.saved_tensors:>8} {r.recompute_count:>15}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.adapter is None:
        make = functools.partial(
            toy_case, dim=args.dim, heads=args.heads, depth=args.depth, tokens=args.tokens, batch=args.batch
        )
        title = (
            f"toy stack: {args.depth} blocks, width {args.dim}, {args.heads} heads, {args.batch}x{args.tokens} tokens"
        )
        print(format_table(compare_routes(make, blocks=["layers"], backend=args.backend), title))
        return 0
    for adapter in select_adapters(args.adapter):
        missing = missing_library(adapter)
        for model in adapter.models:
            if model.tiny is None:
                continue
            title = f"{adapter.name}: tiny {adapter.model_label(model)}"
            if missing:
                print(f"{title}\nskipped: {missing}\n")
            elif model.compile_unsupported:
                print(f"{title}\nskipped: torch.compile cannot train it (declared: {model.compile_unsupported})\n")
            else:
                results = compare_routes(model.build_tiny, adapter=adapter, backend=args.backend)
                print(f"{format_table(results, title)}\n")
    return 0


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "compare",
        help="compare what a compiled step saves and recomputes, per route",
        description=(
            f"Compile one training step per route ({', '.join(ROUTES)}) and print, per route, the activations "
            "the partitioner saves for backward (MiB and tensors) and the forward ops backward recomputes: for "
            "the toy stack, or for each tiny model of --adapter."
        ),
    )
    parser.add_argument("--adapter", help="adapter name(s), comma-separated, or 'all': their tiny models, not the toy")
    parser.add_argument("--backend", default="aot_eager", choices=("aot_eager", "inductor"), help="compiler")
    parser.add_argument("--depth", type=positive, default=4, help="toy stack: blocks (4)")
    parser.add_argument("--dim", type=positive, default=256, help="toy stack: width (256)")
    parser.add_argument("--heads", type=positive, default=4, help="toy stack: attention heads (4)")
    parser.add_argument("--batch", type=positive, default=4, help="toy stack: samples (4)")
    parser.add_argument("--tokens", type=positive, default=128, help="toy stack: tokens per sample (128)")
    parser.set_defaults(run=run, command_name=parser.prog.split()[-1])
