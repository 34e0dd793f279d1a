"""``ac_core.compile``: torch.compile with selective checkpointing decided on the joint graph."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from torch import fx, nn

from .._conflicts import check_foreign_wrappers, disable_library_checkpointing, library_checkpointing
from ..checkpointing import _plan, apply_activation_checkpointing, checkpointed_blocks, remove_activation_checkpointing
from ..policy import CheckpointType, coerce_checkpoint_type
from ..registry import get_adapter, registered_adapters
from ..spec import AdapterSpec
from .sac import apply_sac_pass
from .save_ops import DEFAULT_SAC_SAVE_OPS, OpSet

logger = logging.getLogger("ac_core")

GRAPH_BACKENDS = ("inductor", "aot_eager")


def sac_partition(
    gm: fx.GraphModule,
    joint_inputs: Sequence[object],
    *,
    save_ops: frozenset[object] | None = None,
    blocks: frozenset[str] | None = None,
    outside_modules: frozenset[str] | None = None,
    partition: Callable[..., tuple[fx.GraphModule, fx.GraphModule]] | None = None,
    **kwargs: Any,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """A ``partition_fn`` for ``aot_autograd``: :func:`apply_sac_pass`, then ``partition`` (min-cut by default)."""
    if partition is None:
        from torch._functorch.partitioners import min_cut_rematerialization_partition as partition
    apply_sac_pass(gm, save_ops, blocks=blocks, outside_modules=outside_modules)
    return partition(gm, joint_inputs, **kwargs)


def sac_aot_eager(
    save_ops: frozenset[object] | None = None,
    blocks: frozenset[str] | None = None,
    outside_modules: frozenset[str] | None = None,
) -> Callable[..., Any]:
    """The ``aot_eager`` backend with :func:`apply_sac_pass` run on each joint graph before partitioning."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    return aot_autograd(
        fw_compiler=boxed_nop,
        bw_compiler=boxed_nop,
        partition_fn=functools.partial(
            sac_partition, save_ops=save_ops, blocks=blocks, outside_modules=outside_modules
        ),
        keep_inference_input_mutations=True,
    )


def sac_inductor_options(
    save_ops: frozenset[object] | None = None,
    options: dict | None = None,
    blocks: frozenset[str] | None = None,
    outside_modules: frozenset[str] | None = None,
) -> dict[str, Any]:
    """``options`` for ``torch.compile(backend="inductor")`` that run :func:`apply_sac_pass` on each joint graph.

    The pass is added to any ``joint_custom_post_pass`` already in ``options``. Being an option, it
    applies to that compile only and is part of inductor's and AOTAutograd's cache keys.
    """
    from ._inductor import SACGraphPass

    merged = dict(options or {})
    existing = merged.get("joint_custom_post_pass")
    ours = SACGraphPass(frozenset(DEFAULT_SAC_SAVE_OPS if save_ops is None else save_ops), blocks, outside_modules)
    if existing is None:
        merged["joint_custom_post_pass"] = ours
    else:
        earlier = list(existing) if isinstance(existing, (list, tuple)) else [existing]
        merged["joint_custom_post_pass"] = [*earlier, ours]
    return merged


def _serving_adapter(model: nn.Module, adapter: AdapterSpec | str | None) -> AdapterSpec | None:
    if adapter is not None:
        return get_adapter(adapter)
    # The graph route needs no block containers, so a model no adapter serves is fine here.
    if any(spec.serves(model) for spec in registered_adapters().values()):
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
    library = library_checkpointing(model)
    if library:
        disable_library_checkpointing(model, level=logging.INFO)
        removed.append(f"the model's own gradient checkpointing on {len(library)} modules")
    if removed:
        logger.info(
            "ac-core: %s is compiled with the graph SAC pass, so eager checkpointing was removed: %s",
            type(model).__name__,
            "; ".join(removed),
        )
    return removed


class _GraphRoute(NamedTuple):
    save_ops: frozenset[object]
    blocks: frozenset[str] | None
    outside_modules: frozenset[str] | None


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


