"""One traced training step whose joint graphs are partitioned as many ways as asked, without tracing again.

An ``aot_eager`` step partitions each joint forward+backward graph exactly as AOTAutograd traced it, and the
partition is what :class:`~.compiled.CompiledActivations` measures. So a copy of each joint graph, kept at trace
time and partitioned later under any :class:`~ac_core.graph.GraphRoute` (a plan's decisions, torch's memory
budget), gives the figures :func:`~.compiled.compiled_activations` would measure compiling on ``aot_eager`` with
that route, for the cost of one trace and one step: what a frontier of many routes on one model needs.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch._guards import TracingContext, detect_fake_mode, tracing

from ..graph import GraphRoute, aot_eager_backend, prepare_graph_route
from ..policies import GraphDecisions
from ..spec import ModelCase
from .compiled import CompiledActivations, _measure, _Recorder


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    # Partitioning and the pass's tags edit the graph they are given; a copy shares values, not nodes.
    with warnings.catch_warnings():  # torch's own pytree deprecation, raised by copying the codegen
        warnings.simplefilter("ignore", FutureWarning)
        return fx.GraphModule(gm, copy.deepcopy(gm.graph))


@dataclass(frozen=True)
class _Joint:
    graph: fx.GraphModule
    inputs: Sequence[object]
    kwargs: dict[str, Any]
    fake_mode: Any  # the trace's: partitioning a graph with random ops makes fake RNG states in it


class JointGraphs:
    """The joint graphs of one traced training step of a model readied for the graph pass (see
    :func:`capture_joint_graphs`); ``route`` is that model's :class:`~ac_core.graph.GraphRoute` with no decisions,
    ``loss`` the traced step's."""

    def __init__(self, joints: Sequence[_Joint], route: GraphRoute, loss: float) -> None:
        self.joints = tuple(joints)
        self.route = route
        self.loss = loss

    def measure(self, decisions: GraphDecisions) -> CompiledActivations:
        """What the model's route following ``decisions`` (a policy's) saves and recomputes."""
        return self.partition(self.route.following(decisions))

    def partition(self, route: GraphRoute) -> CompiledActivations:
        """What ``route`` saves and recomputes over every joint graph, each partitioned anew on a copy."""
        recorder = _Recorder()
        partition = route.partition_fn()
        for joint in self.joints:
            with tracing(TracingContext(joint.fake_mode)):
                fw, bw = partition(_copy(joint.graph), joint.inputs, **joint.kwargs)
            recorder.record(fw, bw, **joint.kwargs)
        return recorder.result(self.loss)


def capture_joint_graphs(
    case: ModelCase, *, adapter: Any = None, blocks: Sequence[str] | None = None, **torch_compile_kwargs: Any
) -> JointGraphs:
    """Ready ``case.model`` for the graph pass (as :func:`ac_core.compile` does, with ``adapter`` or ``blocks``),
    compile it on ``aot_eager``, run one training step (partitioned by plain min-cut; gradients land on the model)
    and keep each joint graph it traced for :meth:`JointGraphs.partition`."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    route = prepare_graph_route(case.model, adapter, blocks)
    joints: list[_Joint] = []

    def keep(gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any) -> Any:
        joints.append(_Joint(_copy(gm), joint_inputs, dict(kwargs), detect_fake_mode(joint_inputs)))
        return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)

    torch._dynamo.reset()
    compiled = torch.compile(case.model, backend=aot_eager_backend(keep), **torch_compile_kwargs)
    loss = case.loss(compiled(**case.inputs))
    loss.backward()
    torch._dynamo.reset()
    return JointGraphs(joints, route, loss.item())


def route_measurer(
    make_case: Callable[[], ModelCase],
    *,
    adapter: Any = None,
    blocks: Sequence[str] | None = None,
    backend: str = "aot_eager",
) -> Callable[[GraphDecisions], CompiledActivations]:
    """A function measuring the graph route under any :class:`~ac_core.GraphDecisions` on the model ``make_case``
    builds: on ``aot_eager`` each joint graph of one captured step partitioned anew (:func:`capture_joint_graphs`);
    on ``inductor``, whose joint passes run before partitioning, one compiled step of a fresh case per call."""
    if backend == "aot_eager":
        return capture_joint_graphs(make_case(), adapter=adapter, blocks=blocks).measure
    if backend != "inductor":
        raise ValueError(f"backend must be 'aot_eager' or 'inductor', got {backend!r}")

    def measure(decisions: GraphDecisions) -> CompiledActivations:
        case = make_case()
        route = prepare_graph_route(case.model, adapter, blocks).following(decisions)
        return _measure(case, lambda _: route, backend, None, {})

    return measure
