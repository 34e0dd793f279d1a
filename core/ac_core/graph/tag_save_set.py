"""Pass: tag every forward op MUST_SAVE when it is in the save set, PREFER_RECOMPUTE otherwise."""

from __future__ import annotations

from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from .forward_part import forward_ops
from .save_ops import OpSet


def tag_save_set(graph: fx.Graph, save: OpSet) -> int:
    """Set ``meta["ac_graph_id"] = 0`` and ``meta["recompute"]`` on each forward op (getitems excepted).

    One ``ac_graph_id`` for the whole graph: the partitioner's rule that saves the boundary between
    two regions of different ids does not apply, block boundaries are saved by their own pass.
    Returns the number of ops tagged MUST_SAVE.
    """
    saved = 0
    for node in forward_ops(graph):
        node.meta["ac_graph_id"] = 0
        if node.target in save:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            saved += 1
        else:
            node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
    return saved
