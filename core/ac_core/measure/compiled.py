"""What a compiled training step keeps for backward and recomputes there, read from its partitioned graphs.

The experiments built on it (``ac-core compare``) are in :mod:`ac_core.experiments`.
"""

from __future__ import annotations

import copy
import functools
import operator
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import fx, nn
from torch.fx.node import map_arg
from torch.multiprocessing.reductions import StorageWeakRef

from ..graph import GraphRoute, aot_eager_backend, prepare_graph_route
from ..graph.save_ops import op_name
from ..op_names import op_matches
from ..policies import GraphRequest, Ops, PolicyConfig, containers_for, graph_decisions
from ..spec import ModelCase


class RecomputedOp(NamedTuple):
    """One forward op a backward graph runs again: its name, FLOPs, the bytes of the storages it reads and writes,
    and its first floating output's dtype (``"float32"``; None without one): what a roofline prices it by."""

    op: str
    flops: int
    bytes_moved: int
    dtype: str | None


@dataclass(frozen=True)
class CompiledActivations:
    """What the partitioner kept for backward and what backward recomputes, summed over a model's graphs.

    ``saved_bytes`` and ``saved_tensors`` count distinct storages among the forward graphs' outputs
    that feed backward, leaving out graph inputs (parameters, buffers, the batch) and views of them.
    ``recomputed`` counts, by op name, the forward ops the backward graphs run again (views and
    getitems left out); ``forward`` counts the forward graphs' ops the same way. ``graphs`` is the
    number of forward/backward pairs measured, ``loss`` the measured step's loss. ``recompute_flops``: the
    FLOPs of the recomputed ops, by ``FlopCounterMode``'s formulas (ours for CPU SDPA) on their shapes;
    ``recomputed_ops`` each of them, as a roofline prices it (see :class:`RecomputedOp`).
    """

    saved_bytes: int
    saved_tensors: int
    recomputed: Mapping[str, int] = field(default_factory=dict)
    forward: Mapping[str, int] = field(default_factory=dict)
    graphs: int = 0
    loss: float | None = None
    recompute_flops: int = 0
    recomputed_ops: tuple[RecomputedOp, ...] = ()

    @property
    def recompute_count(self) -> int:
        return sum(self.recomputed.values())

    def recomputes(self, names: Iterable[str]) -> int:
        """How many times backward re-runs any op in ``names`` (with or without overload)."""
        return _count(self.recomputed, names)

    def runs_forward(self, names: Iterable[str]) -> int:
        """How many times the forward graphs run any op in ``names``."""
        return _count(self.forward, names)


def _count(counts: Mapping[str, int], names: Iterable[str]) -> int:
    wanted = set(names)
    return sum(n for op, n in counts.items() if op_matches(op, wanted))


def _nbytes(value: torch.Tensor) -> int:
    from torch.fx.experimental.symbolic_shapes import optimization_hint

    return optimization_hint(value.untyped_storage().nbytes())


def _flops(node: fx.Node, target: object, args: tuple | None = None) -> int:
    """FLOPs of one graph node running ``target`` on ``args`` (default: the node's own), from torch's flop formulas
    (and ours for CPU SDPA) on their recorded shapes."""
    from torch.utils.flop_counter import flop_registry

    from .flops import register_sdpa_flop_formulas

    register_sdpa_flop_formulas()
    formula = flop_registry.get(getattr(target, "overloadpacket", None))
    if formula is None:
        return 0
    values, kwargs = map_arg((node.args if args is None else args, node.kwargs), lambda arg: arg.meta.get("val"))
    return int(formula(*values, **kwargs, out_val=node.meta.get("val")))


def _storages(value: object) -> dict[StorageWeakRef, int]:
    tensors = value if isinstance(value, (tuple, list)) else (value,)
    return {StorageWeakRef(t.untyped_storage()): _nbytes(t) for t in tensors if isinstance(t, torch.Tensor)}


