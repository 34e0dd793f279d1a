"""The ``ac-core`` command line: ``inspect`` what an adapter declares (or draft one for a new model class),
``bench`` every policy on its models, ``plan`` a memory budget at real size, ``compare`` what a compiled step
saves and recomputes per route, ``sweep`` every model class of diffusers or transformers, ``calibrate`` this
machine's peak rates.

Imported only by the ``ac-core`` script (``import ac_core`` does not load it, nor rich or matplotlib).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ._common import CLIError


def build_parser() -> argparse.ArgumentParser:
    """The ``ac-core`` argument parser with its subcommands."""
    from . import bench, calibrate, compare, inspect, plan, sweep

    parser = argparse.ArgumentParser(
        prog="ac-core",
        description="Activation checkpointing for video diffusion transformers and LLMs: inspect, benchmark, compare.",
    )
    subparsers = parser.add_subparsers(
        title="commands", required=True, metavar="{inspect,bench,compare,plan,sweep,calibrate}"
    )
    inspect.add_parser(subparsers)
    bench.add_parser(subparsers)
    compare.add_parser(subparsers)
    plan.add_parser(subparsers)
    sweep.add_parser(subparsers)
    calibrate.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ac-core`` with ``argv`` (default: the process arguments); returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except CLIError as exc:
        print(f"ac-core {args.command_name}: error: {exc}", file=sys.stderr)
        return 2


__all__ = ["CLIError", "build_parser", "main"]
