"""Pass: save every forward value that crosses a block boundary, as eager checkpointing does."""

from __future__ import annotations

import operator
from collections.abc import Collection

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from .blocks import block_regions
from .forward_part import forward_ops


def save_block_outputs(graph: fx.Graph, blocks: Collection[str] | None = None) -> int:
    """Tag MUST_SAVE each forward op whose tensor output is used in another block than its own.

    Blocks are ``blocks`` (FQNs) or found from ``nn_module_stack`` (see blocks.py); code outside
    every block is one more region. Eager per-block checkpointing keeps each block's inputs, so
    without this the compiled route could recompute a whole chain of blocks back to the last saved
    op and recompute more than eager ``ops`` does. A value read through ``getitem`` saves the op
    that produced it. Returns the number of ops tagged.
    """
    nodes = forward_ops(graph, include_getitem=True)
    forward = set(nodes)
    regions = block_regions(nodes, blocks)
    tagged: set[fx.Node] = set()
    for node in nodes:
        if not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        crosses = any(user in forward and regions[user] != regions[node] for user in node.users)
        if not crosses:
            continue
        producer = node.args[0] if node.target is operator.getitem else node
        if isinstance(producer, fx.Node) and producer not in tagged:
            producer.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            tagged.add(producer)
    return len(tagged)
