"""Pass: save every forward value that crosses a block boundary, as eager checkpointing does."""

from __future__ import annotations

import operator
from collections.abc import Collection

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from .blocks import block_regions
from .forward_part import forward_ops
from .save_outside_blocks import costs_flops


def free_to_recompute(node: fx.Node) -> bool:
    """Whether recomputing ``node`` runs no matmul, convolution or attention and draws no random numbers."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    return not costs_flops(node) and torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ())


def save_block_outputs(
    graph: fx.Graph, blocks: Collection[str] | None = None, *, derive: bool = False, outside: bool = False
) -> int:
    """Tag MUST_SAVE each forward op whose tensor output is used in another block than its own.

    Blocks are ``blocks`` (FQNs) or found from ``nn_module_stack`` (see blocks.py); code outside
    every block is one more region. Eager per-block checkpointing keeps each block's inputs, so
    without this the compiled route could recompute a whole chain of blocks back to the last saved
    op and recompute more than eager ``ops`` does. A value read through ``getitem`` saves the op
    that produced it. ``derive``: leave recomputable a value the graph computes again from saved
    values (tagged MUST_SAVE, or saved here) and graph inputs by ops without FLOPs (a residual stream
    summed from kept outputs): the partitioner then keeps it or its parts, whichever holds fewer bytes,
    and no block's recompute runs another block's matmuls either way. ``outside``: any op outside the blocks that
    draws no random numbers counts as free too (the code outside recomputed whole). Returns the number of ops
    tagged.
    """
    nodes = forward_ops(graph, include_getitem=True)
    forward = set(nodes)
    regions = block_regions(nodes, blocks)
    crossing: set[fx.Node] = set()
    for node in nodes:
        if not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        if any(user in forward and regions[user] != regions[node] for user in node.users):
            producer = node.args[0] if node.target is operator.getitem else node
            if isinstance(producer, fx.Node):
                crossing.add(producer)
    # Graph order: inputs first, so each value's derivability is known from its inputs', saved ones included.
    derivable: dict[fx.Node, bool] = {}
    tagged = 0
    for node in nodes:
        sources = (derivable.get(i, i.op != "call_function") for i in node.all_input_nodes)
        recomputable = free_to_recompute(node) or (
            outside
            and regions[node] is None
            and node.op == "call_function"
            and torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ())
        )
        free = recomputable and all(sources)
        derivable[node] = free or node.meta.get("recompute") is CheckpointPolicy.MUST_SAVE
        if node not in crossing or (derive and free):
            continue
        node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        derivable[node] = True
        tagged += 1
    return tagged
