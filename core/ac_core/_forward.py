"""Checkpointing one block by overriding its forward on the instance.

The module tree is left as it is, so parameter, module and state_dict names stay those of the
plain model. A wrapper module (torch's checkpoint_wrapper) inserts ``_checkpoint_wrapped_module``
into every name below it, and torch.distributed._composable.checkpoint keeps names but fails
under torch.compile on torch 2.13; calling torch.utils.checkpoint from an instance-level forward
does neither.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .offload import _regions as offload_regions
from .ops import RetentionRecord, selective_context, warn_nothing_retained
from .policy import CheckpointType

STATE_ATTR = "_ac_core_checkpoint"


@dataclass(frozen=True)
class BlockCheckpoint:
    """How one block is checkpointed, and the instance-level forward it replaced (None for the class's).

    ``class_forward`` is the class's forward function, taken when installing: reaching it through
    ``type(block)`` inside the checkpointed call makes dynamo break the graph for classes marked
    ``allow_in_graph`` (every diffusers transformer block), so the compiled model ran eagerly.
    ``expects_attention`` is False for a block its adapter declares attention-free (e.g. a conv block):
    under ``ops`` such a block retains nothing by design, which is not worth a warning.
    """

    kind: CheckpointType
    retained: frozenset[str]
    previous_forward: object | None
    class_forward: Callable[..., Any]
    expects_attention: bool = True


def _has_active_randomness(block: nn.Module) -> bool:
    # Dropout modules and the attention-dropout floats that transformers/diffusers pass to SDPA.
    for module in block.modules():
        if not module.training:
            continue
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return True
        for attr in ("attention_dropout", "dropout_p"):
            value = getattr(module, attr, None)
            if isinstance(value, float) and value > 0:
                return True
    return False


def _call_plain(block: nn.Module, *args, **kwargs):
    state: BlockCheckpoint = getattr(block, STATE_ATTR)
    if state.previous_forward is not None:
        return state.previous_forward(*args, **kwargs)
    return state.class_forward(block, *args, **kwargs)


def _call_plain_by_position(block: nn.Module, names: tuple[str, ...], *args):
    split = len(args) - len(names)
    return _call_plain(block, *args[:split], **dict(zip(names, args[split:], strict=True)))


def _checkpoint(block: nn.Module, args: tuple, kwargs: dict, **options):
    """torch.utils.checkpoint of the block's plain forward, marked as a checkpoint for activation offload."""
    if torch.compiler.is_compiling() or not offload_regions.session_active():
        return checkpoint(_call_plain, block, *args, use_reentrant=False, **options, **kwargs)
    # checkpoint keeps keyword arguments in a closure, out of reach of saved-tensor hooks; passed by
    # position they are saved like the others, so offload can move them (checkpoint_inputs).
    names = tuple(kwargs)
    with offload_regions.checkpoint_inputs_scope():
        return checkpoint(
            _call_plain_by_position, block, names, *args, *kwargs.values(), use_reentrant=False, **options
        )


def _checkpointed_forward(self: nn.Module, *args, **kwargs):
    state: BlockCheckpoint = getattr(self, STATE_ATTR)
    if not torch.is_grad_enabled():
        return _call_plain(self, *args, **kwargs)
    # RNG state is saved and replayed only where a stochastic op is live: it costs a copy per call.
    preserve_rng = _has_active_randomness(self)
    if state.kind is not CheckpointType.OPS:
        return _checkpoint(self, args, kwargs, preserve_rng_state=preserve_rng)
    if torch.compiler.is_compiling():
        # Under torch.compile context_fn must be a partial of constants, so nothing is recorded.
        context_fn = functools.partial(selective_context, state.retained)
        return _checkpoint(self, args, kwargs, preserve_rng_state=preserve_rng, context_fn=context_fn)
    # torch 2.13 no longer calls the policy during recompute, so a block that retained nothing
    # is detected here, right after its forward, from what the policy saw.
    record = RetentionRecord()
    context_fn = functools.partial(selective_context, state.retained, record)
    out = _checkpoint(self, args, kwargs, preserve_rng_state=preserve_rng, context_fn=context_fn)
    if not record.retained and state.expects_attention:
        warn_nothing_retained(type(self).__name__, record)
    return out


def install(block: nn.Module, kind: CheckpointType, retained: frozenset[str], expects_attention: bool = True) -> None:
    """Checkpoint ``block`` by ``kind`` (FULL or OPS); replaces an earlier ac-core checkpoint of it."""
    previous = block.__dict__.get(STATE_ATTR)
    previous_forward = previous.previous_forward if previous else block.__dict__.get("forward")
    block.__dict__[STATE_ATTR] = BlockCheckpoint(
        kind, retained, previous_forward, type(block).forward, expects_attention
    )
    # A bound method (not a closure) so that copy.deepcopy rebinds it to the copied block.
    block.__dict__["forward"] = types.MethodType(_checkpointed_forward, block)


def uninstall(block: nn.Module) -> bool:
    """Restore ``block``'s plain forward; returns whether it was checkpointed by ac-core."""
    state: BlockCheckpoint | None = block.__dict__.pop(STATE_ATTR, None)
    if state is None:
        return False
    if state.previous_forward is None:
        block.__dict__.pop("forward", None)
    else:
        block.__dict__["forward"] = state.previous_forward
    return True


def block_state(block: nn.Module) -> BlockCheckpoint | None:
    return block.__dict__.get(STATE_ATTR)
