"""Pass: leave the code outside the model's blocks un-checkpointed, as eager checkpointing does."""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from .blocks import block_regions, ran_in_any
from .forward_part import forward_ops
from .save_ops import DEFAULT_SAC_SAVE_OPS, OpSet

_KEPT = OpSet(DEFAULT_SAC_SAVE_OPS)


def costs_flops(node: fx.Node) -> bool:
    """Whether recomputing ``node`` costs FLOPs: an op torch's flop counter has a formula for (matmuls,
    convolutions, attention), an op of the default save set, or anything not a plain ATen op (a higher-order op,
    a Python function), which is taken to cost them."""
    from torch.utils.flop_counter import flop_registry

    if not isinstance(node.target, torch._ops.OpOverload):
        return True
    return node.target.overloadpacket in flop_registry or node.target in _KEPT


def save_outside_blocks(
    graph: fx.Graph,
    blocks: Collection[str] | None = None,
    outside_modules: Collection[str] | None = None,
    *,
    keep: Literal["all", "costly", "none"] = "all",
) -> int:
    """Tag MUST_SAVE every forward op that ran outside all blocks (``keep="all"``); ``"costly"``: only those that
    cost FLOPs to recompute (see :func:`costs_flops`), the rest staying recomputable as a block's unkept ops are, so
    the partitioner recomputes a final norm or a modulation in backward where that saves bytes; ``"none"``: none,
    so it recomputes there whatever backward needs, a patch embedding or a text projection too.

    Blocks are ``blocks`` (FQNs) or found from ``nn_module_stack`` (see blocks.py).
    Eager checkpointing wraps blocks only: embeddings, timestep and rotary tables, the final norm
    and head, a loss computed in ``forward`` are never recomputed. MUST_SAVE keeps the partitioner
    from recomputing them; values backward does not need are still not kept.

    A graph in which no block is found is either a piece of the model's own forward cut off by a
    graph break (HunyuanVideo 1.5 breaks on ``if torch.all(image_embeds == 0)`` before its blocks)
    or code inside a block (one block compiled on its own, a frame dynamo compiles after a break
    inside a block, a hand-built graph). Only ``outside_modules`` tells them apart: FQNs of modules
    outside every block that no module inside a block could also be spelled as. A graph that ran in
    one of them is all outside and saved; any other is left as it is, so the whole of it is
    checkpointed. Returns the number of ops tagged.
    """
    nodes = forward_ops(graph)
    regions = block_regions(nodes, blocks)
    if any(isinstance(region, str) for region in regions.values()):
        outside = [node for node in nodes if regions[node] is None]
    elif outside_modules and ran_in_any(nodes, outside_modules):
        outside = nodes
    else:
        return 0
    if keep != "all":
        outside = [node for node in outside if keep == "costly" and costs_flops(node)]
    for node in outside:
        node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    return len(outside)
