"""``ac-core inspect``: what an adapter declares about its models, checked against the models themselves."""

from __future__ import annotations

import argparse
import functools
import sys
from collections import Counter
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from torch import nn

from ..blocks import ModelBlocks, resolve_blocks
from ..errors import AdapterError
from ..libraries.route import Refusal, derive_adapter
from ..measure import op_matches
from ..ops import DEFAULT_RETAINED_OPS
from ..refs import load_ref
from ..registry import registered_adapters
from ..spec import AdapterSpec, ModelCase, ModelSpec, class_path
from ._common import (
    NOTICE_LIBRARIES,
    TINY,
    CLIError,
    build_case,
    known_adapters,
    library_notices_silenced,
    missing_library,
    presets_of,
    select_adapters,
    stdout,
    version_status,
)
from .draft import DraftError, Findings, TensorInput, draft_source, inspect_class, load_config, token_line
from .op_counts import block_op_counts


def retained_ops_per_block(case: ModelCase, plan: ModelBlocks, retained: frozenset[str]) -> dict[str, dict[str, float]]:
    """Block class -> {op name: calls per block forward} of the ops ``ops`` retains, from forwards of ``case``,
    averaged over the blocks of the class that ran."""
    counts, ran = block_op_counts(
        {block.path: block.module for block in plan}, case.run, functools.partial(op_matches, names=retained)
    )
    runs = Counter(block.class_name for block in plan if block.path in ran)
    kept: dict[str, Counter[str]] = {kind: Counter() for kind in runs}
    for block in plan:
        if block.path in ran:
            kept[block.class_name].update(counts[block.path])
    return {kind: {op: n / runs[kind] for op, n in sorted(kept[kind].items())} for kind in runs}


def _container_lines(plan: ModelBlocks) -> list[str]:
    lines = []
    for container in plan.containers:
        kinds = ", ".join(Counter(block.class_name for block in container.blocks))
        blocks = f"{len(container.blocks)} x {kinds}" if container.blocks else "empty"
        lines.append(escape(f"{container.path}: {blocks}"))
    return lines


def _excluded_lines(plan: ModelBlocks | None, model: ModelSpec) -> list[str]:
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
        if declared is not None and not isinstance(declared, int):
            declared = "by block index " + ", ".join(f"{i}: {n}" for i, n in sorted(declared.items())) + ","
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


def _plan(case: ModelCase, adapter: AdapterSpec) -> ModelBlocks:
    # The library version gets its own line, supported or not: it does not stop the inspection.
    return resolve_blocks(case.model, adapter, check_versions=False)


def _print_model(
    console: Console, adapter: AdapterSpec, model: ModelSpec, preset: str, retained: frozenset[str]
) -> None:
    console.print(f"[bold]{escape(adapter.model_label(model))}[/]  " + escape(f"({model.cls})"))
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
        example = target if target[:1].isupper() else "SD3Transformer2DModel"
        classes = sorted({m.class_name for a in known.values() for m in a.models})
        raise CLIError(
            f"unknown adapter or model class {target!r}; adapters: all, {', '.join(sorted(known))}; "
            f"model classes: {', '.join(classes)}. For a class no adapter serves, name its module: "
            f"ac-core inspect module:Class (e.g. diffusers:{example})"
        )
    return matches


def _model_class(target: str) -> type | None:
    """The nn.Module class ``module:Class`` names, or None where ``target`` is no such reference."""
    if ":" not in target or "," in target:
        return None
    try:
        obj = load_ref(target, what="adapter or model class")
    except AdapterError as exc:
        raise CLIError(str(exc)) from None
    return obj if isinstance(obj, type) and issubclass(obj, nn.Module) else None


def _serving(cls: type) -> list[str]:
    return sorted(name for name, adapter in known_adapters().items() if adapter.serves(cls))


def _library_route(model: nn.Module) -> ModelBlocks | Refusal | None:
    """The blocks the library route finds in ``model``, why it finds none, or None for a model of no such library."""
    routed = derive_adapter(model)
    return resolve_blocks(model, routed, check_versions=False) if isinstance(routed, AdapterSpec) else routed


def _print_route(console: Console, route: ModelBlocks | Refusal | None) -> None:
    if isinstance(route, ModelBlocks):
        console.print(
            escape(f"served by {route.source}: derived from what the class declares, no adapter needed; block ")
            + "containers (tiny config):"
        )
        for line in _container_lines(route):
            console.print(f"  {line}")
        assert route.model_spec is not None
        console.print("  excluded containers:")
        for line in _excluded_lines(route, route.model_spec):
            console.print(f"    {line}")
        console.print("an adapter of its own would declare what follows ([bold]--draft[/] prints it as Python)")
        return
    if route is not None:
        console.print(escape(f"the {route.library} library route does not serve it: {route.reason}"))
    console.print("no adapter serves it: this is what one must declare ([bold]--draft[/] prints it as Python)")


