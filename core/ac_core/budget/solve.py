"""The global knapsack: which op outputs to keep, across every block, for the least recompute within a budget.

Each block is either left unchecked (``none``: it holds what its profile says, recomputes nothing) or
checkpointed, keeping some of its op occurrences: then it holds their output bytes and recomputes the FLOPs of
the rest that torch recomputes (keeping nothing is ``full``; see ``BlockProfile.recompute_flops``). Every
block's inputs and everything outside the blocks are held under any plan (``ModelProfile.min_bytes``).
Within the checkpointed blocks this is a 0/1 knapsack over op occurrences (bytes
are weights, FLOPs saved are values), solved with torch's ``dp_knapsack``:

- not ``ilp_knapsack``: it needs scipy, which ac-core does not depend on, and a plan must not change with what
  else is installed (reproducible: same inputs, same plan);
- not ``greedy_knapsack`` alone: it is a ratio heuristic; the DP is optimal up to its quantisation. We quantise
  bytes upwards (so the DP never overshoots the budget) and then fill what the rounding left with a greedy
  pass on exact bytes.

Leaving a block unchecked is a choice per block, not per op, so it is not an item: where ``none`` holds less
than keeping every keepable op of a block (otherwise ``none`` never does better), we try each count of
unchecked blocks per group of identical blocks (same class and shapes; the last ones in order) and solve the
knapsack for each, keeping the best. Ties break on fewer held bytes, then on the order tried: deterministic.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from torch._functorch._activation_checkpointing.knapsack import dp_knapsack

from .profile import BlockProfile, ModelProfile, OpOccurrence

# torch's dp_knapsack quantises memory to 1/_SCALE of the capacity.
_SCALE = 10000
# Most (group, unchecked count) combinations tried; beyond it each group tries fewer counts, evenly spread.
_MAX_COMBINATIONS = 256

NONE, FULL, OPS = "none", "full", "ops"


@dataclass(frozen=True)
class Choice:
    """One block's part of a plan: ``mode`` none/full/ops, the kept occurrences, what it holds and recomputes."""

    mode: str
    keep: tuple[tuple[str, int], ...]
    held_bytes: int
    recompute_flops: int


def _knapsack(items: list[OpOccurrence], capacity: int) -> list[int]:
    """Indices of ``items`` to keep: most FLOPs saved with total bytes <= ``capacity``."""
    if not items or capacity <= 0:
        return []
    unit = capacity / _SCALE
    quantised = [min(_SCALE + 1, math.ceil(op.nbytes / unit)) for op in items]
    top = max(op.flops for op in items)
    _, saved, _ = dp_knapsack([q / _SCALE for q in quantised], [op.flops / top for op in items], 1.0)
    chosen = set(saved)
    # Fill what rounding up left, on exact bytes, best ratio first (ties by position).
    used = sum(items[i].nbytes for i in chosen)
    for i in sorted(range(len(items)), key=lambda i: (-items[i].flops / items[i].nbytes, i)):
        if i not in chosen and used + items[i].nbytes <= capacity:
            chosen.add(i)
            used += items[i].nbytes
    return sorted(chosen)


def _checkpointed(profile: BlockProfile, kept: list[OpOccurrence]) -> Choice:
    keep = tuple(sorted((op.op, op.index) for op in kept))
    saved = sum(op.flops for op in kept)
    return Choice(OPS if keep else FULL, keep, sum(op.nbytes for op in kept), max(0, profile.recompute_flops - saved))


def _counts(size: int, limit: int) -> list[int]:
    if size + 1 <= limit:
        return list(range(size + 1))
    return sorted({round(i * size / (limit - 1)) for i in range(limit)})


def solve(profile: ModelProfile, budget_bytes: int) -> list[Choice]:
    """Each block's choice (in ``profile.blocks`` order) holding at most ``budget_bytes`` in all, least recompute."""
    blocks = [p for _, p in profile.blocks]
    capacity = budget_bytes - profile.min_bytes
    groups: dict[tuple[str, tuple, int], list[int]] = {}
    for i, p in enumerate(blocks):
        groups.setdefault((p.class_name, p.signature, p.calls), []).append(i)
    # Only where none holds less than keeping everything keepable can leaving a block unchecked pay.
    open_groups = [g for g in groups.values() if blocks[g[0]].none_bytes < blocks[g[0]].keep_all_bytes]
    per_group = max(2, int(_MAX_COMBINATIONS ** (1 / len(open_groups)))) if open_groups else 1
    best: tuple[tuple[int, int], list[Choice]] | None = None
    for counts in itertools.product(*(_counts(len(g), per_group) for g in open_groups)):
        unchecked = {i for g, k in zip(open_groups, counts, strict=True) for i in g[len(g) - k :]}
        room = capacity - sum(blocks[i].none_bytes for i in unchecked)
        if room < 0:
            continue
        items = [(i, op) for i, p in enumerate(blocks) if i not in unchecked for op in p.candidates]
        kept = _knapsack([op for _, op in items], room)
        by_block: dict[int, list[OpOccurrence]] = {}
        for index in kept:
            by_block.setdefault(items[index][0], []).append(items[index][1])
        choices = [
            Choice(NONE, (), p.none_bytes, 0) if i in unchecked else _checkpointed(p, by_block.get(i, []))
            for i, p in enumerate(blocks)
        ]
        score = (sum(c.recompute_flops for c in choices), sum(c.held_bytes for c in choices))
        if best is None or score < best[0]:
            best = (score, choices)
    assert best is not None, "budget below the least a plan holds; checked by the caller"
    choices = best[1]
    # A block keeping every keepable op recomputes no FLOPs; unchecked it recomputes nothing at all (not even the
    # ops without FLOPs), so leave it unchecked where the budget allows.
    slack = capacity - sum(c.held_bytes for c in choices)
    for i, (c, p) in enumerate(zip(choices, blocks, strict=True)):
        if c.mode != NONE and c.recompute_flops == 0 and p.none_bytes - c.held_bytes <= slack:
            slack -= p.none_bytes - c.held_bytes
            choices[i] = Choice(NONE, (), p.none_bytes, 0)
    return choices
