"""The global knapsack: which op outputs to keep, across every block, for the least recompute within a budget.

Each block is either left unchecked (``none``: it holds what its profile says, recomputes nothing) or
checkpointed, keeping some of its op occurrences: then it holds their output bytes and recomputes the FLOPs of
the rest that torch recomputes (keeping nothing is ``full``; see ``BlockProfile.recompute_flops``). A
checkpointed MoE block always keeps its routing decision (``BlockProfile.routing``, see
:data:`~ac_core.ops.ROUTING_OPS`): it is no knapsack item, its bytes are taken off the room first. Every
block's inputs and everything outside the blocks are held under any plan (``ModelProfile.min_bytes``), less
what offload moves.
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

Offload (where allowed) moves checkpointed blocks' saved inputs to the host (see :mod:`.offload`): no recompute,
so for each layout every checkpointed block that can offloads, where that frees more device bytes than
offload's window keeps, and the room it leaves goes to kept ops. Then the best layout offloads only as many
blocks, the first first, as its recompute needs: copies cost transfer time, and backward needs those last.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

from torch._functorch._activation_checkpointing.knapsack import dp_knapsack
from torch.utils._python_dispatch import _disable_current_modes

from ..policies import BlockMode
from .offload_cost import Moved, OffloadCost
from .profile import BlockProfile, ModelProfile, OpOccurrence

# torch's dp_knapsack quantises memory to 1/_SCALE of the capacity.
_SCALE = 10000
# Most (group, unchecked count) combinations tried; beyond it each group tries fewer counts, evenly spread.
_MAX_COMBINATIONS = 256


@dataclass(frozen=True)
class Choice:
    """One block's part of a plan: ``mode`` none/full/ops, the kept occurrences, what it holds and recomputes."""

    mode: BlockMode
    keep: tuple[tuple[str, int], ...]
    held_bytes: int
    recompute_flops: int
    offload: bool = False  # its saved inputs go to the host


def _knapsack(items: list[OpOccurrence], capacity: int) -> list[int]:
    """Indices of ``items`` to keep: most FLOPs saved with total bytes <= ``capacity``."""
    if not items or capacity <= 0:
        return []
    unit = capacity / _SCALE
    quantised = [min(_SCALE + 1, math.ceil(op.nbytes / unit)) for op in items]
    top = max(op.flops for op in items)
    with _disable_current_modes():  # planned under FakeTensorMode, dp_knapsack's own tensors must be real
        _, saved, _ = dp_knapsack([q / _SCALE for q in quantised], [op.flops / top for op in items], 1.0)
    chosen = set(saved)
    # Fill what rounding up left, on exact bytes, best ratio first (ties by position).
    used = sum(items[i].nbytes for i in chosen)
    for i in sorted(range(len(items)), key=lambda i: (-items[i].flops / items[i].nbytes, i)):
        if i not in chosen and used + items[i].nbytes <= capacity:
            chosen.add(i)
            used += items[i].nbytes
    return sorted(chosen)


def _checkpointed(profile: BlockProfile, kept: list[OpOccurrence], offload: bool) -> Choice:
    kept = [*kept, *profile.routing]
    keep = tuple(sorted((op.op, op.index) for op in kept))
    saved = sum(op.flops for op in kept)
    flops = max(0, profile.recompute_flops - saved)
    return Choice(BlockMode.OPS if keep else BlockMode.FULL, keep, sum(op.nbytes for op in kept), flops, offload)


def _counts(size: int, limit: int) -> list[int]:
    if size + 1 <= limit:
        return list(range(size + 1))
    return sorted({round(i * size / (limit - 1)) for i in range(limit)})


def _flops(choices: list[Choice]) -> int:
    return sum(c.recompute_flops for c in choices)


