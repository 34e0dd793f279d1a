"""``ac-core inspect``: what an adapter declares about its models, checked against the models themselves."""

from __future__ import annotations

import argparse
import functools
import operator
from collections import Counter
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape

from ..errors import AdapterError
from ..measure import attribute_ops, op_matches
from ..ops import DEFAULT_RETAINED_OPS
from ..plan import BlockPlan, resolve_blocks
from ..registry import registered_adapters
from ..spec import AdapterSpec, ModelCase, ModelSpec
from ._common import (
    TINY,
    CLIError,
    build_case,
    known_adapters,
    missing_library,
    presets_of,
    select_adapters,
    stdout,
    version_status,
)


def retained_ops_per_block(case: ModelCase, plan: BlockPlan, retained: frozenset[str]) -> dict[str, dict[str, float]]:
    """Block class -> {op name: calls per block forward} of the ops ``ops`` retains, from forwards of ``case``.

    One forward finds the blocks that run and the retained op names seen; one more per op name counts it.
    """
    blocks = {block.path: block.module for block in plan}
    seen: set[str] = set()

    def any_op(name: str) -> bool:
        if op_matches(name, retained):
            seen.add(name)
        return True

    with attribute_ops(blocks, any_op) as ran:
        case.run()
    runs = Counter(block.class_name for block in plan if ran[block.path])
    kept: dict[str, Counter[str]] = {kind: Counter() for kind in runs}
    for op in sorted(seen):
        with attribute_ops(blocks, functools.partial(operator.eq, op)) as counts:
            case.run()
        for block in plan:
            if counts[block.path]:
                kept[block.class_name][op] += counts[block.path]
    return {kind: {op: n / runs[kind] for op, n in sorted(kept[kind].items())} for kind in runs}


def _container_lines(plan: BlockPlan) -> list[str]:
    lines = []
    for container in plan.containers:
        kinds = ", ".join(Counter(block.class_name for block in container.blocks))
        blocks = f"{len(container.blocks)} x {kinds}" if container.blocks else "empty"
        lines.append(escape(f"{container.path}: {blocks}"))
    return lines


def _excluded_lines(plan: BlockPlan | None, model: ModelSpec) -> list[str]:
    if plan is None:
        return [escape(f"{excluded.path}: {excluded.reason}") for excluded in model.excluded] or ["none"]
    lines = []
    for excluded in plan.excluded:
        count = sum(len(list(module.children())) for _, module in excluded.modules)
        size = f" ({count} blocks)" if excluded.found else ""
        lines.append(escape(f"{excluded.path}{size}: {excluded.reason}"))
    return lines or ["none"]


def _version_line(model: ModelSpec) -> str:
    if model.versions is None:
        return "library version: any (the adapter declares no requirement)"
    supported, installed = version_status(model)
    mark = "[green]supported[/]" if supported else "[red]NOT supported[/]"
    return f"library version: {mark} " + escape(f"(installed {installed or 'nothing'}, declared {model.versions})")


def _per_block_lines(model: ModelSpec, measured: dict[str, dict[str, float]] | None) -> list[str]:
    lines = []
    for kind in sorted(set(model.attention_calls) | set(measured or {})):
        declared = model.attention_calls.get(kind)
        line = escape(f"{kind}: {declared if declared is not None else 'no'} attention call(s) declared")
        if measured is not None:
            ops = measured.get(kind, {})
            kept = escape(", ".join(f"{op} x{n:g}" for op, n in ops.items())) or "[red]nothing[/]"
            line += f"; keeps {kept}"
        lines.append(line)
    return lines


def _build(model: ModelSpec, preset: str) -> tuple[ModelCase, str]:
    """The model at ``preset``: on the meta device for a named preset (it costs nothing), else on CPU."""
    if preset == TINY:
        return build_case(model, TINY), "tiny config, on CPU"
    with torch.device("meta"):
        return build_case(model, preset), f"preset {preset}, built on the meta device"


def _plan(case: ModelCase, adapter: AdapterSpec) -> BlockPlan:
    # The library version gets its own line, supported or not: it does not stop the inspection.
    return resolve_blocks(case.model, adapter, check_versions=False)


