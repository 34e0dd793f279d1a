"""Selective activation checkpointing on a joint forward+backward graph: the passes, in order."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

from torch import fx

from .._deprecated import UNSET, renamed
from ..collectives import is_collective
from ..policies import BlockDecision, BlockMode
from .alternate_matmuls import alternate_matmuls
from .blocks import block_regions
from .forward_part import forward_ops
from .free_by_torch import leave_free_to_torch
from .keep_planned import decision_of, keep_planned
from .save_block_outputs import save_block_outputs
from .save_collectives import save_activation_collectives
from .save_ops import DEFAULT_SAC_SAVE_OPS, OpSet
from .save_outside_blocks import save_outside_blocks
from .save_rng import save_rng
from .tag_save_set import tag_save_set

logger = logging.getLogger("ac_core")


def apply_sac_pass(
    gm: fx.GraphModule,
    retain: Iterable[object] | None = None,
    *,
    blocks: Iterable[str] | None = None,
    outside_modules: Iterable[str] | None = None,
    decisions: Sequence[BlockDecision] | None = None,
    replay_rng: bool = True,
    recompute_free: bool = False,
    recompute_outside: bool = False,
    free_by_torch: bool = False,
    recompute_block_inputs: bool = False,
    activation_collectives: Iterable[str] = (),
    static_inputs: Collection[int] | None = None,
    op_list_to_save: Any = UNSET,
    plan: Any = UNSET,
) -> fx.GraphModule:
    """Tag the joint graph ``gm`` for the min-cut partitioner and return it.

    Every ``call_function`` node of the forward part except ``operator.getitem`` gets
    ``meta["ac_graph_id"] = 0`` and ``meta["recompute"]``: ``MUST_SAVE`` for ops in
    ``retain`` (default :data:`DEFAULT_SAC_SAVE_OPS`; names such as ``"aten::mm"`` or op
    objects such as ``torch.ops.aten.mm.default``), ``PREFER_RECOMPUTE`` for the rest. Then:
    mm/addmm alternate (1st, 3rd, 5th ... saved); where the graph has blocks, values that cross a
    block boundary and ops outside every block are saved, as eager per-block checkpointing would;
    random ops are saved. Nodes that depend on a tangent (the backward) are left alone. ``blocks``
    are the blocks' FQNs (``"layers.0"``), matched against each node's ``nn_module_stack``; without
    them, blocks are found there (items of a ModuleList or ModuleDict, two or more of one class).
    ``outside_modules`` (FQNs of modules outside the blocks, see ``save_outside_blocks``) mark a
    graph that a graph break cut off before or after the blocks as outside them.
    ``torch._functorch.partitioners.min_cut_rematerialization_partition`` reads the tags;
    :func:`ac_core.compile` runs this pass inside ``torch.compile``. ``op_list_to_save=`` (torchtitan's
    name) is the old name of ``retain=``.

    With ``decisions`` (one :class:`~ac_core.BlockDecision` per block: a checkpoint plan's, or a policy's
    selections) they decide instead of ``retain`` and the matmul alternation: each block's ops are all saved
    (``none``), all recomputed (``full``) or recomputed but for the kept ones (``ops``: its planned occurrences,
    or every occurrence of its retained op names); block outputs, the code outside the blocks and random ops are
    saved as above. ``replay_rng=False`` (a backend that cannot replay a recomputed op's RNG state: CPU inductor)
    saves every op tagged random, attention kernels without dropout included. ``recompute_free=True`` (a memory
    budget's plan, which counts what the compiled step saves) leaves recomputable what the pass would save though
    recomputing it costs no FLOPs: ops outside the blocks that are no matmul, convolution or attention (a final
    norm, a modulation), and block inputs computed from saved values by such ops (a residual stream summed from
    kept outputs); the partitioner keeps them or recomputes them, whichever holds fewer bytes, and no block's
    recompute runs another block's matmuls. ``recompute_outside=True`` with it holds nothing outside the blocks:
    what backward needs there is recomputed, matmuls and convolutions included (a patch embedding, from the
    batch). ``free_by_torch=True`` with it and ``decisions``: the ops without FLOPs in ``ops`` blocks and outside
    the blocks are left untagged, kept by the plan or not, for torch's partitioner to decide by its own rules (see
    ``free_by_torch.py``; partition under :func:`~ac_core.graph.free_by_torch.torch_rules`).
    ``recompute_block_inputs=True`` with it: values crossing a block boundary are not saved as such; the
    partitioner saves or recomputes them as any other, so a block's recompute may run the previous block's ops,
    matmuls included (fewer bytes than any per-block checkpointing holds, at more FLOPs).
    ``activation_collectives``: names of collectives whose outputs are saved where they move activations
    (Ulysses' all-to-alls), in every block, or with ``decisions`` in the blocks whose decision retains them;
    ``static_inputs``: the primal indices of the parameters and buffers (AOTAutograd's
    ``static_lifetime_input_indices``), which tell a parameter's collective apart; without them no collective is
    saved by name (see ``save_collectives.py``). ``plan=`` is the old name of ``decisions=``.
    """
    if recompute_outside and not recompute_free:
        raise ValueError("recompute_outside=True goes with recompute_free=True (a memory budget's plan)")
    retain = renamed("apply_sac_pass", "op_list_to_save", "retain", op_list_to_save, retain, None)
    decisions = renamed("apply_sac_pass", "plan", "decisions", plan, decisions, None)
    if recompute_block_inputs and not recompute_free:
        raise ValueError("recompute_block_inputs=True goes with recompute_free=True (a memory budget's plan)")
    if free_by_torch and (not recompute_free or decisions is None):
        raise ValueError("free_by_torch=True goes with recompute_free=True and decisions= (a memory budget's plan)")
    save = OpSet(DEFAULT_SAC_SAVE_OPS if retain is None else retain)
    if isinstance(blocks, str):
        raise TypeError(f"blocks takes a collection of block FQNs, e.g. [{blocks!r}]")
    named = None if blocks is None else frozenset(blocks)
    if named is None and decisions is not None:
        named = frozenset(decision.path for decision in decisions)
    graph = gm.graph
    if decisions is not None:
        tag_save_set(graph, OpSet(()))
        kept, missing = keep_planned(graph, decisions)
        if missing:
            logger.warning(
                "ac-core: %d op occurrences the checkpoint plan keeps have no node in the compiled graph (an op "
                "the trace decomposed or inductor replaced): those are recomputed, so the compiled model holds "
                "less and recomputes more than planned",
                missing,
            )
        in_save_set, matmuls, matmuls_saved = kept, 0, 0
        untagged = leave_free_to_torch(graph, named, decisions) if free_by_torch else 0
    else:
        in_save_set = tag_save_set(graph, save)
        matmuls, matmuls_saved = alternate_matmuls(graph)
        untagged = 0
    # Block boundaries last: a value made again from saved ones by ops without FLOPs needs the others' tags.
    keep = "none" if recompute_outside else "costly" if recompute_free else "all"
    outside = save_outside_blocks(
        graph, named, None if outside_modules is None else frozenset(outside_modules), keep=keep
    )
    collectives = save_activation_collectives(
        graph, _kept_collectives(graph, named, decisions, frozenset(activation_collectives)), static_inputs
    )
    random_ops = save_rng(graph, replay=replay_rng)
    boundaries = (
        0
        if recompute_block_inputs
        else save_block_outputs(graph, named, derive=recompute_free, outside=recompute_outside)
    )
    gm.recompile()
    logger.info(
        "ac-core: graph SAC pass saved %d ops of the save set, %d of %d matmuls, %d block outputs, "
        "%d ops outside blocks (%s), %d activation collectives, %d more random ops; %d ops without FLOPs left to "
        "torch's rules",
        in_save_set,
        matmuls_saved,
        matmuls,
        boundaries,
        outside,
        keep,
        collectives,
        random_ops,
        untagged,
    )
    return gm


def _kept_collectives(
    graph: fx.Graph,
    blocks: frozenset[str] | None,
    decisions: Sequence[BlockDecision] | None,
    names: frozenset[str],
) -> Callable[[fx.Node], frozenset[str]]:
    """The collective names kept where a node ran: ``names`` anywhere without decisions; with them, the names its
    block's ``ops`` decision retains (none outside the blocks, nor in a block recomputed whole or left unchecked)."""
    if decisions is None:
        return lambda node: names
    by_path = {d.path: d for d in decisions}
    regions = block_regions(forward_ops(graph), blocks if blocks is not None else by_path)

    def kept(node: fx.Node) -> frozenset[str]:
        region = regions.get(node)
        decision = None if region is None else decision_of(region, by_path)
        if decision is None or decision.mode != BlockMode.OPS:
            return frozenset()
        return frozenset(op for op in decision.retain if is_collective(op)) | names

    return kept
