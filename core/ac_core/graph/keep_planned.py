"""Pass: tag each block's forward ops as its decision says: all saved, all recomputed, or some kept."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from ..collectives import is_collective
from ..op_names import op_matches
from ..policies import BlockDecision, BlockMode
from .blocks import block_regions, call_number
from .forward_part import forward_ops
from .save_ops import op_name


def decision_of(region: str, decisions: dict[str, BlockDecision]) -> BlockDecision | None:
    """The decision of the block a node's region names, however the graph spells its path."""
    # The graph spells paths from the compiled module: "blocks.0" for the plan's "model.blocks.0" behind a
    # wrapper, or the other way round.
    for path, decision in decisions.items():
        if region == path or path.endswith(f".{region}") or region.endswith(f".{path}"):
            return decision
    return None


def keep_planned(graph: fx.Graph, decisions: Sequence[BlockDecision]) -> tuple[int, int]:
    """Tag the forward ops of each decided block: MUST_SAVE all of an unchecked block's, and of an ``ops`` block
    its kept occurrences and every occurrence of its retained op names but collectives (kept where they move
    activations, see ``save_collectives.py``); the rest keep the PREFER_RECOMPUTE the save-set pass gave them.

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
    retained = 0
    for node in nodes:
        region = regions[node]
        if region is None:
            continue
        if region not in resolved:
            resolved[region] = decision_of(region, by_path)
        decision = resolved[region]
        if decision is None or decision.mode == BlockMode.FULL:
            continue
        if decision.mode == BlockMode.NONE:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            continue
        name = op_name(node.target)
        if name is None:
            continue
        call = (region, call_number(node, region))
        index = seen[(*call, name)]
        seen[(*call, name)] += 1
        pairs = found[call]  # a call seen, even where it keeps nothing found
        if op_matches(name, decision.retain) and not is_collective(name):  # collectives: save_collectives.py
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            retained += 1
        elif (name, index) in decision.keep:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            pairs.add((name, index))
    kept = retained + sum(len(pairs) for pairs in found.values())
    missing = sum(
        len(set(decision.keep) - pairs)
        for (region, _), pairs in found.items()
        if (decision := resolved[region]) is not None
    )
    return kept, missing
