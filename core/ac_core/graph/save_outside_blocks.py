"""Pass: leave the code outside the model's blocks un-checkpointed, as eager checkpointing does."""

from __future__ import annotations

from collections.abc import Collection

from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from .blocks import block_regions
from .forward_part import forward_ops


def save_outside_blocks(graph: fx.Graph, blocks: Collection[str] | None = None) -> int:
    """Tag MUST_SAVE every forward op that ran outside all blocks, when the graph has blocks at all.

    Blocks are ``blocks`` (FQNs) or found from ``nn_module_stack`` (see blocks.py).
    Eager checkpointing wraps blocks only: embeddings, timestep and rotary tables, the final norm
    and head, a loss computed in ``forward`` are never recomputed. MUST_SAVE keeps the partitioner
    from recomputing them; values backward does not need are still not kept. A graph in which no
    block is found (one block compiled on its own, a hand-built graph) is left as it is, so the
    whole of it is checkpointed. Returns the number of ops tagged.
    """
    nodes = forward_ops(graph)
    regions = block_regions(nodes, blocks)
    if not any(isinstance(region, str) for region in regions.values()):
        return 0
    outside = [node for node in nodes if regions[node] is None]
    for node in outside:
        node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    return len(outside)
