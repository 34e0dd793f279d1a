"""Pass: tag each block's forward ops as a checkpoint plan says: all saved, all recomputed, or some occurrences kept."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from .blocks import block_regions, call_number
from .forward_part import forward_ops
from .save_ops import op_name

UNCHECKED, WHOLE, SELECTED = "none", "full", "ops"


@dataclass(frozen=True)
class BlockDecision:
    """One block of a plan on the graph: its FQN, ``mode`` (``"none"``, ``"full"``, ``"ops"``) and, for ``ops``,
    the (op name, occurrence) pairs whose outputs are kept, counted per call of the block as eager plans count."""

    path: str
    mode: str
    keep: frozenset[tuple[str, int]] = frozenset()

    def __post_init__(self) -> None:
        if self.mode not in (UNCHECKED, WHOLE, SELECTED) or (self.mode == SELECTED) != bool(self.keep):
            raise ValueError(f"block {self.path!r}: mode {self.mode!r} with keep={sorted(self.keep)} is no decision")


def _decision_of(region: str, decisions: dict[str, BlockDecision]) -> BlockDecision | None:
    # The graph spells paths from the compiled module: "blocks.0" for the plan's "model.blocks.0" behind a
    # wrapper, or the other way round.
    for path, decision in decisions.items():
        if region == path or path.endswith(f".{region}") or region.endswith(f".{path}"):
            return decision
    return None


def keep_planned(graph: fx.Graph, decisions: Sequence[BlockDecision]) -> tuple[int, int]:
    """Tag the forward ops of each planned block: MUST_SAVE all of an unchecked block's and a selected block's kept
    occurrences; the rest keep the PREFER_RECOMPUTE the save-set pass gave them.

    Occurrences are counted per op name in graph order within each call of the block (dynamo marks a block's
    later calls in one forward), as the eager plan counts them in each checkpointed call. Returns (occurrences
    kept, planned occurrences no node was found for: an op the trace decomposed or inductor replaced).
    """
    nodes = forward_ops(graph)
    by_path = {d.path: d for d in decisions}
    regions = block_regions(nodes, by_path)
    resolved: dict[str, BlockDecision | None] = {}
    seen: dict[tuple[str, int, str], int] = defaultdict(int)
    found: dict[tuple[str, int], set[tuple[str, int]]] = defaultdict(set)
    for node in nodes:
        region = regions[node]
        if region is None:
            continue
        if region not in resolved:
            resolved[region] = _decision_of(region, by_path)
        decision = resolved[region]
        if decision is None or decision.mode == WHOLE:
            continue
        if decision.mode == UNCHECKED:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            continue
        name = op_name(node.target)
        if name is None:
            continue
        call = (region, call_number(node, region))
        index = seen[(*call, name)]
        seen[(*call, name)] += 1
        pairs = found[call]  # a call seen, even where it keeps nothing found
        if (name, index) in decision.keep:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            pairs.add((name, index))
    kept = sum(len(pairs) for pairs in found.values())
    missing = sum(
        len(decision.keep - pairs) for (region, _), pairs in found.items() if (decision := resolved[region]) is not None
    )
    return kept, missing
