"""Hand-built joint graphs for the pass tests."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

SAVE = CheckpointPolicy.MUST_SAVE
RECOMPUTE = CheckpointPolicy.PREFER_RECOMPUTE


class GraphBuilder:
    """Builds an fx graph node by node, each with a fake value and, optionally, a module stack."""

    def __init__(self, inputs: Sequence[str] = ("primals_1", "primals_2")) -> None:
        self.graph = fx.Graph()
        self.inputs = {name: self.graph.placeholder(name) for name in inputs}

    def op(self, target, *args: fx.Node, stack: Sequence[tuple[str, str]] | None = None, val=None) -> fx.Node:
        """A call_function node; ``stack`` lists (module path, class name), outermost first, as dynamo records."""
        node = self.graph.call_function(target, args=args)
        if stack is not None:
            node.meta["nn_module_stack"] = {f"L__self___{path}": (f"L['self'].{path}", cls) for path, cls in stack}
        node.meta["val"] = torch.empty(2, 2) if val is None else val
        return node

    def getitem(self, node: fx.Node, index: int) -> fx.Node:
        item = self.graph.call_function(operator.getitem, args=(node, index))
        if "nn_module_stack" in node.meta:
            item.meta["nn_module_stack"] = node.meta["nn_module_stack"]
        item.meta["val"] = torch.empty(2, 2)
        return item

    def module(self, *outputs: fx.Node) -> fx.GraphModule:
        self.graph.output(outputs)
        return fx.GraphModule(torch.nn.Module(), self.graph)


def policy(node: fx.Node):
    return node.meta.get("recompute")
