"""Applying, replacing and removing activation checkpointing on a model's blocks."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from torch import nn

from . import _forward
from ._conflicts import check_foreign_wrappers, disable_library_checkpointing
from ._containers import module_lists, resolve_containers
from ._versions import check_version
from .errors import AdapterError
from .offload import OffloadConfig
from .offload import model as offload_model
from .ops import DEFAULT_RETAINED_OPS, retained_op_names
from .policy import CheckpointType, coerce_checkpoint_type
from .registry import get_adapter
from .spec import AdapterSpec

logger = logging.getLogger("ac_core")


def _check_n_layer(n_layer: int) -> None:
    if isinstance(n_layer, bool) or not isinstance(n_layer, int) or n_layer < 1:
        raise ValueError(f"n_layer must be an int >= 1 (checkpoint every n-th block), got {n_layer!r}")


def _plan(
    model: nn.Module,
    kind: CheckpointType,
    n_layer: int,
    adapter: AdapterSpec | None,
    blocks: Sequence[str] | None,
) -> list[tuple[str, nn.Module, CheckpointType]]:
    """(FQN, block, policy) for every block to checkpoint; raises on any bad input before anything changes."""
    if blocks is not None:
        if isinstance(blocks, str):
            raise TypeError(f"blocks takes a list of container paths, e.g. blocks=[{blocks!r}]")
        paths, owner = tuple(blocks), "blocks="
    else:
        assert adapter is not None
        model_spec = adapter.model_spec(model)
        if model_spec is None:
            served = ", ".join(m.class_name for m in adapter.models)
            raise AdapterError(
                f"adapter {adapter.name!r} does not serve {type(model).__name__} (it serves {served}); "
                "pass the right adapter, or name the containers with blocks=[...]"
            )
        check_version(adapter, model_spec)
        paths, owner = model_spec.containers, f"adapter {adapter.name!r}"
    containers = resolve_containers(model, paths, owner)
    plan: list[tuple[str, nn.Module, CheckpointType]] = []
    for _, container_blocks in containers:
        for index, (fqn, block) in enumerate(container_blocks):
            if kind is CheckpointType.BLOCK_SKIP:
                if index % n_layer == 0:
                    plan.append((fqn, block, CheckpointType.FULL))
            else:
                plan.append((fqn, block, kind))
    if not plan:
        raise AdapterError(
            f"{owner} matched no block in {type(model).__name__} (containers {list(paths)} are empty); "
            f"its ModuleLists are {module_lists(model) or 'none'}"
        )
    return plan


def apply_activation_checkpointing(
    model: nn.Module,
    checkpointing_type: str | CheckpointType = CheckpointType.FULL,
    n_layer: int = 1,
    *,
    adapter: AdapterSpec | str | None = None,
    blocks: Sequence[str] | None = None,
    retain_ops: Iterable[str] = (),
    offload: OffloadConfig | None = None,
) -> nn.Module:
    """Checkpoint ``model``'s blocks in place by policy and return the same model.

    ``full`` checkpoints every block of every container the adapter declares, each on its own;
    ``ops`` does the same but keeps the outputs of the retained ops (PyTorch's SDPA kernels, the
    adapter's attention ops and ``retain_ops``); ``block_skip`` fully checkpoints blocks whose index
    in their container is a multiple of ``n_layer``. The adapter is found from the model's class,
    or named (a string), or given as a spec; ``blocks=["layers"]`` serves a model no adapter does.
    Parameter, module and state_dict names are unchanged. Applying again replaces the earlier policy.

    ``offload=OffloadConfig(min_tokens=...)`` also offloads activations to host memory in every forward
    whose token count (from the adapter's ``token_count``, or ``OffloadConfig.token_count``, which
    ``blocks=`` without an adapter requires) reaches ``min_tokens``; see :class:`OffloadConfig`.
    """
    kind = coerce_checkpoint_type(checkpointing_type)
    _check_n_layer(n_layer)
    if offload is not None and not isinstance(offload, OffloadConfig):
        raise TypeError(f"offload takes an OffloadConfig, e.g. OffloadConfig(min_tokens=32768); got {offload!r}")
    spec: AdapterSpec | None = None
    if adapter is not None or blocks is None:
        spec = get_adapter(model if adapter is None else adapter)
    retained = retained_op_names(DEFAULT_RETAINED_OPS, spec.retained_ops() if spec else (), retain_ops)
    check_foreign_wrappers(model)
    plan = _plan(model, kind, n_layer, spec, blocks)
    if offload is not None:
        kept = offload_model.kept_modules(model, offload)
        count, source = None, ""
        if offload.enabled:
            count, source = offload_model.token_counter(model, offload, spec, explicit_blocks=blocks is not None)

    # Everything is validated: from here on the model changes.
    disable_library_checkpointing(model)
    if spec is not None and spec.prepare is not None:
        spec.prepare(model)
    remove_activation_checkpointing(model)
    # Blocks the adapter declares attention-free (0 attention calls) retain nothing under 'ops' by design.
    model_spec = spec.model_spec(model) if spec is not None and blocks is None else None
    attention_free = {name for name, calls in model_spec.attention_calls.items() if calls == 0} if model_spec else set()
    for _, block, block_kind in plan:
        _forward.install(block, block_kind, retained, expects_attention=type(block).__name__ not in attention_free)
    if offload is not None:
        offload_model.install(model, offload, count, source, kept)
    logger.info(
        "ac-core: %s checkpointing on %d blocks of %s%s%s",
        kind.value,
        len(plan),
        type(model).__name__,
        f" (adapter {spec.name!r})" if spec else "",
        f", offload from {offload.min_tokens} tokens" if offload is not None and offload.enabled else "",
    )
    return model


def remove_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Restore the plain forward of every block ac-core checkpointed in ``model``, and remove its offload."""
    offload_model.uninstall(model)  # first: a keep_on_device wrapper may sit over a block's checkpoint
    for module in model.modules():
        _forward.uninstall(module)
    return model


def checkpointed_blocks(model: nn.Module) -> dict[str, CheckpointType]:
    """FQN -> policy of every block of ``model`` that ac-core checkpoints (``""`` for the model itself)."""
    result: dict[str, CheckpointType] = {}
    for name, module in model.named_modules():
        state = _forward.block_state(module)
        if state is not None:
            result[name] = state.kind
    return result


def is_activation_checkpointed(module: nn.Module) -> bool:
    """True for a checkpointed block and for any module containing one (ac-core's or torch's wrapper)."""
    return any(
        _forward.block_state(m) is not None or hasattr(m, "_checkpoint_wrapped_module") for m in module.modules()
    )