def _print_model(
    console: Console, adapter: AdapterSpec, model: ModelSpec, preset: str, retained: frozenset[str]
) -> None:
    console.print(f"[bold]{escape(model.class_name)}[/]  " + escape(f"({model.cls})"))
    console.print(f"  {_version_line(model)}")
    case = plan = None
    if preset == TINY and model.tiny is None:
        console.print("  block containers (declared; no tiny config to build):")
        for path in model.containers:
            console.print(f"    {escape(path)}")
    else:
        try:
            case, where = _build(model, preset)
            plan = _plan(case, adapter)
            console.print(escape(f"  block containers ({where}):"))
            for line in _container_lines(plan):
                console.print(f"    {line}")
        except AdapterError as exc:
            console.print(f"  block containers: [red]{escape(str(exc))}[/]")
        except Exception as exc:
            console.print(f"  block containers: [red]could not build the model: {escape(repr(exc))}[/]")
    console.print("  excluded containers:")
    for line in _excluded_lines(plan, model):
        console.print(f"    {line}")
    measured, note = None, "not measured: no tiny config"
    if model.tiny is not None:
        try:
            tiny = case if preset == TINY and case is not None else build_case(model, TINY)
            tiny_plan = plan if tiny is case and plan is not None else _plan(tiny, adapter)
            measured, note = retained_ops_per_block(tiny, tiny_plan, retained), "measured on the tiny config's forward"
        except Exception as exc:
            note = f"not measured: the tiny forward failed: {exc!r}"
    console.print(escape(f"  ops keeps per block ({note}):"))
    for line in _per_block_lines(model, measured):
        console.print(f"    {line}")


def _print_backends(console: Console, adapter: AdapterSpec) -> None:
    console.print("[bold]attention backends[/]")
    if not adapter.backends:
        console.print("  none declared: 'ops' keeps PyTorch's SDPA kernels only")
    for backend in adapter.backends:
        default = " (default)" if backend.name == adapter.default_backend else ""
        here = [d for d in ("cpu", "cuda") if backend.is_available(d) and (d != "cuda" or torch.cuda.is_available())]
        runs = f"runs here on {', '.join(here)}" if here else "does not run here"
        if backend.retainable:
            ops = escape(", ".join(backend.ops))
            console.print(f"  {escape(backend.name + default)}: [green]retainable[/], {runs}; ops: {ops}")
        else:
            reason = escape(backend.not_retainable or "")
            console.print(f"  {escape(backend.name + default)}: [yellow]not retainable[/], {runs}: {reason}")


def inspect_adapter(console: Console, adapter: AdapterSpec, models: list[ModelSpec], preset: str) -> None:
    """Print what ``adapter`` declares for ``models`` and what the built models show."""
    console.rule(f"[bold]{escape(adapter.name)}[/]")
    missing = missing_library(adapter)
    if adapter.library:
        console.print(escape(f"library: {adapter.library}" + (f" (extra: {adapter.extra})" if adapter.extra else "")))
    for requirement in adapter.requirements:
        console.print(escape(f"training requires: {requirement}"))
    if missing:
        console.print(f"[yellow]skipped[/]: {escape(missing)}")
        for model in models:
            declared = escape(", ".join(model.containers))
            console.print(f"[bold]{escape(model.class_name)}[/]: block containers (declared) {declared}")
    else:
        retained = DEFAULT_RETAINED_OPS | adapter.retained_ops()
        for model in models:
            _print_model(console, adapter, model, preset, retained)
    _print_backends(console, adapter)


def _select(target: str) -> list[tuple[AdapterSpec, list[ModelSpec] | None]]:
    """(adapter, model classes or None for all of them) named by ``target``."""
    known = known_adapters()
    if target == "all" or target in known or ":" in target or "," in target:
        if target == "all" and not registered_adapters():
            raise CLIError("no adapter is registered: install ours with pip install 'ac-core[all]', or inspect 'toy'")
        return [(adapter, None) for adapter in select_adapters(target)]
    matches: list[tuple[AdapterSpec, list[ModelSpec] | None]] = [
        (adapter, [m]) for adapter in known.values() for m in adapter.models if target in (m.class_name, m.cls)
    ]
    if not matches:
        classes = sorted({m.class_name for a in known.values() for m in a.models})
        raise CLIError(
            f"unknown adapter or model class {target!r}; adapters: all, {', '.join(sorted(known))}; "
            f"model classes: {', '.join(classes)}"
        )
    return matches


def run(args: argparse.Namespace) -> int:
    selected = _select(args.target)
    valid = presets_of(adapter for adapter, _ in selected)
    if args.preset not in valid:
        raise CLIError(f"unknown preset {args.preset!r}; valid values: {', '.join(valid)}")
    console = stdout()
    for adapter, models in selected:
        chosen = list(adapter.models) if models is None else models
        if args.preset != TINY:
            chosen = [m for m in chosen if args.preset in m.presets]
        if chosen:
            inspect_adapter(console, adapter, chosen, args.preset)
    return 0


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="show an adapter's block containers, attention backends and retained ops",
        description=(
            "For each model class the adapter serves: its block containers and block counts (of the tiny config, "
            "or of a named preset built on the meta device), excluded containers and why, attention backends and "
            "whether 'ops' can retain them, the op names 'ops' keeps per block (measured on one forward of the "
            "tiny config), and whether the installed library version is supported."
        ),
    )
    parser.add_argument("target", nargs="?", default="all", help="adapter (family) name, model class name, or 'all'")
    parser.add_argument("--preset", default=TINY, help="'tiny' (default) or a named preset, e.g. flux.1-dev")
    parser.set_defaults(run=run, command_name=parser.prog.split()[-1])
