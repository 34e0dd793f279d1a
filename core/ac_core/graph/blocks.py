"""Which block of the model each forward node ran in, read from ``node.meta["nn_module_stack"]``."""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence

from torch import fx

# Dynamo spells module paths as Python expressions rooted at the compiled function's argument:
# "L['self'].layers.0", "L['self'].__dict__['_modules']['blocks'].1.attn", "getattr(L['self'].x, '0')".
# A ModuleDict's key follows a dot as it is, whatever its characters ("L['self'].layers.my-key").
_SEGMENT = re.compile(r"\[\s*'([^']*)'\s*\]|\[\s*\"([^\"]*)\"\s*\]|\[\s*(\d+)\s*\]|\.([^.\[\]]+)")
_NOT_SEGMENTS = {"__dict__", "_modules"}
_ROOT = re.compile(r"^\s*L\[\s*['\"][^'\"]*['\"]\s*\](\[\s*\d+\s*\])?")


def module_path(expression: str) -> str:
    """The dotted module path (``"layers.0.attn"``) of a dynamo module expression; ``""`` for the root."""
    expression = re.sub(r"getattr\((.*?),\s*'([^']*)'\)", r"\1.\2", expression)
    # The root is the compiled function's argument: L['self'], or L['args'][0] behind a wrapper.
    expression = _ROOT.sub("", expression, count=1)
    segments = [next(g for g in match.groups() if g is not None) for match in _SEGMENT.finditer(expression)]
    return ".".join(s for s in segments if s not in _NOT_SEGMENTS)


def _stack(node: fx.Node) -> list[tuple[str, str]]:
    """(module path, class name) of each module on the node's stack, outermost first."""
    entries = []
    for value in (node.meta.get("nn_module_stack") or {}).values():
        path, cls = (value[0], value[1]) if isinstance(value, (tuple, list)) else (str(value), "")
        entries.append((module_path(str(path)), str(getattr(cls, "__qualname__", cls))))
    return entries


def _candidates(entries: list[tuple[str, str]]) -> list[tuple[str, str, str]]:
    """(container, block path, class) for entries that are items of a container the parent indexes."""
    paths = {path for path, _ in entries}
    found = []
    for path, cls in entries:  # outermost first
        container, _, index = path.rpartition(".")
        # A Sequential is called itself, so it is on the stack; a ModuleList/ModuleDict is only indexed.
        if index.isdigit() and container not in paths:
            found.append((container, path, cls))
    return found


def _named_block(entries: list[tuple[str, str]], blocks: frozenset[str]) -> str | None:
    for path, _ in entries:  # outermost first
        segments = path.split(".")
        # A suffix match serves a model compiled inside a wrapper ("model.layers.0" for "layers.0").
        if any(".".join(segments[i:]) in blocks for i in range(len(segments))):
            return path
    return None


def call_number(node: fx.Node, path: str) -> int:
    """Which call of the module at ``path`` (0 for the first) ``node`` ran in: dynamo keys a module's later calls
    in one forward with ``@1``, ``@2`` ... on its ``nn_module_stack`` entry."""
    for key, value in (node.meta.get("nn_module_stack") or {}).items():
        expression = value[0] if isinstance(value, (tuple, list)) else value
        if module_path(str(expression)) == path:
            _, at, number = str(key).rpartition("@")
            return int(number) if at and number.isdigit() else 0
    return 0


def ran_in_any(nodes: Sequence[fx.Node], modules: Collection[str]) -> bool:
    """Whether any of ``nodes`` ran inside one of ``modules`` (FQNs, matched as named blocks are)."""
    named = frozenset(modules)
    return any(_named_block(_stack(node), named) is not None for node in nodes)


def block_regions(nodes: Sequence[fx.Node], blocks: Collection[str] | None = None) -> dict[fx.Node, str | None]:
    """Map each node to the module path of the block it ran in, or None outside every block.

    ``blocks`` are the blocks' FQNs (from an adapter's containers, say). Without them a block is an
    item under a numeric key of a module container (ModuleList, ModuleDict of lists or of blocks, as
    torchtitan's ``layers``) that its parent's forward indexes rather than calls, holding at least two
    items seen here, all of one class: a transformer's ``layers.3``, not the mixed ``ff.net.0`` (a GELU
    beside a Linear) nor the lone ``to_out.0``. The outermost such module on a node's stack is its block.
    A node without a module stack ran in the compiled module's own code (a loss computed in ``forward``,
    say): outside every block.
    """
    stacks = {node: _stack(node) for node in nodes}
    if blocks is not None:
        named = frozenset(blocks)
        return {node: _named_block(entries, named) for node, entries in stacks.items()}
    items: dict[str, dict[str, str]] = {}
    for entries in stacks.values():
        for container, path, cls in _candidates(entries):
            items.setdefault(container, {})[path] = cls
    uniform = {c for c, seen in items.items() if len(seen) >= 2 and len(set(seen.values())) == 1}
    return {
        node: next((path for container, path, _ in _candidates(entries) if container in uniform), None)
        for node, entries in stacks.items()
    }