def _recomputed_op(node: fx.Node, name: str, flops: int) -> RecomputedOp:
    """``node`` priced for a roofline: the storages of its tensor arguments (read) and of its outputs (written)."""
    reads: dict[StorageWeakRef, int] = {}
    for arg in node.all_input_nodes:
        reads |= _storages(arg.meta.get("val"))
    value = node.meta.get("val")
    outputs = value if isinstance(value, (tuple, list)) else (value,)
    floating = next((t for t in outputs if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
    dtype = None if floating is None else str(floating.dtype).removeprefix("torch.")
    return RecomputedOp(name, flops, sum(reads.values()) + sum(_storages(value).values()), dtype)


def _is_view_or_getitem(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return node.target is operator.getitem or (
        schema is not None and any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
    )


class _Recorder:
    """Collects saved storages and recomputed ops from each (forward, backward) pair a partitioner returns."""

    def __init__(self) -> None:
        self.saved: dict[StorageWeakRef, int] = {}
        self.recomputed: Counter[str] = Counter()
        self.forward: Counter[str] = Counter()
        self.graphs = 0
        self.recompute_flops = 0
        self.recomputed_ops: list[RecomputedOp] = []

    def record(self, fw: fx.GraphModule, bw: fx.GraphModule, *, num_fwd_outputs: int, **_: Any) -> None:
        self.graphs += 1
        inputs = {
            StorageWeakRef(n.meta["val"].untyped_storage())
            for n in fw.graph.nodes
            if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
        }
        output = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
        for node in output.args[0][num_fwd_outputs:]:
            value = node.meta.get("val") if isinstance(node, fx.Node) else None
            if not isinstance(value, torch.Tensor):
                continue  # sizes saved as SymInts
            storage = StorageWeakRef(value.untyped_storage())
            if storage not in inputs:
                self.saved[storage] = _nbytes(value)
        forward_names = set()
        for node in fw.graph.nodes:
            if node.op == "call_function":
                forward_names.add(node.name)
                if not _is_view_or_getitem(node):
                    self.forward[op_name(node.target) or str(node.target)] += 1
        replay = getattr(torch.ops.higher_order, "run_with_rng_state", None)
        for node in bw.graph.nodes:
            if node.op != "call_function":
                continue
            if node.target is replay:  # a random op recomputed under the forward's saved RNG state: (state, op, *args)
                target, flops = node.args[1], _flops(node, node.args[1], node.args[2:])
            # The partitioner copies a recomputed node into backward under its forward name.
            elif node.name in forward_names and not _is_view_or_getitem(node):
                target, flops = node.target, _flops(node, node.target)
            else:
                continue
            name = op_name(target) or str(target)
            self.recomputed[name] += 1
            self.recompute_flops += flops
            self.recomputed_ops.append(_recomputed_op(node, name, flops))

    def partition(
        self,
        inner: Callable[..., tuple[fx.GraphModule, fx.GraphModule]],
        gm: fx.GraphModule,
        joint_inputs: Sequence[object],
        baseline: _Recorder | None = None,
        **kwargs: Any,
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        """Partition with ``inner`` and record; ``baseline`` also records plain min-cut on a copy of the graph."""
        if baseline is not None:
            from torch._functorch.partitioners import min_cut_rematerialization_partition

            # Partitioning edits the graph it is given; the copy shares values, not nodes.
            with warnings.catch_warnings():  # torch's own pytree deprecation, raised by copying the codegen
                warnings.simplefilter("ignore", FutureWarning)
                untouched = fx.GraphModule(gm, copy.deepcopy(gm.graph))
            baseline.record(*min_cut_rematerialization_partition(untouched, joint_inputs, **kwargs), **kwargs)
        fw, bw = inner(gm, joint_inputs, **kwargs)
        self.record(fw, bw, **kwargs)
        return fw, bw

    def result(self, loss: float | None) -> CompiledActivations:
        return CompiledActivations(
            sum(self.saved.values()),
            len(self.saved),
            dict(self.recomputed),
            dict(self.forward),
            self.graphs,
            loss,
            self.recompute_flops,
            tuple(self.recomputed_ops),
        )


def _inductor_recording_options(recorder: _Recorder, route: GraphRoute | None) -> dict[str, Any]:
    """Inductor options that record the partition (and run the SAC pass for a graph ``route``)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    # torch's budget is a partitioner of its own (no pass): record around it.
    budgeted = route is not None and route.memory_budget is not None
    inner = route.partition_fn() if route is not None and budgeted else min_cut_rematerialization_partition

    class _RecordingPartitioner(CustomPartitionerFn):
        def __call__(self, gm, joint_inputs, **kwargs):
            return recorder.partition(inner, gm, joint_inputs, **kwargs)

        def uuid(self) -> None:
            return None  # never cached: a cache hit would skip the partitioner and record nothing

    options: dict[str, Any] = {"custom_partitioner_fn": _RecordingPartitioner()}
    return options if route is None or route.memory_budget is not None else route.inductor_options(options)


def _measure(
    case: ModelCase,
    route_of: Callable[[nn.Module], GraphRoute] | None,
    backend: str,
    baseline: _Recorder | None,
    torch_compile_kwargs: dict[str, Any],
) -> CompiledActivations:
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    if backend not in ("aot_eager", "inductor"):
        raise ValueError(f"backend must be 'aot_eager' or 'inductor', got {backend!r}")
    route = None if route_of is None else route_of(case.model)
    torch._dynamo.reset()
    recorder = _Recorder()
    if backend == "aot_eager":
        inner = min_cut_rematerialization_partition if route is None else route.partition_fn()
        compiler = aot_eager_backend(functools.partial(recorder.partition, inner, baseline=baseline))
        compiled = torch.compile(case.model, backend=compiler, **torch_compile_kwargs)
    else:
        options = _inductor_recording_options(recorder, route)
        compiled = torch.compile(case.model, backend="inductor", options=options, **torch_compile_kwargs)
    loss = case.loss(compiled(**case.inputs))
    loss.backward()
    torch._dynamo.reset()
    return recorder.result(loss.item())


def compiled_activations(
    case: ModelCase,
    *,
    sac: bool = False,
    policy: PolicyConfig | None = None,
    solver: str = "ac-core",
    adapter: Any = None,
    blocks: Sequence[str] | None = None,
    retain: Iterable[object] = (),
    backend: str = "aot_eager",
    **torch_compile_kwargs: Any,
) -> CompiledActivations:
    """Compile ``case.model``, run one training step (gradients land on ``case.model``), and measure it.

    ``sac=False`` compiles the model as it is, eager checkpointing included: apply that first to
    measure it. ``sac=True`` takes the graph route of ``ac_core.compile(case.model, policy, solver=solver)``
    (``policy`` default ``Ops()``: the pass's own save set) with ``adapter``, ``blocks`` and ``retain`` (eager
    checkpointing removed first): a plan's decisions, a budget planned by ac-core or left to torch's
    ``activation_memory_budget`` (``solver="torch"``), any policy's selections.
    ``backend`` is ``"aot_eager"`` (seconds) or ``"inductor"`` (inductor's joint-graph passes run
    before partitioning; slower to compile).
    """
    route_of = None
    if sac:
        route_of = functools.partial(
            _graph_route, adapter=adapter, blocks=blocks, retain=retain, policy=policy, solver=solver
        )
    return _measure(case, route_of, backend, None, torch_compile_kwargs)


def _graph_route(
    model: nn.Module,
    *,
    adapter: Any,
    blocks: Sequence[str] | None,
    retain: Iterable[object] = (),
    policy: PolicyConfig | None = None,
    solver: str = "ac-core",
) -> GraphRoute:
    """The route :func:`ac_core.compile` takes for ``model`` under ``policy``, as the policy registry decides it."""
    config = Ops() if policy is None else policy
    blocks = containers_for(config, adapter, blocks)
    route = prepare_graph_route(model, adapter, blocks, retain)
    return route.following(graph_decisions(config, GraphRequest(model, adapter, blocks, solver)))


def with_and_without_pass(
    case: ModelCase,
    *,
    adapter: Any = None,
    blocks: Sequence[str] | None = None,
    retain: Iterable[object] = (),
    **torch_compile_kwargs: Any,
) -> tuple[CompiledActivations, CompiledActivations]:
    """(without, with) the graph pass, from one ``aot_eager`` trace: each joint graph is partitioned twice.

    Half the cost of two :func:`compiled_activations` calls. The training step runs with the pass,
    so ``case.model``'s gradients and the second result's ``loss`` are the pass's; the first
    result has no loss.
    """
    baseline = _Recorder()
    route_of = functools.partial(_graph_route, adapter=adapter, blocks=blocks, retain=retain)
    ours = _measure(case, route_of, "aot_eager", baseline, torch_compile_kwargs)
    return baseline.result(None), ours
