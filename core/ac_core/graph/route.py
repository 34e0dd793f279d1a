"""What the graph pass does to one model: :class:`GraphRoute`, and the partitioner and backends it makes."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..policies import BlockDecision, GraphDecisions
from .partition import PartitionFn, aot_eager_backend, budget_partition, sac_partition
from .save_ops import DEFAULT_SAC_SAVE_OPS, OpSet


@dataclass(frozen=True)
class GraphRoute:
    """What the graph pass does to one model: the ops whose outputs it keeps, the blocks' FQNs, and the modules
    outside them (None where the pass is to find blocks in the graph itself).

    ``decisions``: one :class:`~ac_core.BlockDecision` per block (a plan's, or a policy's selections), which the
    pass follows instead of ``retain``. ``memory_budget``: no pass; torch's partitioner solves
    ``activation_memory_budget`` (a fraction) instead. ``recompute_free``: what costs no FLOPs to recompute
    (outside the blocks, block inputs summed from kept outputs) is left to the partitioner rather than saved (see
    :func:`~ac_core.apply_sac_pass`); ``recompute_outside`` with it: nothing outside the blocks is held;
    ``free_by_torch`` with it: the ops without FLOPs in ``ops`` blocks and outside them are torch's to decide;
    ``recompute_block_inputs`` with it: values crossing a block boundary are the partitioner's to save or recompute.
    ``activation_collectives``: collectives whose outputs are saved where they move activations.
    :func:`~ac_core.prepare_graph_route` makes one from a
    model, :meth:`following` applies a policy's :class:`~ac_core.GraphDecisions`; :func:`ac_core.compile` and
    the measurements build their backends from it.
    """

    retain: frozenset[object] = DEFAULT_SAC_SAVE_OPS
    blocks: frozenset[str] | None = None
    outside_modules: frozenset[str] | None = None
    decisions: tuple[BlockDecision, ...] | None = None
    memory_budget: float | None = None
    recompute_free: bool = False
    recompute_outside: bool = False
    activation_collectives: frozenset[str] = frozenset()
    free_by_torch: bool = False
    recompute_block_inputs: bool = False

    def __post_init__(self) -> None:
        OpSet(self.retain)  # reject a malformed op
        if self.memory_budget is not None and not 0 <= self.memory_budget <= 1:
            raise ValueError(f"torch's activation_memory_budget is a fraction in [0, 1], got {self.memory_budget!r}")
        if self.memory_budget is not None and self.decisions is not None:
            raise ValueError("a graph route follows per-block decisions or torch's memory budget, not both")

    def following(self, decisions: GraphDecisions) -> GraphRoute:
        """This route with a policy's decisions: per block, torch's budget, or more ops kept in every block."""
        return dataclasses.replace(
            self,
            retain=self.retain | decisions.retain,
            decisions=decisions.blocks,
            memory_budget=decisions.torch_budget,
            recompute_free=decisions.recompute_free,
            recompute_outside=decisions.recompute_outside,
            activation_collectives=decisions.activation_collectives,
            free_by_torch=decisions.free_by_torch,
            recompute_block_inputs=decisions.recompute_block_inputs,
        )

    def partition_fn(self) -> PartitionFn:
        """:func:`sac_partition` bound to this route (or :func:`budget_partition` for torch's budget)."""
        if self.memory_budget is not None:
            return functools.partial(budget_partition, memory_budget=self.memory_budget)
        return functools.partial(
            sac_partition,
            retain=self.retain,
            blocks=self.blocks,
            outside_modules=self.outside_modules,
            decisions=self.decisions,
            recompute_free=self.recompute_free,
            recompute_outside=self.recompute_outside,
            free_by_torch=self.free_by_torch,
            recompute_block_inputs=self.recompute_block_inputs,
            activation_collectives=self.activation_collectives,
        )

    def aot_eager(self) -> Callable[..., Any]:
        """The ``aot_eager`` backend with the pass run on each joint graph before partitioning."""
        return aot_eager_backend(self.partition_fn())

    def inductor_options(self, options: dict[str, Any] | None = None) -> dict[str, Any]:
        """``options`` for ``torch.compile(backend="inductor")`` that run the pass on each joint graph.

        The pass runs in inductor's ``custom_partitioner_fn``, after inductor's joint passes (and any
        ``joint_custom_post_pass`` in ``options``); a ``custom_partitioner_fn`` already in ``options`` partitions
        the graph the pass tagged. Being an option, it applies to that compile only and is part of inductor's and
        AOTAutograd's cache keys.
        """
        from ._inductor import BudgetPartitioner, SACPartitioner

        merged = dict(options or {})
        if self.memory_budget is not None:
            if merged.get("custom_partitioner_fn") is not None:
                raise ValueError("options= has a custom_partitioner_fn; torch's memory budget needs its own")
            merged["custom_partitioner_fn"] = BudgetPartitioner(self.memory_budget)
            return merged
        merged["custom_partitioner_fn"] = SACPartitioner(
            self.retain,
            self.blocks,
            self.outside_modules,
            self.decisions,
            self.recompute_free,
            self.recompute_outside,
            self.activation_collectives,
            inner=merged.get("custom_partitioner_fn"),
            free_by_torch=self.free_by_torch,
            recompute_block_inputs=self.recompute_block_inputs,
        )
        return merged