def _prepare_graph_route(
    model: nn.Module, adapter: AdapterSpec | str | None, blocks: Sequence[str] | None, save_ops: Iterable[object]
) -> _GraphRoute:
    """Ready ``model`` for the graph pass: the ops it saves and its blocks' FQNs; raises before changing anything.

    Blocks come from ``blocks=`` or the serving adapter's containers, checked as eager checkpointing
    checks them; with neither, the pass finds them in the graph.
    """
    spec = _serving_adapter(model, adapter)
    save = frozenset(DEFAULT_SAC_SAVE_OPS | (spec.retained_ops() if spec else frozenset()) | set(save_ops))
    OpSet(save)  # reject a malformed op
    named = outside = None
    if blocks is not None or spec is not None:
        plan = _plan(model, CheckpointType.FULL, 1, None if blocks is not None else spec, blocks)
        named = frozenset(fqn for fqn, _, _ in plan)
        outside = _outside_modules(model, named)
    check_foreign_wrappers(model)
    _remove_eager_checkpointing(model)
    if spec is not None and spec.prepare is not None:
        spec.prepare(model)
    return _GraphRoute(save, named, outside)


def compile(
    model: nn.Module,
    checkpointing_type: str | CheckpointType = CheckpointType.OPS,
    n_layer: int = 1,
    *,
    adapter: AdapterSpec | str | None = None,
    blocks: Sequence[str] | None = None,
    save_ops: Iterable[object] = (),
    backend: str = "inductor",
    options: dict[str, Any] | None = None,
    **torch_compile_kwargs: Any,
) -> nn.Module:
    """``torch.compile(model)`` with activation checkpointing by policy; returns the compiled model.

    ``ops`` (the default) checkpoints selectively on the joint forward+backward graph:
    :func:`apply_sac_pass` tags it, and the min-cut partitioner keeps the outputs of
    :data:`DEFAULT_SAC_SAVE_OPS`, of the adapter's attention ops and of ``save_ops``, every other
    matmul, each block's output and whatever runs outside the blocks, and recomputes the rest of
    each block in backward. Blocks are those of ``blocks=`` (container paths) or of the adapter
    (``adapter`` as in :func:`apply_activation_checkpointing`, found from the model's class when
    None); a model no adapter serves needs neither: the pass then finds its blocks in the graph
    (ModuleList items). Eager checkpointing already on the model (ac-core's, diffusers' or
    transformers' own) is removed first and logged, so blocks are not checkpointed twice.
    ``backend`` is ``"inductor"`` or ``"aot_eager"``.

    ``full`` and ``block_skip`` apply eager per-block checkpointing
    (:func:`apply_activation_checkpointing` with ``n_layer``, ``adapter``, ``blocks``) and compile.
    Other keyword arguments (``dynamic``, ``fullgraph``, ``mode`` ...) go to ``torch.compile``.
    """
    import torch

    kind = coerce_checkpoint_type(checkpointing_type)
    if backend not in GRAPH_BACKENDS:
        raise ValueError(
            f"ac_core.compile supports backend='inductor' or 'aot_eager', got {backend!r}; for another "
            "backend, build it with torch._dynamo.backends.common.aot_autograd(partition_fn=...) around "
            "ac_core.apply_sac_pass"
        )
    if options is not None and backend != "inductor":
        raise ValueError(f"options= are inductor options; backend {backend!r} takes none")
    if kind is not CheckpointType.OPS:
        apply_activation_checkpointing(model, kind, n_layer, adapter=adapter, blocks=blocks)
        return torch.compile(model, backend=backend, options=options, **torch_compile_kwargs)

    route = _prepare_graph_route(model, adapter, blocks, save_ops)
    if backend == "aot_eager":
        return torch.compile(
            model, backend=sac_aot_eager(route.save_ops, route.blocks, route.outside_modules), **torch_compile_kwargs
        )
    mode = torch_compile_kwargs.pop("mode", None)
    if mode is not None:  # torch.compile takes mode or options, not both: spell the mode as options
        from torch._inductor import list_mode_options

        options = {**list_mode_options(mode, torch_compile_kwargs.get("dynamic")), **(options or {})}
    options = sac_inductor_options(route.save_ops, options, route.blocks, route.outside_modules)
    return torch.compile(model, backend="inductor", options=options, **torch_compile_kwargs)
