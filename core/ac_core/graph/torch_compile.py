"""``ac_core.compile``: torch.compile with selective checkpointing decided on the joint graph."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import fx, nn

from .._conflicts import check_foreign_wrappers
from .._deprecated import UNSET, renamed
from ..checkpointing import apply_activation_checkpointing, checkpointed_blocks, remove_activation_checkpointing
from ..library_checkpointing import disable_library_checkpointing
from ..plan import resolve_blocks
from ..policies import Ops, PolicyConfig, containers_for, policy_config
from ..policy import CheckpointType
from ..registry import get_adapter, registered_adapters, unwrap_model
from ..spec import AdapterSpec
from .keep_planned import BlockDecision
from .sac import apply_sac_pass
from .save_ops import DEFAULT_SAC_SAVE_OPS, OpSet

logger = logging.getLogger("ac_core")

GRAPH_BACKENDS = ("inductor", "aot_eager")
# Who turns a memory budget into save decisions on the compiled route: ac-core's plan (profiled per block,
# solved across blocks) or torch's activation_memory_budget (a knapsack per compiled graph).
SOLVERS = ("ac-core", "torch")

PartitionFn = Callable[..., tuple[fx.GraphModule, fx.GraphModule]]


def sac_partition(
    gm: fx.GraphModule,
    joint_inputs: Sequence[object],
    *,
    retain: frozenset[object] | None = None,
    blocks: frozenset[str] | None = None,
    outside_modules: frozenset[str] | None = None,
    partition: PartitionFn | None = None,
    save_ops: Any = UNSET,
    plan: Sequence[BlockDecision] | None = None,
    **kwargs: Any,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """A ``partition_fn`` for ``aot_autograd``: :func:`apply_sac_pass`, then ``partition`` (min-cut by default)."""
    retain = renamed("sac_partition", "save_ops", "retain", save_ops, retain, None)
    if partition is None:
        from torch._functorch.partitioners import min_cut_rematerialization_partition as partition
    apply_sac_pass(gm, retain, blocks=blocks, outside_modules=outside_modules, plan=plan)
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


@dataclass(frozen=True)
class GraphRoute:
    """What the graph pass needs for one model: the ops whose outputs it keeps, the blocks' FQNs, and the
    modules outside them (None where the pass is to find blocks in the graph itself).

    ``plan``: a checkpoint plan's per-block decisions, which the pass follows instead of ``retain``.
    ``memory_budget``: no pass; torch's partitioner solves ``activation_memory_budget`` (a fraction) instead.
    :func:`prepare_graph_route` makes one from a model; :func:`ac_core.compile` and the measurements
    build their backends from it.
    """

    retain: frozenset[object] = DEFAULT_SAC_SAVE_OPS
    blocks: frozenset[str] | None = None
    outside_modules: frozenset[str] | None = None
    plan: tuple[BlockDecision, ...] | None = None
    memory_budget: float | None = None

    def __post_init__(self) -> None:
        OpSet(self.retain)  # reject a malformed op
        if self.memory_budget is not None and not 0 <= self.memory_budget <= 1:
            raise ValueError(f"torch's activation_memory_budget is a fraction in [0, 1], got {self.memory_budget!r}")
        if self.memory_budget is not None and self.plan is not None:
            raise ValueError("a graph route follows a checkpoint plan or torch's memory budget, not both")

    def partition_fn(self) -> PartitionFn:
        """:func:`sac_partition` bound to this route (or :func:`budget_partition` for torch's budget)."""
        if self.memory_budget is not None:
            return functools.partial(budget_partition, memory_budget=self.memory_budget)
        return functools.partial(
            sac_partition, retain=self.retain, blocks=self.blocks, outside_modules=self.outside_modules, plan=self.plan
        )

    def aot_eager(self) -> Callable[..., Any]:
        """The ``aot_eager`` backend with the pass run on each joint graph before partitioning."""
        return aot_eager_backend(self.partition_fn())

    def inductor_options(self, options: dict[str, Any] | None = None) -> dict[str, Any]:
        """``options`` for ``torch.compile(backend="inductor")`` that run the pass on each joint graph.

        The pass is added to any ``joint_custom_post_pass`` already in ``options``. Being an option, it
        applies to that compile only and is part of inductor's and AOTAutograd's cache keys.
        """
        from ._inductor import BudgetPartitioner, SACGraphPass

        merged = dict(options or {})
        if self.memory_budget is not None:
            if merged.get("custom_partitioner_fn") is not None:
                raise ValueError("options= has a custom_partitioner_fn; torch's memory budget needs its own")
            merged["custom_partitioner_fn"] = BudgetPartitioner(self.memory_budget)
            return merged
        existing = merged.get("joint_custom_post_pass")
        ours = SACGraphPass(self.retain, self.blocks, self.outside_modules, self.plan)
        if existing is None:
            merged["joint_custom_post_pass"] = ours
        else:
            earlier = list(existing) if isinstance(existing, (list, tuple)) else [existing]
            merged["joint_custom_post_pass"] = [*earlier, ours]
        return merged


def sac_aot_eager(
    retain: frozenset[object] | None = None,
    blocks: frozenset[str] | None = None,
    outside_modules: frozenset[str] | None = None,
    *,
    save_ops: Any = UNSET,
) -> Callable[..., Any]:
    """The ``aot_eager`` backend with :func:`apply_sac_pass` run on each joint graph before partitioning."""
    retain = renamed("sac_aot_eager", "save_ops", "retain", save_ops, retain, None)
    return GraphRoute(
        DEFAULT_SAC_SAVE_OPS if retain is None else frozenset(retain), blocks, outside_modules
    ).aot_eager()


def sac_inductor_options(
    retain: frozenset[object] | None = None,
    options: dict | None = None,
    blocks: frozenset[str] | None = None,
    outside_modules: frozenset[str] | None = None,
    *,
    save_ops: Any = UNSET,
) -> dict[str, Any]:
    """``options`` for ``torch.compile(backend="inductor")`` that run :func:`apply_sac_pass` on each joint graph."""
    retain = renamed("sac_inductor_options", "save_ops", "retain", save_ops, retain, None)
    route = GraphRoute(DEFAULT_SAC_SAVE_OPS if retain is None else frozenset(retain), blocks, outside_modules)
    return route.inductor_options(options)


def _serving_adapter(model: nn.Module, adapter: AdapterSpec | str | None) -> AdapterSpec | None:
    if adapter is not None:
        return get_adapter(adapter)
    # The graph route needs no block containers, so a model no adapter serves is fine here; a wrapped
    # model (peft, DDP) is served by its inner model's adapter.
    adapters = registered_adapters().values()
    if any(spec.serves(inner) for _, inner in unwrap_model(model) for spec in adapters):
        return get_adapter(model)
    return None


def _remove_eager_checkpointing(model: nn.Module) -> list[str]:
    """Take ac-core's and the model library's eager checkpointing off ``model``; returns what was removed.

    Eager checkpointing under the graph pass checkpoints twice: its regions reach the joint graph
    already tagged, the pass overrides their tags, and the partitioner either rejects the result
    (a multi-output op forced to MUST_SAVE) or silently follows one policy over the other.
    """
    removed = []
    blocks = checkpointed_blocks(model)
    if blocks:
        remove_activation_checkpointing(model)
        removed.append(f"ac-core checkpointing on {len(blocks)} blocks")
    library = disable_library_checkpointing(model, level=None)
    if library:
        removed.append(f"the model's own gradient checkpointing on {len(library)} modules")
    if removed:
        logger.info(
            "ac-core: %s is compiled with the graph SAC pass, so eager checkpointing was removed: %s",
            type(model).__name__,
            "; ".join(removed),
        )
    return removed


def _outside_modules(model: nn.Module, blocks: frozenset[str]) -> frozenset[str]:
    """FQNs of ``model``'s modules outside every block that no module inside one could be spelled as.

    A frame dynamo compiles after a graph break inside a block is rooted at that block (or at a
    module in it), so its module paths are suffixes of inside FQNs: those are left out.
    """
    inside: set[str] = set()
    outside: set[str] = set()
    for name, _ in model.named_modules():
        if not name:
            continue
        segments = name.split(".")
        if any(".".join(segments[:i]) in blocks for i in range(1, len(segments) + 1)):
            inside.update(".".join(segments[i:]) for i in range(len(segments)))
        else:
            outside.add(name)
    return frozenset(outside - inside)


def prepare_graph_route(
    model: nn.Module,
    adapter: AdapterSpec | str | None = None,
    blocks: Sequence[str] | None = None,
    retain: Iterable[object] = (),
) -> GraphRoute:
    """Ready ``model`` for the graph pass and return its :class:`GraphRoute`; raises before changing anything.

    Blocks come from ``blocks=`` or the serving adapter's containers, resolved as eager checkpointing
    resolves them (:func:`ac_core.resolve_blocks`); with neither, the pass finds them in the graph. The
    kept ops are :data:`DEFAULT_SAC_SAVE_OPS`, the adapter's attention ops and ``retain``. Eager
    checkpointing already on the model (ac-core's, or the library's own) is removed, and logged.
    """
    spec = _serving_adapter(model, adapter)
    named = outside = None
    if blocks is not None or spec is not None:
        named = resolve_blocks(model, spec if blocks is None else adapter, blocks).paths
        outside = _outside_modules(model, named)
    kept = spec.retained_ops() if spec is not None else frozenset()
    route = GraphRoute(frozenset(DEFAULT_SAC_SAVE_OPS | kept | set(retain)), named, outside)
    check_foreign_wrappers(model)
    _remove_eager_checkpointing(model)
    if spec is not None and spec.prepare is not None:
        spec.prepare(model)
    return route


def _compiled(result: Any) -> nn.Module:
    # torch.compile of a module returns the module's OptimizedModule, typed as a plain callable.
    assert isinstance(result, nn.Module)
    return result


def _check_dynamic_eager(config: PolicyConfig, dynamic: object) -> None:
    """Refuse the combination torch 2.13 fails on deep inside dynamo, naming the ways that work.

    dynamic=True over eager checkpointing (ours, diffusers' or torch's checkpoint_wrapper alike) raises
    "lift_tracked_freevar_to_input should not be called on root SubgraphTracer" once a block takes a
    Python float (pytorch/pytorch#193194); specializing floats, or the graph route, avoid it.
    """
    import torch

    if dynamic is True and not torch._dynamo.config.specialize_float:
        raise ValueError(
            f"ac_core.compile(..., {config.name!r}, dynamic=True) checkpoints eagerly inside the compiled model, which "
            "torch 2.13 fails to trace with dynamic shapes for blocks that take a Python float "
            "(pytorch/pytorch#193194). Use the graph route, ac_core.compile(model, 'ops', dynamic=True), or set "
            "torch._dynamo.config.specialize_float = True before compiling."
        )


def compile(
    model: nn.Module,
    checkpointing_type: str | CheckpointType | PolicyConfig = CheckpointType.OPS,
    n_layer: int | None = None,
    *,
    adapter: AdapterSpec | str | None = None,
    blocks: Sequence[str] | None = None,
    retain: Iterable[object] = (),
    backend: str = "inductor",
    options: dict[str, Any] | None = None,
    save_ops: Any = UNSET,
    solver: str = "ac-core",
    **torch_compile_kwargs: Any,
) -> nn.Module:
    """``torch.compile(model)`` with activation checkpointing by policy; returns the compiled model.

    ``ops`` / ``Ops()`` (the default) checkpoints selectively on the joint forward+backward graph:
    :func:`apply_sac_pass` tags it, and the min-cut partitioner keeps the outputs of
    :data:`DEFAULT_SAC_SAVE_OPS`, of the adapter's attention ops and of ``retain`` (op names or op
    objects; ``Ops(retain=...)`` adds to them), every other matmul, each block's output and whatever
    runs outside the blocks, and recomputes the rest of each block in backward. Blocks are those of
    ``blocks=`` (container paths) or of the adapter (``adapter`` as in
    :func:`apply_activation_checkpointing`, found from the model's class when None); a model no adapter
    serves needs neither: the pass then finds its blocks in the graph (ModuleList or ModuleDict items). Eager
    checkpointing already on the model (ac-core's, diffusers' or transformers' own) is removed first and
    logged, so blocks are not checkpointed twice. ``backend`` is ``"inductor"`` or ``"aot_eager"``.

    ``full`` and ``block_skip`` (and any other policy) apply eager per-block checkpointing
    (:func:`apply_activation_checkpointing` with ``n_layer``, ``adapter``, ``blocks``) and compile.
    A :class:`~ac_core.budget.CheckpointPlan` (from :func:`ac_core.plan_activation_checkpointing`) takes the
    graph route with the plan's decisions: per block, its ops all saved (``none``), all recomputed (``full``)
    or recomputed but for the planned occurrences. ``ac_core.Budget(memory_budget, example_inputs=...)`` plans
    on the model first (``solver="ac-core"``), or with ``solver="torch"`` leaves the choice to torch's
    partitioner, setting ``torch._functorch.config.activation_memory_budget`` for this compile to the budget's
    fraction of what ``none`` holds (torch reads it as a fraction of what its default partition saves above
    the graph's inputs: the same number, another reference; ``ac-core compare --budget`` measures both).
    Other keyword arguments (``dynamic``, ``fullgraph``, ``mode`` ...) go to ``torch.compile``.
    ``save_ops=`` is the old name of ``retain=``.
    """
    import torch

    retain = renamed("compile", "save_ops", "retain", save_ops, retain, ())
    if backend not in GRAPH_BACKENDS:
        raise ValueError(
            f"ac_core.compile supports backend='inductor' or 'aot_eager', got {backend!r}; for another "
            "backend, build it with torch._dynamo.backends.common.aot_autograd(partition_fn=...) around "
            "ac_core.apply_sac_pass"
        )
    if options is not None and backend != "inductor":
        raise ValueError(f"options= are inductor options; backend {backend!r} takes none")
    if isinstance(retain, (str, bytes)):
        raise TypeError(f"retain takes a collection of ops, e.g. {{{retain!r}}}, not a single string")
    config = policy_config(checkpointing_type, n_layer)
    blocks = containers_for(config, adapter, blocks)  # a plan made with blocks= names its own
    from .budget_route import budget_route, is_budget_config, refuse_other_inputs

    budgeted = is_budget_config(config)
    if solver != "ac-core" and not budgeted:
        raise ValueError(f"solver={solver!r} chooses who solves a memory budget; pass ac_core.Budget(...) with it")
    if not isinstance(config, Ops) and not budgeted:
        _check_dynamic_eager(config, torch_compile_kwargs.get("dynamic"))
        apply_activation_checkpointing(model, config, adapter=adapter, blocks=blocks)
        return _compiled(torch.compile(model, backend=backend, options=options, **torch_compile_kwargs))

    route = prepare_graph_route(model, adapter, blocks, {*getattr(config, "retain", ()), *retain})
    plan = None
    if budgeted:
        route, plan = budget_route(model, config, route, solver, adapter, blocks)
    if backend == "aot_eager":
        compiled = _compiled(torch.compile(model, backend=route.aot_eager(), **torch_compile_kwargs))
    else:
        mode = torch_compile_kwargs.pop("mode", None)
        if mode is not None:  # torch.compile takes mode or options, not both: spell the mode as options
            from torch._inductor import list_mode_options

            options = {**list_mode_options(mode, torch_compile_kwargs.get("dynamic")), **(options or {})}
        inductor_options = route.inductor_options(options)
        compiled = _compiled(torch.compile(model, backend="inductor", options=inductor_options, **torch_compile_kwargs))
    if plan is not None:
        refuse_other_inputs(compiled, plan)
    return compiled
