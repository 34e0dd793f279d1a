"""Which nodes of a joint forward+backward graph belong to its forward part."""

from __future__ import annotations

import operator

from torch import fx

# AOTAutograd tags what it traced for backward; tangents and backward RNG seeds are its inputs.
_BACKWARD_TAGS = ("is_backward", "must_be_in_backward")
_BACKWARD_INPUTS = ("tangents", "bwd_seed", "bwd_base_offset")


def is_backward_input(node: fx.Node) -> bool:
    """Whether ``node`` is a tangent or backward-seed placeholder: an input of the backward part."""
    return node.op == "placeholder" and any(marker in str(node.target) for marker in _BACKWARD_INPUTS)


def _starts_backward(node: fx.Node) -> bool:
    return is_backward_input(node) or node.meta.get("partitioner_tag") in _BACKWARD_TAGS


def forward_ops(graph: fx.Graph, *, include_getitem: bool = False) -> list[fx.Node]:
    """The ``call_function`` nodes of ``graph``'s forward part, in graph order.

    A node is backward when it is a tangent (``tangents_*``) or backward-seed placeholder, when
    AOTAutograd tagged it as traced for backward, or when it depends on such a node; every other
    node is forward. A graph without tangents (a forward-only or hand-built graph) is all forward.
    ``operator.getitem`` nodes are left out unless ``include_getitem``.
    """
    backward: set[fx.Node] = set()
    result: list[fx.Node] = []
    for node in graph.nodes:  # topological order: inputs come first
        if _starts_backward(node) or any(arg in backward for arg in node.all_input_nodes):
            backward.add(node)
            continue
        if node.op == "call_function" and (include_getitem or node.target is not operator.getitem):
            result.append(node)
    return result
