"""``ac-core sweep diffusers|transformers``: build every model class the library declares tiny and prove each one.

A light conformance per class (the suite's own checks, from ``ac_core_conformance.sweep``), each class in a
process of its own. ``--json`` keeps the record (a sweep of some ``--classes`` updates their rows in it),
``--table`` renders it into a markdown file's section for the library, ``--baseline`` fails the command when
a class proven there is not proven now.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from ._common import CLIError, positive, stdout

LIBRARIES = ("diffusers", "transformers")


def _sweep_package() -> Any:
    try:
        import ac_core_conformance.sweep as package
    except ImportError as exc:
        raise CLIError(
            f"ac-core sweep runs the conformance suite's checks, which need pytest ({exc}); install ac-core[test]"
        ) from None
    return package


def _library_installed(library: str) -> None:
    from importlib.util import find_spec

    if find_spec(library) is None:
        raise CLIError(f"{library} is not installed here; install it (pip install {library}) to sweep its classes")


def run(args: argparse.Namespace) -> int:
    if args.table and not args.json:
        raise CLIError("--table renders the record --json writes: pass --json FILE too")
    _library_installed(args.library)
    sweep = _sweep_package()
    console = stdout()
    try:
        targets = sweep.targets(args.library, args.classes)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    baseline = sweep.read_record(args.baseline) if args.baseline else None
    if args.baseline and baseline is None:
        raise CLIError(f"--baseline {args.baseline}: no such file (write one with --json)")
    console.print(f"sweeping {len(targets)} {args.library} classes, {args.jobs or 'one per CPU'} at a time")
    start = time.perf_counter()
    done = 0

    def progress(row: Any) -> None:
        nonlocal done
        done += 1
        why = f": {row.reason[:150]}" if row.reason else ""
        console.print(f"[{done:>3}/{len(targets)}] {row.name}: {row.result} ({row.seconds:.1f} s){why}", markup=False)

    rows = sweep.sweep(targets, jobs=args.jobs, time_limit=args.time_limit, on_result=progress)
    record = sweep.SweepRecord(args.library, sweep.installed_versions(args.library), rows)
    elapsed = time.perf_counter() - start
    proven = len(record.proven)
    console.print(f"\n{proven} of {len(rows)} {args.library} classes proven in {elapsed:.0f} s")
    for kind, names in sweep.failure_reasons(rows)[:5]:
        console.print(f"  {len(names):>3} x {kind}  ({', '.join(names[:6])}{', ...' if len(names) > 6 else ''})")
    if args.json:
        kept = sweep.merged(sweep.read_record(args.json), record) if args.classes else record
        sweep.write_record(args.json, kept)
        console.print(f"record: {args.json}")
        if args.table:
            sweep.write_table(args.table, kept, LIBRARIES)
            console.print(f"table: {args.table} (section {args.library})")
    if baseline is not None:
        lost = sweep.regressions(baseline, record)
        if lost:
            console.print(f"\n{len(lost)} classes proven in {args.baseline} are not proven now:")
            for _, now in lost:
                console.print(f"  {now.name}: {now.result}: {now.reason}", markup=False)
            return 1
        console.print(f"no class proven in {args.baseline} regressed")
    return 0


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "sweep",
        help="build every model class of diffusers or transformers tiny and prove each one",
        description=(
            "Every transformer class diffusers ships, or every causal-LM model type transformers maps, built tiny "
            "from its own defaults and served by the adapter ac-core picks (curated, else the library route), then "
            "checked: blocks covered; loss and gradients bit-equal to the plain model under full and ops; attention "
            "not re-run in backward under ops where the default backend reaches a retainable kernel; names "
            "unchanged; a 50%% budget plan held. Each class runs in a process of its own."
        ),
    )
    parser.add_argument("library", choices=LIBRARIES)
    parser.add_argument("--classes", nargs="+", metavar="NAME", help="only these classes (or model types)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the record (with --classes: update it)")
    parser.add_argument("--table", type=Path, metavar="FILE", help="with --json: render it into FILE's section")
    parser.add_argument("--baseline", type=Path, metavar="FILE", help="fail when a class proven in FILE is not now")
    parser.add_argument("--jobs", type=positive, help="classes swept at a time (default: one per CPU)")
    parser.add_argument("--time-limit", type=float, default=120.0, help="seconds per class (default 120)")
    parser.set_defaults(run=run, command_name=parser.prog.split()[-1])
