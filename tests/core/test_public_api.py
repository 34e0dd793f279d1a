"""The conformance suite and the adapters use only ac-core's public API: no ``ac_core._*`` module, no ``_name``
imported from ac-core, no ``_attribute`` read (or patched) on an ac-core module or object they imported.

Third parties copy both; anything private they use would break them on a refactor of core.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("conformance", "adapters")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_ac_core(module: str) -> bool:
    return module == "ac_core" or module.startswith("ac_core.")


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def private_uses(source: str, filename: str = "<string>") -> list[str]:
    """``file:line: what`` for every use of ac-core's private names in ``source``."""
    tree = ast.parse(source, filename)
    problems: list[str] = []
    aliases: set[str] = set()  # local names bound to an ac_core module or to an object imported from one

    def report(node: ast.AST, what: str) -> None:
        problems.append(f"{filename}:{getattr(node, 'lineno', '?')}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_ac_core(alias.name):
                    if any(_private(part) for part in alias.name.split(".")):
                        report(node, f"imports private module {alias.name}")
                    aliases.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _is_ac_core(node.module):
            if any(_private(part) for part in node.module.split(".")):
                report(node, f"imports from private module {node.module}")
            for alias in node.names:
                if _private(alias.name):
                    report(node, f"imports private name {alias.name} from {node.module}")
                aliases.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and _root_name(node.value) in aliases:
            report(node, f"uses private attribute {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and _patches_private(node, aliases):
            report(node, f"reaches a private name by string: {ast.unparse(node)}")
    return problems


def _patches_private(call: ast.Call, aliases: set[str]) -> bool:
    """``getattr(ac_core_thing, "_x")``, ``setattr(...)``, ``monkeypatch.setattr(ac_core_thing, "_x", ...)``, and
    ``monkeypatch.setattr("ac_core.mod._x", ...)``."""
    args = call.args
    strings = [a.value for a in args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    if any(_is_ac_core(s) and any(_private(part) for part in s.split(".")) for s in strings):
        return True
    name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", None)
    if name not in ("getattr", "setattr", "delattr", "hasattr") or len(args) < 2:
        return False
    target, attribute = args[0], args[1]
    return (
        _root_name(target) in aliases
        and isinstance(attribute, ast.Constant)
        and isinstance(attribute.value, str)
        and _private(attribute.value)
    )


def _files() -> list[Path]:
    return sorted(path for folder in CHECKED for path in (ROOT / folder).rglob("*.py"))


def test_the_checked_folders_have_python_files():
    assert len(_files()) > 10


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_uses_only_public_ac_core(path):
    assert private_uses(path.read_text(), str(path.relative_to(ROOT))) == []


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("import ac_core._versions", "imports private module ac_core._versions"),
        ("import ac_core.offload._pool as pool", "imports private module ac_core.offload._pool"),
        ("from ac_core._containers import resolve_containers", "imports from private module ac_core._containers"),
        ("from ac_core.ops import _policy", "imports private name _policy from ac_core.ops"),
        ("from ac_core import _versions", "imports private name _versions from ac_core"),
        ("from ac_core import ops\nops._reset_warnings()", "uses private attribute ops._reset_warnings"),
        ("import ac_core\nac_core.ops._policy = None", "uses private attribute ac_core.ops._policy"),
        ("import ac_core.ops as o\nx = o.selective._cache", "uses private attribute o.selective._cache"),
        ("from ac_core import TOY as t\nt._fields", "uses private attribute t._fields"),
        ("from ac_core import ops\nsetattr(ops, '_policy', None)", "reaches a private name by string"),
        ("def f(monkeypatch):\n    monkeypatch.setattr('ac_core.ops._policy', 1)", "reaches a private name by string"),
    ],
)
def test_the_checker_finds_private_uses(source, found):
    problems = private_uses(source)
    assert len(problems) == 1 and found in problems[0], problems


@pytest.mark.parametrize(
    "source",
    [
        "import ac_core\nac_core.resolve_blocks\nac_core.__version__",
        "from ac_core.ops import is_attention_like",
        "from ac_core_adapters._models import x\nfrom ._local import y",  # not ac_core
        "import torch\ntorch._dynamo.reset()",  # torch's private names are torch's business
        "from ac_core import ModelCase\ncase = ModelCase\nother._x",  # not reached through an ac_core name
    ],
)
def test_the_checker_passes_public_uses(source):
    assert private_uses(source) == []
