"""The layout of core/: no import cycle, no import of a higher layer, no subpackage's private module used outside it.

Every import counts, lazy ones inside functions too; only ``if TYPE_CHECKING:`` blocks (never run) are left out.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from pathlib import Path

import ac_core

ROOT = Path(ac_core.__file__).parent

# Lowest first. A module is in the layer of the longest prefix listed for it; it may import its own layer and
# those below. What each layer is for, in order: plain values and messages; the model and op descriptions the rest
# read (the adapter contract, container shapes, op rules); what the model libraries declare and do (with the
# adapters derived from their declarations); finding a model's adapter and resolving its blocks; the machinery
# that checkpoints and offloads a forward; the policies and the verb; the torch.compile route; the instruments;
# the planner; what users run (the command, experiments, test helpers) and the package's front.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "warnings", "refs", "units", "collectives", "op_names", "unwrap", "_deprecated", "_module_ref"),
    ("versions", "spec", "containers", "ops", "_sac", "_recompute", "_conflicts", "policies.modes"),
    ("libraries",),
    ("registry", "blocks", "coverage"),
    ("_chain", "_checkpoint", "offload"),
    ("policies", "checkpointing"),
    ("graph",),
    ("measure",),
    ("budget",),
    ("experiments", "cli", "testing", "offload.testing", ""),
)


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> Iterator[str]:
    """The ac_core modules ``name`` imports (relative to the package, ``""`` for the package itself)."""
    tree = ast.parse(path.read_text())
    skipped = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    package = [p for p in package if p]
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names if a.name.split(".")[0] == "ac_core"]
            yield from (t.removeprefix("ac_core").lstrip(".") for t in targets)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] + ([node.module] if node.module else [])
            elif node.module and node.module.split(".")[0] == "ac_core":
                base = node.module.split(".")[1:]
            else:
                continue
            module = ".".join(base)
            subs = [f"{module}.{a.name}".lstrip(".") for a in node.names]
            named = [s for s in subs if s in MODULES]
            yield from named
            if len(named) < len(subs):
                yield module


def _graph() -> dict[str, set[str]]:
    return {name: {t for t in _imports(name, path) if t in MODULES and t != name} for name, path in MODULES.items()}


def _layer(name: str) -> int:
    best, layer = -1, None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(f"{prefix}.") or prefix == "") and len(prefix) > best:
                best, layer = len(prefix), index
    assert layer is not None, f"ac_core.{name} is in no layer of LAYERS"
    return layer


def _package_of(name: str) -> str:
    return name.rpartition(".")[0]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    counter = itertools.count()

    def visit(v: str) -> None:
        index[v] = low[v] = next(counter)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer_and_the_parser_sees_imports():
    graph = _graph()
    assert {_layer(name) for name in MODULES} == set(range(len(LAYERS)))
    # The parser reads relative, absolute and lazy imports: the verb's, and graph.route's lazy one of _inductor.
    assert {"blocks", "policies", "libraries.checkpointing"} <= graph["checkpointing"]
    assert "graph._inductor" in graph["graph.route"]


def test_no_import_cycle():
    assert _cycles(_graph()) == []


def test_no_import_of_a_higher_layer():
    upward = [
        f"ac_core.{name} (layer {_layer(name)}) imports ac_core.{target} (layer {_layer(target)})"
        for name, targets in _graph().items()
        for target in targets
        if _layer(target) > _layer(name)
    ]
    assert upward == []


def test_private_modules_of_a_subpackage_are_used_inside_it_only():
    leaks = [
        f"ac_core.{name} imports ac_core.{target}"
        for name, targets in _graph().items()
        for target in targets
        if "." in target
        and target.rpartition(".")[2].startswith("_")
        and not (name == _package_of(target) or name.startswith(f"{_package_of(target)}."))
    ]
    assert leaks == []


def test_the_checker_finds_a_cycle_and_an_upward_import():
    graph = {"a": {"b"}, "b": {"a"}, "c": set()}
    assert _cycles(graph) == [["a", "b"]]
    assert _layer("budget.planner") > _layer("graph.route") > _layer("checkpointing") > _layer("_chain")