class _Problem:
    """One profile, budget and offload model: what a set of choices holds, and the best fill of a layout."""

    def __init__(self, profile: ModelProfile, budget_bytes: int, offload: OffloadCost | None) -> None:
        self.profile = profile
        self.paths = [path for path, _ in profile.blocks]
        self.blocks = [p for _, p in profile.blocks]
        self.budget = budget_bytes
        self.offload = offload

    def moved(self, offloaded: Iterable[int]) -> Moved:
        chosen = [self.paths[i] for i in offloaded]
        return self.offload.moved(chosen) if self.offload is not None and chosen else Moved()

    def device_bytes(self, choices: list[Choice]) -> int:
        """What ``choices`` hold on the device for backward, offload's window counted."""
        gone = self.moved(i for i, c in enumerate(choices) if c.offload)
        return self.profile.min_bytes + sum(c.held_bytes for c in choices) - gone.gain

    def fill(self, unchecked: set[int], offloaded: list[int]) -> list[Choice] | None:
        """The least-recompute choices with ``unchecked`` blocks left as they are and ``offloaded`` blocks' inputs
        on the host; None where that cannot fit."""
        blocks = self.blocks
        room = self.budget - self.profile.min_bytes
        room -= sum(p.none_bytes if i in unchecked else p.routing_bytes for i, p in enumerate(blocks))
        room += self.moved(offloaded).gain
        if room < 0:
            return None
        items = [(i, op) for i, p in enumerate(blocks) if i not in unchecked for op in p.candidates]
        by_block: dict[int, list[OpOccurrence]] = {}
        for index in _knapsack([op for _, op in items], room):
            by_block.setdefault(items[index][0], []).append(items[index][1])
        return [
            Choice(BlockMode.NONE, (), p.none_bytes, 0)
            if i in unchecked
            else _checkpointed(p, by_block.get(i, []), offload=i in offloaded)
            for i, p in enumerate(blocks)
        ]


def solve(profile: ModelProfile, budget_bytes: int, offload: OffloadCost | None = None) -> list[Choice]:
    """Each block's choice (in ``profile.blocks`` order) holding at most ``budget_bytes`` in all, least recompute;
    with ``offload``, checkpointed blocks' inputs go to the host where that leaves room to keep more."""
    problem = _Problem(profile, budget_bytes, offload)
    blocks = problem.blocks
    movable = [i for i, path in enumerate(problem.paths) if offload is not None and path in offload.blocks]
    groups: dict[tuple[str, tuple, int], list[int]] = {}
    for i, p in enumerate(blocks):
        groups.setdefault((p.class_name, p.signature, p.calls), []).append(i)
    # Only where none holds less than keeping everything keepable can leaving a block unchecked pay.
    open_groups = [g for g in groups.values() if blocks[g[0]].none_bytes < blocks[g[0]].keep_all_bytes]
    per_group = max(2, int(_MAX_COMBINATIONS ** (1 / len(open_groups)))) if open_groups else 1
    best: tuple[tuple[int, int], set[int], list[int], list[Choice]] | None = None
    for counts in itertools.product(*(_counts(len(g), per_group) for g in open_groups)):
        unchecked = {i for g, k in zip(open_groups, counts, strict=True) for i in g[len(g) - k :]}
        # Offload costs no recompute: every checkpointed block's inputs go, where that saves bytes at all.
        offloaded = [i for i in movable if i not in unchecked]
        if problem.moved(offloaded).gain <= 0:
            offloaded = []
        choices = problem.fill(unchecked, offloaded)
        if choices is None:
            continue
        score = (_flops(choices), problem.device_bytes(choices))
        if best is None or score < best[0]:
            best = (score, unchecked, offloaded, choices)
    assert best is not None, "budget below the least a plan holds; checked by the caller"
    (flops, _), unchecked, offloaded, choices = best
    # Then offload no more than that recompute needs: the first blocks' inputs first, which backward needs last.
    for count in range(len(offloaded)):
        fewer = problem.fill(unchecked, offloaded[:count])
        if fewer is not None and _flops(fewer) <= flops:
            choices = fewer
            break
    # A block keeping every keepable op recomputes no FLOPs; unchecked it recomputes nothing at all (not even the
    # ops without FLOPs), so leave it unchecked where the budget allows.
    for i, (c, p) in enumerate(zip(choices, blocks, strict=True)):
        if c.mode != BlockMode.NONE and c.recompute_flops == 0:
            trial = [*choices[:i], Choice(BlockMode.NONE, (), p.none_bytes, 0), *choices[i + 1 :]]
            if problem.device_bytes(trial) <= budget_bytes:
                choices = trial
    return choices
