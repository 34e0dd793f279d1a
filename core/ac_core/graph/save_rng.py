"""Pass: never let the partitioner recompute a forward op that draws random numbers."""

from __future__ import annotations

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from .forward_part import forward_ops


def _is_seeded(target: object) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(target, "tags", ())


def save_rng(graph: fx.Graph) -> int:
    """Tag forward ops carrying ``Tag.nondeterministic_seeded`` (dropout, rand_like, inductor's seeds) MUST_SAVE.

    A recomputed random op must replay the forward's RNG state; the partitioner arranges that
    with philox RNG functionalization, which CPU inductor cannot compile (dropout under the seed's
    pass fails there). Saving the op's output, or inductor's seed tensor, gives the backward the
    forward's random numbers on every device. Returns the number of ops this changed.
    """
    changed = 0
    for node in forward_ops(graph):
        if _is_seeded(node.target) and node.meta.get("recompute") is not CheckpointPolicy.MUST_SAVE:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            changed += 1
    return changed
