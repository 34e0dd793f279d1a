"""The partitioners and backends the graph pass runs in: ``partition_fn`` for AOTAutograd, and ``aot_eager``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from torch import fx

from ..policies import BlockDecision
from .free_by_torch import torch_rules
from .sac import apply_sac_pass

PartitionFn = Callable[..., tuple[fx.GraphModule, fx.GraphModule]]


def sac_partition(
    gm: fx.GraphModule,
    joint_inputs: Sequence[object],
    *,
    retain: frozenset[object] | None = None,
    blocks: frozenset[str] | None = None,
    outside_modules: frozenset[str] | None = None,
    partition: PartitionFn | None = None,
    decisions: Sequence[BlockDecision] | None = None,
    recompute_free: bool = False,
    recompute_outside: bool = False,
    free_by_torch: bool = False,
    recompute_block_inputs: bool = False,
    activation_collectives: frozenset[str] = frozenset(),
    **kwargs: Any,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """A ``partition_fn`` for ``aot_autograd``: :func:`apply_sac_pass`, then ``partition`` (min-cut by default).
    AOTAutograd's ``static_lifetime_input_indices`` (the parameters and buffers) tell the pass which collectives
    move parameters, and go on to the partitioner; ``free_by_torch``: the ops left untagged are partitioned under
    :func:`~ac_core.graph.free_by_torch.torch_rules`."""
    if partition is None:
        from torch._functorch.partitioners import min_cut_rematerialization_partition as partition
    apply_sac_pass(
        gm,
        retain,
        blocks=blocks,
        outside_modules=outside_modules,
        decisions=decisions,
        recompute_free=recompute_free,
        recompute_outside=recompute_outside,
        free_by_torch=free_by_torch,
        recompute_block_inputs=recompute_block_inputs,
        activation_collectives=activation_collectives,
        static_inputs=kwargs.get("static_lifetime_input_indices"),
    )
    with torch_rules() if free_by_torch else contextlib.nullcontext():
        return partition(gm, joint_inputs, **kwargs)


def budget_partition(
    gm: fx.GraphModule, joint_inputs: Sequence[object], *, memory_budget: float, **kwargs: Any
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """torch's min-cut partitioner with ``torch._functorch.config.activation_memory_budget = memory_budget``.

    torch reads the budget when it partitions, at the compiled model's first call, so it is set around the
    partitioner rather than around ``torch.compile``.
    """
    from torch._functorch import config
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    with config.patch(activation_memory_budget=memory_budget):
        return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)


def aot_eager_backend(partition_fn: PartitionFn) -> Callable[..., Any]:
    """The ``aot_eager`` backend (no code generation) partitioning each joint graph with ``partition_fn``."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    return aot_autograd(
        fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=partition_fn, keep_inference_input_mutations=True
    )
