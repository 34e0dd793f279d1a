"""Pass: save every other forward matrix multiply (the 1st, 3rd, 5th ...), recompute the rest."""

from __future__ import annotations

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from .forward_part import forward_ops

# A Linear with a bias lowers to addmm, one without to mm: both alternate, or a model whose
# Linears all have biases would save no matmul at all.
MATMUL_OPS = (torch.ops.aten.mm, torch.ops.aten.addmm)


def alternate_matmuls(graph: fx.Graph) -> tuple[int, int]:
    """Tag the forward's mm/addmm nodes alternately MUST_SAVE and PREFER_RECOMPUTE, in graph order.

    This overrides the save set for matmuls, as torchtitan's eager selective policy does. Returns
    (matmuls seen, matmuls saved).
    """
    seen = 0
    for node in forward_ops(graph):
        if getattr(node.target, "overloadpacket", None) not in MATMUL_OPS:
            continue
        seen += 1
        odd = seen % 2 == 1
        node.meta["recompute"] = CheckpointPolicy.MUST_SAVE if odd else CheckpointPolicy.PREFER_RECOMPUTE
    return seen, seen - seen // 2
