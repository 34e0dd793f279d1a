"""The SAC pass in the shape inductor's ``joint_custom_post_pass`` option takes.

Imported only by :func:`ac_core.compile`: importing inductor's pass types costs about a second.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from .sac import apply_sac_pass
from .save_ops import op_name

_SOURCES = tuple(sorted(Path(__file__).parent.glob("*.py")))


def _describe(op: object) -> str:
    if isinstance(op, str):
        return op
    return op_name(op) or f"{getattr(op, '__module__', '')}.{getattr(op, '__qualname__', repr(op))}"


class SACGraphPass(CustomGraphPass):
    """Runs :func:`ac_core.apply_sac_pass` on the joint graph, after inductor's own joint passes.

    After them, not before: inductor's pattern matcher replaces nodes (and turns random ops into
    its seed ops) without carrying their tags. ``uuid()`` hashes this package's sources, the save
    set, the blocks and the modules outside them, so inductor's and AOTAutograd's caches never serve
    a graph partitioned another way.
    """

    def __init__(
        self,
        retain: frozenset[object],
        blocks: frozenset[str] | None = None,
        outside_modules: frozenset[str] | None = None,
    ) -> None:
        self.retain = retain
        self.blocks = blocks
        self.outside_modules = outside_modules

    def __call__(self, graph: fx.Graph) -> None:
        assert graph.owning_module is not None, "inductor passes the joint graph of a GraphModule"
        apply_sac_pass(graph.owning_module, self.retain, blocks=self.blocks, outside_modules=self.outside_modules)

    def uuid(self) -> str:
        digest = hashlib.sha256()
        for source in _SOURCES:
            digest.update(source.read_bytes())
        digest.update("\n".join(sorted(_describe(op) for op in self.retain)).encode())
        for names in (self.blocks, self.outside_modules):
            digest.update(repr(None if names is None else sorted(names)).encode())
        return digest.hexdigest()
