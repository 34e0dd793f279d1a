"""Pass: hand the ops without FLOPs to torch's own recompute rules, and the partitioner options those rules need."""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator, Sequence

from torch import fx

from ..policies import BlockDecision, BlockMode
from .blocks import block_regions
from .forward_part import forward_ops
from .keep_planned import decision_of
from .save_block_outputs import free_to_recompute

# The bans torch's own activation_memory_budget lifts before it recomputes any matmul (its "more aggressive"
# min-cut, torch._functorch.partitioners.choose_saved_values_set); the allowlist and reduction bans stay.
_LIFTED_BANS = (
    "ban_recompute_used_far_apart",
    "ban_recompute_long_fusible_chains",
    "ban_recompute_materialized_backward",
)


def leave_free_to_torch(graph: fx.Graph, blocks: Collection[str] | None, decisions: Sequence[BlockDecision]) -> int:
    """Drop the tag of each forward op without FLOPs (see :func:`free_to_recompute`) in a block whose decision is
    ``ops`` and outside the blocks, kept by the plan or not, so that torch's partitioner decides it as it decides
    untagged code: it recomputes pointwise ops and views, and saves what its rules ban from recompute (ops outside
    its recomputable list such as norms, concatenations and copies; reductions). The byte-minimal cut of tagged
    code recomputes those too, which costs little memory and much time: a rotary embedding written into an
    ``empty_like`` is a dozen passes over the tensor. Unchecked and whole-recomputed blocks keep their tags, and
    so does a graph in which no block is found. Returns the number of ops untagged."""
    nodes = forward_ops(graph)
    by_path = {d.path: d for d in decisions}
    regions = block_regions(nodes, blocks if blocks is not None else by_path)
    if not any(isinstance(region, str) for region in regions.values()):
        return 0
    untagged = 0
    for node in nodes:
        region = regions[node]
        if region is not None:
            decision = decision_of(region, by_path)
            if decision is None or decision.mode != BlockMode.OPS:
                continue
        if free_to_recompute(node) and node.meta.pop("recompute", None) is not None:
            untagged += 1
    return untagged


@contextlib.contextmanager
def torch_rules() -> Iterator[None]:
    """The partitioner's options while it decides untagged ops under :func:`leave_free_to_torch`: the bans torch's
    memory budget lifts, lifted (an older torch without one of them skips it)."""
    from torch._functorch import config

    lifted: dict[str, object] = {name: False for name in _LIFTED_BANS if hasattr(config, name)}
    with config.patch(lifted):
        yield