def _print_findings(
    console: Console, findings: Findings, serving: list[str], route: ModelBlocks | Refusal | None
) -> None:
    cls = findings.cls
    console.rule(f"[bold]{escape(cls.__name__)}[/]")
    console.print(escape(f"class: {class_path(cls)}"))
    if serving:
        console.print(escape(f"served by adapter(s) {', '.join(serving)}: ac-core inspect {serving[0]}"))
    else:
        _print_route(console, route)
    if findings.factory_ref is not None:
        console.print(escape(f"tiny model: built by {findings.factory_ref}"))
    else:
        console.print(
            escape(f"tiny config: {findings.config}") + " (derived from the class's defaults; --config overrides)"
        )
    if findings.inputs is None:
        console.print(escape(f"inputs: from {findings.inputs_ref}"))
    else:
        shown = ", ".join(
            f"{k} {tuple(v.shape) if v.kind != 'tensor' else list(v.values)}"
            if isinstance(v, TensorInput)
            else f"{k}={v!r}"
            for k, v in findings.inputs.items()
        )
        console.print(escape(f"inputs (probed from forward's signature): {shown}"))
    console.print("block containers (ModuleLists, ModuleDicts, Sequentials of repeated blocks):")
    for path, blocks in findings.containers.items():
        console.print(escape(f"  {path}: {blocks}"))
    if findings.declared_blocks:
        console.print(
            escape(
                f"  the model names its blocks (_no_split_modules / _repeated_blocks): "
                f"{', '.join(sorted(findings.declared_blocks))}"
            )
        )
    for fqn, where in findings.uncovered.items():
        console.print("  [red]not covered[/]: " + escape(f"{fqn} ({where}): add it to containers or excluded"))
    if findings.tokens is not None:
        console.print(escape(f"tokens per forward: {token_line(findings.tokens)}"))
    console.print("attention calls per block forward (measured on the tiny model):")
    for kind, calls in findings.attention_calls.items():
        ops = escape(", ".join(f"{op} x{n:g}" for op, n in findings.ops_per_block.get(kind, {}).items()) or "none")
        if isinstance(calls, int):
            console.print(escape(f"  {kind}: {calls} call(s)") + f"; ran {ops} per block")
        else:
            per_index = ", ".join(f"{i}: {n}" for i, n in calls.items())
            console.print(
                escape(f"  {kind}: differs by block, index -> calls {per_index}") + f"; ran {ops} per block on average"
            )
        others = findings.other_attention_ops.get(kind)
        if others:
            console.print(escape(f"    also ran attention-like ops no backend retains: {', '.join(others)}"))
    console.print("attention backends:")
    if findings.family == "transformers":
        console.print(
            "  transformers' attn_implementation values: ac_core.libraries.transformers.BACKENDS, default sdpa"
        )
    elif findings.dispatcher is None:
        console.print(
            "  no backend switch found: declare the SDPA kernels it runs (DEFAULT_RETAINED_OPS) as the default"
        )
    else:
        if findings.dispatcher:
            console.print(
                "  its processors go through diffusers' attention dispatcher: declare "
                "ac_core.libraries.diffusers.attention_backends() with set_attention_backend, default 'native'"
            )
        else:
            console.print(
                "  its processors call SDPA themselves: diffusers' backend setting does not reach them (the math "
                "backend still ran a fused kernel); declare 'sdpa' with DEFAULT_RETAINED_OPS as the only backend, "
                "or switch processors in your own set_backend"
            )
        for name, ops in findings.backends.items():
            reached = escape(", ".join(ops)) if ops else "[yellow]no retainable op[/]"
            console.print(f"  {escape(name)} (tried on CPU): {reached}")


def _inspect_class(args: argparse.Namespace, cls: type) -> int:
    try:
        with library_notices_silenced(NOTICE_LIBRARIES):
            findings, case = inspect_class(
                args.target, config=load_config(args.config), inputs_ref=args.inputs, factory_ref=args.factory
            )
    except (DraftError, AdapterError) as exc:
        raise CLIError(str(exc)) from None
    if args.draft:
        sys.stdout.write(draft_source(findings))
        return 0
    serving = _serving(cls)
    _print_findings(stdout(), findings, serving, None if serving else _library_route(case.model))
    return 0


def run(args: argparse.Namespace) -> int:
    cls = _model_class(args.target)
    if cls is not None:
        return _inspect_class(args, cls)
    options = (
        ("--draft", args.draft),
        ("--config", args.config),
        ("--inputs", args.inputs),
        ("--factory", args.factory),
    )
    given = [flag for flag, value in options if value]
    if given:
        raise CLIError(
            f"{' and '.join(given)} only work with a model class, e.g. ac-core inspect diffusers:SD3Transformer2DModel"
        )
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
            "tiny config), and whether the installed library version is supported. Given module:Class of a model "
            "class no adapter serves, it builds the class tiny, says whether the diffusers or transformers library "
            "route serves it (and its blocks) or why not, and prints what an adapter must declare: block "
            "containers, attention calls per block, the attention backends it can switch to; --draft prints the "
            "AdapterSpec to save and check with the conformance suite."
        ),
    )
    parser.add_argument(
        "target",
        nargs="?",
        default="all",
        help="adapter (family) name, model class name, 'all', or module:Class of a model class no adapter serves "
        "(e.g. diffusers:SD3Transformer2DModel): built tiny, it shows what an adapter must declare",
    )
    parser.add_argument(
        "--draft", action="store_true", help="with module:Class: print a draft AdapterSpec (a Python module) instead"
    )
    parser.add_argument(
        "--config",
        help="with module:Class: tiny config as a JSON object (or @file.json), over the one derived from the defaults",
    )
    parser.add_argument(
        "--inputs",
        metavar="MODULE:FUNCTION",
        help="with module:Class: a function(model) returning forward's keyword arguments, where probing fails",
    )
    parser.add_argument(
        "--factory",
        metavar="MODULE:FUNCTION",
        help="with module:Class: a function returning the built tiny model, for a constructor that takes a config "
        "object (instead of --config)",
    )
    parser.add_argument("--preset", default=TINY, help="'tiny' (default) or a named preset, e.g. flux.1-dev")
    parser.set_defaults(run=run, command_name=parser.prog.split()[-1])
