"""``ac_core.compile``: torch.compile with selective checkpointing decided on the joint graph."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, cast

from torch import nn

from .._conflicts import check_foreign_wrappers
from .._deprecated import UNSET, renamed
from ..blocks import resolve_blocks
from ..checkpointing import apply_activation_checkpointing, checkpointed_blocks, remove_activation_checkpointing
from ..libraries.checkpointing import disable_library_checkpointing
from ..policies import (
    CheckpointType,
    GraphRequest,
    PolicyConfig,
    containers_for,
    graph_decisions,
    graph_route_refusal,
    policy_config,
    policy_traits,
    registered_policies,
)
from ..registry import find_adapter, get_adapter
from ..spec import AdapterSpec
from .route import GraphRoute
from .save_ops import DEFAULT_SAC_SAVE_OPS

if TYPE_CHECKING:
    from ..budget.step_budget import StepBudget

logger = logging.getLogger("ac_core")

GRAPH_BACKENDS = ("inductor", "aot_eager")


def _serving_adapter(model: nn.Module, adapter: AdapterSpec | str | None) -> AdapterSpec | None:
    if adapter is not None:
        return get_adapter(adapter)
    # The graph route needs no block containers, so a model no adapter serves is fine here; a wrapped
    # model (peft, DDP) is served by its inner model's adapter.
    return find_adapter(model)


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


def _step_budget(given: Any, example_inputs: Any) -> Any:
    """A :class:`~ac_core.StepBudget` as the ``budget`` policy planning for it at ``example_inputs``; anything
    else as given. The policy comes from the registry: the budget package sits above this one."""
    is_policy = isinstance(given, str | CheckpointType | PolicyConfig)
    if example_inputs is None:
        if not is_policy:
            raise ValueError(
                f"ac_core.compile takes a policy (a name, a CheckpointType or a config), or a StepBudget with "
                f"example_inputs= (one forward's: it plans first); got {given!r}"
            )
        return given
    if is_policy:
        raise ValueError(
            "ac_core.compile's example_inputs= go with a StepBudget; for a memory budget of held bytes pass "
            "ac_core.Budget(memory_budget, example_inputs=...)"
        )
    budget = cast(Any, registered_policies(every=True)["budget"])
    return budget(given, example_inputs=example_inputs)


def compile(
    model: nn.Module,
    checkpointing_type: str | CheckpointType | PolicyConfig | StepBudget = CheckpointType.OPS,
    n_layer: int | None = None,
    *,
    adapter: AdapterSpec | str | None = None,
    blocks: Sequence[str] | None = None,
    retain: Iterable[object] = (),
    backend: str = "inductor",
    options: dict[str, Any] | None = None,
    save_ops: Any = UNSET,
    solver: str = "ac-core",
    example_inputs: Any = None,
    **torch_compile_kwargs: Any,
) -> nn.Module:
    """``torch.compile(model)`` with activation checkpointing by policy; returns the compiled model.

    Every policy with graph-route decisions (see :func:`~ac_core.register_policy`) is checkpointed on the joint
    forward+backward graph: :func:`apply_sac_pass` tags it and the min-cut partitioner saves and recomputes as
    tagged. ``ops`` / ``Ops()`` (the default) keeps the outputs of :data:`DEFAULT_SAC_SAVE_OPS`, of the
    adapter's attention ops and of ``retain`` (op names or op objects; ``Ops(retain=...)`` adds to them), every
    other matmul, each block's output and whatever runs outside the blocks, and recomputes the rest of each
    block in backward; a model no adapter serves needs neither ``adapter`` nor ``blocks=``: the pass then finds
    its blocks in the graph (ModuleList or ModuleDict items). Any other policy's selections become per-block
    decisions (``full`` and ``block_skip``: their blocks recomputed whole, the rest saved; a third party's
    ``OPS`` blocks keep their retained ops), on the blocks of ``blocks=`` (container paths) or of the adapter
    (``adapter`` as in :func:`apply_activation_checkpointing`, found from the model's class when None).
    A :class:`~ac_core.CheckpointPlan` (from :func:`ac_core.plan_activation_checkpointing`) follows the plan:
    per block, its ops all saved (``none``), all recomputed (``full``) or recomputed but for the planned
    occurrences. ``ac_core.Budget(memory_budget, example_inputs=...)`` plans on the model first
    (``solver="ac-core"``), or with ``solver="torch"`` leaves the choice to torch's partitioner, setting
    ``torch._functorch.config.activation_memory_budget`` for this compile to the budget's fraction of what
    ``none`` holds (torch reads it as a fraction of what its default partition saves above the graph's inputs:
    the same number, another reference; ``ac-core compare --budget`` measures both). A policy registered with
    no graph route (a reason instead) is applied eagerly (:func:`apply_activation_checkpointing`) and compiled.
    ``ac_core.compile(model, ac_core.StepBudget(...), example_inputs=...)`` is
    ``Budget(StepBudget(...), example_inputs=...)``: it plans for the whole step's peak first.

    Eager checkpointing already on the model (ac-core's, diffusers' or transformers' own) is removed first and
    logged, so blocks are not checkpointed twice. ``backend`` is ``"inductor"`` or ``"aot_eager"``. Other
    keyword arguments (``dynamic``, ``fullgraph``, ``mode`` ...) go to ``torch.compile``. ``save_ops=`` is the
    old name of ``retain=``.
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
    config = policy_config(_step_budget(checkpointing_type, example_inputs), n_layer)
    blocks = containers_for(config, adapter, blocks)  # a plan made with blocks= names its own
    if solver != "ac-core" and not policy_traits(config).budgeted:
        raise ValueError(f"solver={solver!r} chooses who solves a memory budget; pass ac_core.Budget(...) with it")
    eager_reason = graph_route_refusal(config)
    if eager_reason is not None:
        logger.info("ac-core: %r is checkpointed eagerly inside the compiled model: %s", config.name, eager_reason)
        _check_dynamic_eager(config, torch_compile_kwargs.get("dynamic"))
        apply_activation_checkpointing(model, config, adapter=adapter, blocks=blocks)
        return _compiled(torch.compile(model, backend=backend, options=options, **torch_compile_kwargs))

    request = GraphRequest(model, adapter, blocks, solver)
    if not policy_traits(config).finds_blocks:
        request.blocks()  # a model no adapter serves, or a wrong blocks=, is refused before anything changes
    route = prepare_graph_route(model, adapter, blocks, retain)
    decisions = graph_decisions(config, request)
    route = route.following(decisions)
    if backend == "aot_eager":
        compiled = _compiled(torch.compile(model, backend=route.aot_eager(), **torch_compile_kwargs))
    else:
        mode = torch_compile_kwargs.pop("mode", None)
        if mode is not None:  # torch.compile takes mode or options, not both: spell the mode as options
            from torch._inductor import list_mode_options

            options = {**list_mode_options(mode, torch_compile_kwargs.get("dynamic")), **(options or {})}
        inductor_options = route.inductor_options(options)
        compiled = _compiled(torch.compile(model, backend="inductor", options=inductor_options, **torch_compile_kwargs))
    if decisions.on_compiled is not None:
        decisions.on_compiled(compiled)
    return compiled
