"""docs/api.md documents every name ``ac_core`` exports exactly once, each under one of its groups, and no name
that ac-core lacks; ``ac_core.measure``'s names sit under "measurement" and ``ac_core.testing``'s under "testing".

An entry is a line starting with ``- `name``: a root name (``apply_activation_checkpointing(...)``) or a name
public in a submodule, written with its module (``ac_core.measure.measure_step(...)``).
"""

from __future__ import annotations

import ast
import importlib
import re
import warnings
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest

import ac_core
import ac_core.measure
import ac_core.testing

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
GROUPS = ("apply", "policies", "plans", "compile", "offload", "adapters", "measurement", "testing")
_HEADING = re.compile(r"^## (.+)$")
_ENTRY = re.compile(r"^- `([A-Za-z_][\w.]*)")


def entries(text: str) -> list[tuple[str | None, str]]:
    """(the ``## `` heading above it, name) of every entry of ``text``, in order."""
    heading: str | None = None
    found: list[tuple[str | None, str]] = []
    for line in text.splitlines():
        if match := _HEADING.match(line):
            heading = match.group(1).strip()
        elif match := _ENTRY.match(line):
            found.append((heading, match.group(1)))
    return found


def _public_names(module: ModuleType) -> set[str]:
    """``module.__all__``, or for a module without one (``ac_core.testing``) the names its top level defines."""
    if hasattr(module, "__all__"):
        return set(module.__all__)
    assert module.__file__ is not None
    names: set[str] = set()
    for node in ast.parse(Path(module.__file__).read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(target.id for target in targets if isinstance(target, ast.Name))
    return {name for name in names if not name.startswith("_")}


def _resolve(dotted: str) -> tuple[ModuleType, str]:
    """The module and attribute name of ``ac_core.module.name``."""
    module, _, name = dotted.rpartition(".")
    return importlib.import_module(module), name


DOCUMENTED = entries(DOC.read_text())
BY_GROUP = {(group, name) for group, name in DOCUMENTED}


def test_the_page_has_entries_in_every_group():
    groups = Counter(group for group, _ in DOCUMENTED)
    assert all(groups[group] >= 3 for group in GROUPS), groups
    assert len(DOCUMENTED) > len(ac_core.__all__)


def test_every_exported_name_is_documented_once():
    counts = Counter(name for _, name in DOCUMENTED)
    assert [name for name in ac_core.__all__ if counts[name] != 1] == []


def test_each_entry_sits_under_one_of_the_groups():
    assert [(group, name) for group, name in DOCUMENTED if group not in GROUPS] == []


def test_documents_only_names_ac_core_exports():
    root = set(ac_core.__all__)
    root_objects = [getattr(ac_core, name) for name in root]
    unknown: list[str] = []
    for _, name in DOCUMENTED:
        if "." not in name:
            if name not in root:
                unknown.append(name)
            continue
        assert name.startswith("ac_core."), name
        module, attribute = _resolve(name)
        if attribute not in _public_names(module):
            unknown.append(name)
        elif any(getattr(module, attribute) is obj for obj in root_objects):
            unknown.append(f"{name} (exported from the root: document it once, by its root name)")
    assert unknown == []
    assert len({name for _, name in DOCUMENTED}) == len(DOCUMENTED)


def test_the_measure_names_are_documented_under_measurement():
    missing = [
        name
        for name in ac_core.measure.__all__
        if ("measurement", f"ac_core.measure.{name}") not in BY_GROUP and ("measurement", name) not in BY_GROUP
    ]
    assert missing == []


def test_the_testing_names_are_documented_under_testing():
    names = _public_names(ac_core.testing)
    assert {"make_case", "toy_case", "TOY_ADAPTER"} <= names
    assert sorted(name for name in names if ("testing", f"ac_core.testing.{name}") not in BY_GROUP) == []


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("## apply\n- `x(a) -> b`: y\n  - `z`: a continuation is no entry\n", [("apply", "x")]),
        ("intro\n- `ac_core.measure.m(case)`\n## plans\n", [(None, "ac_core.measure.m")]),
        ("## Old names\nprose naming `ac_core.BlockPlan`\n- plain bullet\n", []),
    ],
)
def test_the_parser_reads_entries_and_their_group(text, found):
    assert entries(text) == found


@pytest.mark.parametrize(
    ("name", "home"),
    [("unregister_adapter", "ac_core.registry"), ("unregister_policy", "ac_core.policies")],
)
def test_names_moved_off_the_root_still_work_with_a_warning(name, home):
    assert name not in ac_core.__all__
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert getattr(ac_core, name) is getattr(importlib.import_module(home), name)
    assert [(w.category, str(w.message)) for w in caught] == [
        (DeprecationWarning, f"ac_core.{name} is deprecated; use {home}.{name}")
    ]
