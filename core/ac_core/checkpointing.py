"""Applying, replacing and removing activation checkpointing on a model's blocks: resolve, select, install."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from torch import nn

from . import _chain, _checkpoint
from ._conflicts import check_foreign_wrappers
from ._deprecated import UNSET, renamed
from .blocks import ModelBlocks, resolve_blocks
from .coverage import undeclared_containers
from .libraries.checkpointing import disable_library_checkpointing
from .libraries.transformers import train_without_kv_cache, use_checkpointed_test
from .offload import OffloadConfig
from .offload import model as offload_model
from .policies import BlockMode, CheckpointType, PolicyConfig, containers_for, policy_config, select
from .spec import AdapterSpec

logger = logging.getLogger("ac_core")

_NO_OPS: tuple[str, ...] = ()


def apply_activation_checkpointing(
    model: nn.Module,
    checkpointing_type: str | CheckpointType | PolicyConfig = CheckpointType.FULL,
    n_layer: int | None = None,
    *,
    adapter: AdapterSpec | str | None = None,
    blocks: Sequence[str] | None = None,
    retain: Iterable[str] = _NO_OPS,
    offload: OffloadConfig | None = None,
    retain_ops: Any = UNSET,
) -> nn.Module:
    """Checkpoint ``model``'s blocks in place by policy and return the same model.

    The policy is a config (``ac_core.Full()``, ``ac_core.Ops(retain={...})``, ``ac_core.BlockSkip(every=2)``,
    or any registered one) or its name (``"full"``, ``"ops"``, ``"block_skip"``, with ``n_layer`` for
    block_skip's every-n-th and ``retain`` for ops' extra kept ops, as FastVideo's call takes them).
    ``full`` checkpoints every block of every container the adapter declares, each on its own; ``ops``
    does the same but keeps the outputs of attention (PyTorch's SDPA kernels, the adapter's attention
    ops and ``retain``); ``block_skip`` fully checkpoints blocks whose index in their container is a
    multiple of n. The adapter is found from the model's class, or named, or given as a spec;
    ``blocks=["layers"]`` serves a model no adapter does. Parameter, module and state_dict names are
    unchanged. Applying again replaces the earlier policy.

    ``offload=OffloadConfig(min_tokens=...)`` also offloads activations to host memory in every forward
    whose token count (from the adapter's ``token_count``, or ``OffloadConfig.token_count``, which
    ``blocks=`` without an adapter requires) reaches ``min_tokens``; see :class:`OffloadConfig`.
    ``retain_ops=`` is the old name of ``retain=``.
    """
    retain = renamed("apply_activation_checkpointing", "retain_ops", "retain", retain_ops, retain, _NO_OPS)
    config = policy_config(checkpointing_type, n_layer, retain)
    if offload is not None and not isinstance(offload, OffloadConfig):
        raise TypeError(f"offload takes an OffloadConfig, e.g. OffloadConfig(min_tokens=32768); got {offload!r}")
    resolved = resolve_blocks(model, adapter, containers_for(config, adapter, blocks))
    selected = select(config, resolved)
    check_foreign_wrappers(model)
    prepared_offload = offload_model.prepare(resolved, offload) if offload is not None else None

    # Everything is validated: from here on the model changes.
    disable_library_checkpointing(model)
    _prepare(resolved)
    # Foreign forwards (diffusers', accelerate's hooks) met on the way are reported once for all blocks.
    with _chain.reports():
        remove_activation_checkpointing(model)
        for choice in selected:
            make_layer = choice.layer or _checkpoint.CheckpointLayer  # a policy with a layer of its own (a plan)
            layer = make_layer(
                choice.kind,
                choice.retained,
                choice.block.path,
                choice.block.expects_attention,
                root=model,
                preserve_rng_state=choice.preserve_rng_state,
            )
            _checkpoint.install(choice.block.module, layer)
        if prepared_offload is not None:
            prepared_offload.install()
    _chain.link_root(model)
    _warn_undeclared(resolved)
    logger.info(
        "ac-core: %s checkpointing on %d of %d blocks of %s (%s)%s",
        config.name,
        len(selected),
        len(resolved),
        type(model).__name__,
        resolved.source,
        f", offload from {offload.min_tokens} tokens" if offload is not None and offload.enabled else "",
    )
    return model


def _warn_undeclared(resolved: ModelBlocks) -> None:
    # Silent partial coverage trains fine and saves half the memory it should: say it where it happens.
    undeclared = undeclared_containers(resolved)
    if undeclared:
        logger.warning(
            "ac-core: %s has blocks outside every container %s declares, left unchecked: %s. Add them to the "
            "ModelSpec's containers (or to excluded, with the reason), or to blocks=[...].",
            type(resolved.model).__name__,
            resolved.source,
            "; ".join(f"{fqn!r} ({where})" for fqn, where in undeclared.items()),
        )


def _prepare(resolved: ModelBlocks) -> None:
    """What the adapter says training under checkpointing needs (e.g. Llama's KV cache off), done to the model it
    serves (inside a wrapper too); and for a model with a KV cache (a transformers model whose config has
    ``use_cache``), training forwards without it, whichever route named the blocks (the adapter or ``blocks=``)."""
    if resolved.adapter is not None and resolved.adapter.prepare is not None:
        resolved.adapter.prepare(resolved.served_model)
    train_without_kv_cache(resolved.model)


def remove_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Restore the plain forward of every block ac-core checkpointed in ``model``, and remove its offload.

    Another library's hook on a block (diffusers', accelerate's) stays, whichever was applied first. Where
    such a library had replaced ac-core's forward with the one it kept from before ac-core's, that forward
    is left as it is, with a warning.
    """
    with _chain.reports():
        offload_model.uninstall(model)
        for module in model.modules():
            _checkpoint.uninstall(module)
    _chain.unlink_root(model)
    return model


def checkpointed_blocks(model: nn.Module) -> dict[str, BlockMode]:
    """FQN -> policy (FULL or OPS) of every block of ``model`` that ac-core checkpoints (``""``: the model).

    A block whose ac-core forward another library replaced without keeping it (e.g. removing its hook put
    back the forward from before ac-core's) is not checkpointed: it is left out, with a warning.
    """
    result: dict[str, BlockMode] = {}
    with _chain.reports():
        for name, module in model.named_modules():
            layer = _checkpoint.layer_of(module)
            if layer is not None and _chain.check(module):
                result[name] = layer.policy
    return result


def is_activation_checkpointed(module: nn.Module) -> bool:
    """True for a checkpointed block and for any module containing one (ac-core's or torch's wrapper).

    A block whose ac-core forward no longer runs (another library replaced it) is not checkpointed.
    """
    return any(
        (_checkpoint.layer_of(m) is not None and _chain.active(m)) or hasattr(m, "_checkpoint_wrapped_module")
        for m in module.modules()
    )


# The KV-cache guard (libraries/transformers.py) sits below this module: it is told here what checkpointed means.
use_checkpointed_test(is_activation_checkpointed)
