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
- not ``greedy_knapsack`` alone: it is a ratio heuristic; the DP is optimal up to its quantisation. Where the
  items' bytes share a unit (their gcd) that splits the capacity into at most 65,536, it is exact; else we
  quantise bytes upwards (so the DP never overshoots the budget) and then fill what the rounding left with a
  greedy pass on exact bytes.

Leaving a block unchecked is a choice per block, not per op, so it is not an item: where ``none`` holds less
than keeping every keepable op of a block (otherwise ``none`` never does better), we try each count of
unchecked blocks per group of identical blocks (same class and shapes; the last ones in order) and solve the
knapsack for each, keeping the best. Ties break on fewer held bytes, then on the order tried: deterministic.

Offload (where allowed) moves checkpointed blocks' saved inputs to the host (see :mod:`.offload`): no recompute,
so for each layout every checkpointed block that can offloads, where that frees more device bytes than
offload's window keeps, and the room it leaves goes to kept ops. Then the best layout offloads only as many
blocks, the first first, as its recompute needs: copies cost transfer time, and backward needs those last.

The cost is recompute FLOPs (``cost="flops"``) or predicted seconds on a :class:`~.devices.Device`
(``cost="time"``): each op occurrence's roofline (:mod:`.roofline`), so that a memory-bound op without FLOPs (a
GELU, a norm) is worth keeping too (``BlockProfile.timed_candidates``), and keeping an op saves its own seconds.
Priced in time, offload costs the host-link time it leaves exposed (:func:`offload_seconds`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from torch._functorch._activation_checkpointing.knapsack import dp_knapsack
from torch.utils._python_dispatch import _disable_current_modes

from ..offload import OffloadConfig
from ..op_names import op_matches
from ..policies import BlockDecision, BlockMode
from .devices import Device
from .offload_cost import Moved, OffloadCost
from .profile import BlockProfile, ModelProfile, OpOccurrence
from .roofline import op_time, transfer_seconds

Cost = Literal["time", "flops"]

# torch's dp_knapsack quantises memory to 1/_SCALE of what it is given as the capacity.
_SCALE = 10000
# Most units the capacity is split into. Where the items' bytes share a unit (their gcd) that splits it into no more,
# the DP is exact: a set of items fits just when its units do (the toy's blocks fill a budget to the byte).
_FINE = 1 << 16
# Most (group, unchecked count) combinations tried; beyond it each group tries fewer counts, evenly spread.
_MAX_COMBINATIONS = 256


@dataclass(frozen=True)
class Choice:
    """One block's part of a plan: ``mode`` none/full/ops, the kept occurrences, what it holds and recomputes;
    with a device, its predicted ``recompute_seconds`` and the host-link seconds its offload leaves exposed."""

    mode: BlockMode
    keep: tuple[tuple[str, int], ...]
    held_bytes: int
    recompute_flops: int
    offload: bool = False  # its saved inputs go to the host
    recompute_seconds: float = 0.0
    offload_seconds: float = 0.0


def _equal(items: Sequence[OpOccurrence], values: Sequence[float]) -> dict[tuple[int, float], list[int]]:
    """Indices of ``items`` by (bytes, value), in order: equal items are the same op of identical blocks."""
    equal: dict[tuple[int, float], list[int]] = {}
    for i, op in enumerate(items):
        equal.setdefault((op.nbytes, values[i]), []).append(i)
    return equal


def _bundles(equal: dict[tuple[int, float], list[int]]) -> list[tuple[tuple[int, float], int]]:
    """The knapsack's 0/1 items as (key, how many): each set of ``equal`` items split in 1, 2, 4, ... of them, so
    that any count of them is a set of bundles. Exact, and the table shrinks from a row per block's op to a few
    per distinct op: 60 identical blocks plan in seconds."""
    bundles = []
    for key, indices in equal.items():
        size, left = 1, len(indices)
        while left:
            bundles.append((key, min(size, left)))
            left -= min(size, left)
            size *= 2
    return bundles


def _knapsack(items: Sequence[OpOccurrence], values: Sequence[float], capacity: int) -> list[int]:
    """Indices of ``items`` to keep: most ``values`` saved with total bytes <= ``capacity``."""
    if not items or capacity <= 0:
        return []
    equal = _equal(items, values)
    bundles = _bundles(equal)
    step = math.gcd(*(nbytes for nbytes, _ in equal))
    if capacity < step:  # every item is a multiple of step: none fits
        return []
    # Else the coarser quantisation of before: a finer one costs the DP its table's width on every solve.
    units, unit = (capacity // step, step) if capacity // step <= _FINE else (_SCALE, capacity / _SCALE)
    quantised = [min(units + 1, math.ceil(nbytes * n / unit)) for (nbytes, _), n in bundles]
    top = max(value * n for (_, value), n in bundles)
    scores = [value * n / top for (_, value), n in bundles]
    with _disable_current_modes():  # planned under FakeTensorMode, dp_knapsack's own tensors must be real
        _, saved, _ = dp_knapsack([q / _SCALE for q in quantised], scores, units / _SCALE)
    count = dict.fromkeys(equal, 0)
    for b in saved:
        count[bundles[b][0]] += bundles[b][1]
    # Of equal items, the first ones in order are kept: which of identical blocks keeps an op changes nothing.
    taken = {key: indices[: count[key]] for key, indices in equal.items()}
    used = sum(nbytes * len(kept) for (nbytes, _), kept in taken.items())
    # Fill what rounding up left, on exact bytes, best ratio first (ties by position).
    for (nbytes, value), indices in sorted(equal.items(), key=lambda kv: (-kv[0][1] / kv[0][0], kv[1][0])):
        more = min(len(indices) - count[nbytes, value], (capacity - used) // nbytes)
        if more > 0:
            taken[nbytes, value] = indices[: count[nbytes, value] + more]
            used += more * nbytes
    return sorted(i for kept in taken.values() for i in kept)


@functools.lru_cache(maxsize=1 << 16)
def _op_seconds(op: OpOccurrence, device: Device) -> float:
    # A solve prices the same occurrences for every layout it tries: the roofline once each.
    return op_time(op, device).seconds


def _seconds(ops: Iterable[OpOccurrence], device: Device) -> float:
    return sum(_op_seconds(op, device) for op in ops)


def _still_recomputed(
    profile: BlockProfile, keep: Iterable[tuple[str, int]] = (), retain: frozenset[str] = frozenset()
) -> list[OpOccurrence]:
    """The occurrences a checkpointed block recomputes keeping the occurrences ``keep`` and every occurrence of the
    op names ``retain``: summed over what stays recomputed, not subtracted, so keeping every op predicts 0 s."""
    kept = set(keep)
    return [op for op in profile.recomputed if (op.op, op.index) not in kept and not op_matches(op.op, retain)]


def _checkpointed(profile: BlockProfile, kept: list[OpOccurrence], offload: bool, device: Device | None) -> Choice:
    kept = [*kept, *profile.routing]
    keep = tuple(sorted((op.op, op.index) for op in kept))
    saved = sum(op.flops for op in kept)
    flops = max(0, profile.recompute_flops - saved)
    seconds = _seconds(_still_recomputed(profile, keep), device) if device is not None else 0.0
    mode = BlockMode.OPS if keep else BlockMode.FULL
    return Choice(mode, keep, sum(op.nbytes for op in kept), flops, offload, seconds)


def forward_seconds(profile: BlockProfile, device: Device) -> float:
    """Predicted seconds of a block's forward on ``device``: the roofline of every op it runs."""
    return _seconds(profile.forward, device)


def none_step_seconds(profile: ModelProfile, device: Device) -> float:
    """Predicted seconds of the blocks' forward and backward unchecked (``none``): each block's forward
    roofline, and its backward estimated at twice that (a matmul's backward runs two matmuls of its size; an
    elementwise op's reads and writes about twice its bytes). Ops outside the blocks are not profiled, so not
    counted."""
    return 3 * sum(forward_seconds(p, device) for _, p in profile.blocks)


def recompute_seconds(profile: ModelProfile, decisions: Iterable[BlockDecision], device: Device) -> float:
    """Predicted seconds on ``device`` of what backward recomputes under ``decisions`` (a plan's blocks, or a fixed
    policy's selections as decisions; a block none names is unchecked), priced as the knapsack prices its
    choices: a ``full`` block the roofline of every op its recompute runs (``BlockProfile.recompute_seconds``), an
    ``ops`` block the same less its kept occurrences (``keep``) and every occurrence of its retained op names
    (``retain``). Over :func:`none_step_seconds` it is the predicted step-time overhead over ``none``."""
    blocks = dict(profile.blocks)
    seconds = 0.0
    for decision in decisions:
        block = blocks.get(decision.path)
        if block is None:
            raise ValueError(
                f"block {decision.path!r} is not in the profile of {profile.model_class} (its blocks: "
                f"{', '.join(list(blocks)[:4])}{' ...' if len(blocks) > 4 else ''}); profile the blocks decided on"
            )
        if decision.mode != BlockMode.NONE:
            seconds += _seconds(_still_recomputed(block, decision.keep, decision.retain), device)
    return seconds


def offload_seconds(
    profile: ModelProfile, host: dict[str, int], device: Device, config: OffloadConfig
) -> dict[str, float]:
    """Per offloaded block (``host``: bytes it sends, from :meth:`.OffloadCost.moved`), the host-link seconds
    left exposed. Offload copies on side streams beside compute (:mod:`ac_core.offload`): a block's inputs,
    saved as it starts, go to the host while it runs its forward, but compute waits for what is past
    ``max_inflight_bytes`` in flight; they come back prefetched (up to ``prefetch_bytes``) while backward runs the
    next block's (predicted at twice its forward; nothing after the last block), the rest on demand. Each way
    costs its waited-for part whole and what the rest takes beyond the compute beside it."""
    paths = [path for path, _ in profile.blocks]
    forward = {path: forward_seconds(p, device) for path, p in profile.blocks}
    exposed = {}
    for path, nbytes in host.items():
        i = paths.index(path)
        behind = 2 * forward[paths[i + 1]] if i + 1 < len(paths) else 0.0
        out = _exposed(nbytes, config.max_inflight_bytes, forward[path], device)
        exposed[path] = out + _exposed(nbytes, config.prefetch_bytes, behind, device)
    return exposed


def _exposed(nbytes: int, overlapped: int, beside: float, device: Device) -> float:
    """Seconds a copy of ``nbytes`` stalls compute when up to ``overlapped`` of them run beside ``beside``
    seconds of compute and the rest is waited for."""
    hidden = min(nbytes, overlapped)
    return transfer_seconds(nbytes - hidden, device) + max(0.0, transfer_seconds(hidden, device) - beside)


def _counts(size: int, limit: int) -> list[int]:
    if size + 1 <= limit:
        return list(range(size + 1))
    return sorted({round(i * size / (limit - 1)) for i in range(limit)})


class _Problem:
    """One profile, budget, offload model and cost: what a set of choices holds and costs, and the best fill of a
    layout."""

    def __init__(
        self,
        profile: ModelProfile,
        budget_bytes: int,
        offload: OffloadCost | None,
        cost: Cost,
        device: Device | None,
    ) -> None:
        self.profile = profile
        self.paths = [path for path, _ in profile.blocks]
        self.blocks = [p for _, p in profile.blocks]
        self.budget = budget_bytes
        self.offload = offload
        self.cost = cost
        self.device = device
        self.items = [self._items(p) for p in self.blocks]
        self._choices: dict[tuple[int, tuple[tuple[str, int], ...]], Choice] = {}

    def _items(self, block: BlockProfile) -> tuple[list[OpOccurrence], list[float]]:
        """``block``'s knapsack items and what keeping each saves, in this problem's cost."""
        if self.cost == "flops":
            return list(block.candidates), [op.flops for op in block.candidates]
        assert self.device is not None
        timed = [(op, op_time(op, self.device).seconds) for op in block.timed_candidates]
        timed = [(op, seconds) for op, seconds in timed if seconds > 0]
        return [op for op, _ in timed], [seconds for _, seconds in timed]

    def total(self, choices: list[Choice]) -> float:
        if self.cost == "flops":
            return sum(c.recompute_flops for c in choices)
        return sum(c.recompute_seconds + c.offload_seconds for c in choices)

    def keep_all_bytes(self, i: int) -> int:
        return sum(op.nbytes for op in self.items[i][0]) + self.blocks[i].routing_bytes

    def moved(self, offloaded: Iterable[int]) -> Moved:
        chosen = [self.paths[i] for i in offloaded]
        return self.offload.moved(chosen) if self.offload is not None and chosen else Moved()

    def device_bytes(self, choices: list[Choice]) -> int:
        """What ``choices`` hold on the device for backward, offload's window counted."""
        gone = self.moved(i for i, c in enumerate(choices) if c.offload)
        return self.profile.min_bytes + sum(c.held_bytes for c in choices) - gone.gain

    def fill(self, unchecked: set[int], offloaded: list[int], budget: int | None = None) -> list[Choice] | None:
        """The least-recompute choices with ``unchecked`` blocks left as they are and ``offloaded`` blocks' inputs
        on the host, within ``budget`` (None: the problem's); None where that cannot fit."""
        blocks = self.blocks
        room = (self.budget if budget is None else budget) - self.profile.min_bytes
        room -= sum(p.none_bytes if i in unchecked else p.routing_bytes for i, p in enumerate(blocks))
        room += self.moved(offloaded).gain
        if room < 0:
            return None
        items: list[tuple[int, OpOccurrence]] = []
        values: list[float] = []
        for i, (ops, saved) in enumerate(self.items):
            if i not in unchecked:
                items += [(i, op) for op in ops]
                values += saved
        by_block: dict[int, list[OpOccurrence]] = {}
        for index in _knapsack([op for _, op in items], values, room):
            by_block.setdefault(items[index][0], []).append(items[index][1])
        choices = [
            Choice(BlockMode.NONE, (), p.none_bytes, 0)
            if i in unchecked
            else self._checkpointed(i, by_block.get(i, []), i in offloaded)
            for i, p in enumerate(blocks)
        ]
        return self.priced(choices)

    def _checkpointed(self, i: int, kept: list[OpOccurrence], offload: bool) -> Choice:
        """:func:`_checkpointed` for block ``i``, remembered: the layouts tried give identical blocks the same
        keeps over and over, and pricing a keep sums its block's whole recompute."""
        key = (id(self.blocks[i]), tuple((op.op, op.index) for op in kept))
        choice = self._choices.get(key)
        if choice is None:
            choice = self._choices[key] = _checkpointed(self.blocks[i], kept, False, self.device)
        return dataclasses.replace(choice, offload=True) if offload else choice

    def priced(self, choices: list[Choice]) -> list[Choice]:
        """``choices`` with the exposed host-link seconds of their offload, where a device prices it."""
        offloaded = [i for i, c in enumerate(choices) if c.offload]
        if self.device is None or not offloaded:
            return choices
        assert self.offload is not None  # only an offload model offloads
        exposed = offload_seconds(self.profile, self.moved(offloaded).host, self.device, self.offload.config)
        return [
            dataclasses.replace(c, offload_seconds=exposed.get(path, 0.0)) if c.offload else c
            for path, c in zip(self.paths, choices, strict=True)
        ]


def solve(
    profile: ModelProfile,
    budget_bytes: int,
    offload: OffloadCost | None = None,
    *,
    cost: Cost = "flops",
    device: Device | None = None,
    layout_budget: Callable[[frozenset[int]], int] | None = None,
) -> list[Choice]:
    """Each block's choice (in ``profile.blocks`` order) holding at most ``budget_bytes`` in all, least recompute
    in ``cost`` (``"time"`` needs ``device``; with one, choices carry predicted seconds either way); with
    ``offload``, checkpointed blocks' inputs go to the host where that leaves room to keep more.

    ``layout_budget(unchecked)``: the most a plan leaving the blocks at those indices unchecked may hold, where
    less than ``budget_bytes`` (a step budget's: backward's transient is set by which blocks are checkpointed);
    ValueError where no layout fits it."""
    if cost == "time" and device is None:
        raise ValueError('cost="time" needs a device to predict seconds on')
    problem = _Problem(profile, budget_bytes, offload, cost, device)
    blocks = problem.blocks
    movable = [i for i, path in enumerate(problem.paths) if offload is not None and path in offload.blocks]
    groups: dict[tuple[str, tuple, int], list[int]] = {}
    for i, p in enumerate(blocks):
        groups.setdefault((p.class_name, p.signature, p.calls), []).append(i)
    # Only where none holds less than keeping everything keepable can leaving a block unchecked pay.
    open_groups = [g for g in groups.values() if blocks[g[0]].none_bytes < problem.keep_all_bytes(g[0])]
    per_group = max(2, int(_MAX_COMBINATIONS ** (1 / len(open_groups)))) if open_groups else 1
    best: tuple[tuple[float, int], set[int], list[int], list[Choice]] | None = None
    for counts in itertools.product(*(_counts(len(g), per_group) for g in open_groups)):
        unchecked = {i for g, k in zip(open_groups, counts, strict=True) for i in g[len(g) - k :]}
        # Offload costs no recompute: every checkpointed block's inputs go, where that saves bytes at all.
        offloaded = [i for i in movable if i not in unchecked]
        if problem.moved(offloaded).gain <= 0:
            offloaded = []
        choices = problem.fill(unchecked, offloaded, _cap(budget_bytes, layout_budget, unchecked))
        if choices is None:
            continue
        score = (problem.total(choices), problem.device_bytes(choices))
        if best is None or score < best[0]:
            best = (score, unchecked, offloaded, choices)
    if best is None:
        if layout_budget is None:
            raise AssertionError("budget below the least a plan holds; checked by the caller")
        raise ValueError("no layout of unchecked blocks fits its budget")
    (least, _), unchecked, offloaded, choices = best
    cap = _cap(budget_bytes, layout_budget, unchecked)
    # Then offload no more than that recompute needs: the first blocks' inputs first, which backward needs last.
    for count in range(len(offloaded)):
        fewer = problem.fill(unchecked, offloaded[:count], cap)
        if fewer is not None and problem.total(fewer) <= least:
            choices = fewer
            break
    # Unchecked, a block recomputes nothing at all (not even the ops without FLOPs), so leave it unchecked where
    # the budget allows: costed in FLOPs, where it keeps every keepable op (it recomputes no FLOPs); in time,
    # wherever (what it still recomputes costs seconds).
    for i, (c, p) in enumerate(zip(choices, blocks, strict=True)):
        if c.mode != BlockMode.NONE and (cost == "time" or c.recompute_flops == 0):
            trial = problem.priced([*choices[:i], Choice(BlockMode.NONE, (), p.none_bytes, 0), *choices[i + 1 :]])
            left = {j for j, t in enumerate(trial) if t.mode == BlockMode.NONE}
            if problem.device_bytes(trial) <= _cap(budget_bytes, layout_budget, left):
                choices = trial
    return choices


def _cap(budget_bytes: int, layout_budget: Callable[[frozenset[int]], int] | None, unchecked: set[int]) -> int:
    return budget_bytes if layout_budget is None else min(budget_bytes, layout_budget(frozenset(unchecked)))
