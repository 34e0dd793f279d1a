"""The SAC pass in the shape inductor's ``custom_partitioner_fn`` option takes.

Imported only by :func:`ac_core.compile`: importing inductor's pass types costs about a second.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from ..policies import BlockDecision
from .free_by_torch import torch_rules
from .partition import budget_partition
from .sac import apply_sac_pass
from .save_ops import op_name

_SOURCES = tuple(sorted(Path(__file__).parent.glob("*.py")))


def _describe(op: object) -> str:
    if isinstance(op, str):
        return op
    return op_name(op) or f"{getattr(op, '__module__', '')}.{getattr(op, '__qualname__', repr(op))}"


def _replays_rng(graph: fx.Graph) -> bool:
    # Inductor replays a recomputed random op's RNG state on CUDA (philox); CPU inductor cannot lower the
    # replay (run_and_save_rng_state). A graph of CUDA tensors may still take a CPU scalar: any CUDA input counts.
    return any(
        isinstance(value := node.meta.get("val"), torch.Tensor) and value.device.type == "cuda"
        for node in graph.nodes
        if node.op == "placeholder"
    )


class SACPartitioner(CustomPartitionerFn):
    """Runs :func:`ac_core.apply_sac_pass` on the joint graph, then partitions it: inductor's
    ``custom_partitioner_fn``, which inductor calls after its own joint passes.

    After them, not before: inductor's pattern matcher replaces nodes (and turns random ops into its seed ops)
    without carrying their tags. A partitioner rather than a joint pass, because the partitioner is handed
    AOTAutograd's ``static_lifetime_input_indices`` (the parameters and buffers), which tell a parameter's
    collective from an activation's. ``inner``: the partitioner given in the options already, run on the tagged
    graph (default: torch's min-cut). ``uuid()`` hashes this package's sources, the save set, the blocks and the
    modules outside them, the decisions, what is recomputed for free and the kept collectives (and ``inner``'s),
    so inductor's and AOTAutograd's caches never serve a graph partitioned another way.
    """

    def __init__(
        self,
        retain: frozenset[object],
        blocks: frozenset[str] | None = None,
        outside_modules: frozenset[str] | None = None,
        decisions: Sequence[BlockDecision] | None = None,
        recompute_free: bool = False,
        recompute_outside: bool = False,
        activation_collectives: frozenset[str] = frozenset(),
        inner: CustomPartitionerFn | None = None,
        free_by_torch: bool = False,
        recompute_block_inputs: bool = False,
    ) -> None:
        self.retain = retain
        self.blocks = blocks
        self.outside_modules = outside_modules
        self.decisions = decisions
        self.recompute_free = recompute_free
        self.recompute_outside = recompute_outside
        self.free_by_torch = free_by_torch
        self.recompute_block_inputs = recompute_block_inputs
        self.activation_collectives = activation_collectives
        self.inner = inner

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any) -> tuple[Any, Any]:
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        apply_sac_pass(
            gm,
            self.retain,
            blocks=self.blocks,
            outside_modules=self.outside_modules,
            decisions=self.decisions,
            replay_rng=_replays_rng(gm.graph),
            recompute_free=self.recompute_free,
            recompute_outside=self.recompute_outside,
            free_by_torch=self.free_by_torch,
            recompute_block_inputs=self.recompute_block_inputs,
            activation_collectives=self.activation_collectives,
            static_inputs=kwargs.get("static_lifetime_input_indices"),
        )
        partition = self.inner if self.inner is not None else min_cut_rematerialization_partition
        with torch_rules() if self.free_by_torch else contextlib.nullcontext():
            return partition(gm, joint_inputs, **kwargs)

    def uuid(self) -> str | None:
        inner = None if self.inner is None else self.inner.uuid()
        if self.inner is not None and inner is None:
            return None  # the inner partitioner is never cached, so neither is this
        digest = hashlib.sha256()
        for source in _SOURCES:
            digest.update(source.read_bytes())
        digest.update("\n".join(sorted(_describe(op) for op in self.retain)).encode())
        for names in (self.blocks, self.outside_modules):
            digest.update(repr(None if names is None else sorted(names)).encode())
        decisions = (
            None
            if self.decisions is None
            else [(d.path, d.mode.value, d.keep, sorted(d.retain)) for d in self.decisions]
        )
        layout = (self.recompute_free, self.recompute_outside, self.free_by_torch, self.recompute_block_inputs)
        digest.update(repr((decisions, layout)).encode())
        digest.update(repr((sorted(self.activation_collectives), inner)).encode())
        return digest.hexdigest()


class BudgetPartitioner(CustomPartitionerFn):
    """Inductor's ``custom_partitioner_fn``: torch's min-cut partitioner under ``activation_memory_budget``.

    An option rather than a global config patch: the budget applies to this compile only (partitioning runs
    at the first call, after ``torch.compile`` returned) and is part of the cache key through ``uuid()``.
    """

    def __init__(self, memory_budget: float) -> None:
        self.memory_budget = memory_budget

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any) -> tuple[Any, Any]:
        return budget_partition(gm, joint_inputs, memory_budget=self.memory_budget, **kwargs)

    def uuid(self) -> str:
        return f"ac-core activation_memory_budget={self.memory_budget!r}"
