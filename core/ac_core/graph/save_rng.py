"""Pass: never let the partitioner recompute a forward op that draws random numbers."""

from __future__ import annotations

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from ..ops import draws_random
from .forward_part import forward_ops


def save_rng(graph: fx.Graph, *, replay: bool = True) -> int:
    """Tag forward ops that draw random numbers (dropout, rand_like, inductor's seeds) MUST_SAVE.

    An SDPA kernel or dropout called with probability 0 draws none (the tag is on the op, not the call): it
    stays recomputable, as eager checkpointing treats it, so a plan may recompute attention. The partitioner
    still replays the RNG state of any tagged op it recomputes (a few KiB each); where the backend cannot
    (``replay=False``: CPU inductor), every tagged op is saved.

    A recomputed random op must replay the forward's RNG state; the partitioner arranges that
    with philox RNG functionalization, which CPU inductor cannot compile (dropout under the seed's
    pass fails there). Saving the op's output, or inductor's seed tensor, gives the backward the
    forward's random numbers on every device. Returns the number of ops this changed.
    """
    changed = 0
    for node in forward_ops(graph):
        saved = node.meta.get("recompute") is CheckpointPolicy.MUST_SAVE
        if replay:
            seeded = draws_random(node.target, node.args, node.kwargs)
        else:
            seeded = torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())
        if not saved and seeded:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            changed += 1
    return changed
