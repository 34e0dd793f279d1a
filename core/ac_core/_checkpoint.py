"""Checkpointing one block: the checkpoint layer of its forward chain.

It calls ``torch.utils.checkpoint`` around the rest of the block's chain. A wrapper module (torch's
checkpoint_wrapper) inserts ``_checkpoint_wrapped_module`` into every name below it, and
torch.distributed._composable.checkpoint keeps names but fails under torch.compile on torch 2.13; a
layer of the instance's forward does neither.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import _chain
from ._module_ref import ModuleRef
from ._recompute import BlockCall
from .libraries import checkpointing as library_checkpointing
from .offload import seam as offload_seam
from .ops import BlockRetention, selective_context, warn_nothing_retained
from .policies.modes import BlockMode

KIND = "checkpoint"


def _call_by_position(call_next: Callable[..., Any], names: tuple[str, ...], *args: Any) -> Any:
    split = len(args) - len(names)
    return call_next(*args[:split], **dict(zip(names, args[split:], strict=True)))


def checkpoint_call(
    module: nn.Module, path: str, call_next: Callable[..., Any], args: tuple, kwargs: dict[str, Any], **options: Any
) -> Any:
    """torch.utils.checkpoint of the rest of the chain, marked as a checkpoint for activation offload.

    Eagerly the chain runs as a :class:`~ac_core._recompute.BlockCall`: it refuses a forward that changes its
    inputs in place, leaves the block's buffers as the forward left them after each recompute, and names the
    block where recompute fails."""
    if torch.compiler.is_compiling():
        return checkpoint(call_next, *args, use_reentrant=False, **options, **kwargs)
    call_next = BlockCall(call_next, module, path)
    if not offload_seam.session_active():
        return checkpoint(call_next, *args, use_reentrant=False, **options, **kwargs)
    # checkpoint keeps keyword arguments in a closure, out of reach of saved-tensor hooks; passed by
    # position they are saved like the others, so offload can move them (checkpoint_inputs).
    names = tuple(kwargs)
    with offload_seam.checkpoint_inputs_scope():
        return checkpoint(_call_by_position, call_next, names, *args, *kwargs.values(), use_reentrant=False, **options)


class CheckpointLayer(_chain.ForwardLayer):
    """How one block is checkpointed: ``kind`` FULL or OPS, the op names OPS keeps, and the block's path.

    ``expects_attention`` is False for a block its adapter declares attention-free (e.g. a conv block):
    under ``ops`` such a block retains nothing by design, which is not worth a warning.
    ``preserve_rng_state``: keep the RNG state of every call and replay it in recompute, as torch does by
    default. Only the policy's explicit opt-out turns it off: whether a call draws random numbers is not
    known before it runs (a dropout rate warmed up from 0 draws nothing at first), and recompute without the
    state it drew from gives other masks, hence other gradients.
    """

    kind = KIND
    # Recomputes its call in backward: runs above any foreign forward on the block (see _chain).
    reruns = True

    def __init__(
        self,
        policy: BlockMode,
        retained: frozenset[str],
        path: str,
        expects_attention: bool = True,
        *,
        root: nn.Module | None = None,
        preserve_rng_state: bool = True,
    ) -> None:
        self.policy = policy
        self.retained = retained
        self.path = path
        self.expects_attention = expects_attention
        # The model ``path`` is an FQN in (weakly): where the model library's own checkpointing is switched on
        # after ac-core's (on the model, as diffusers does, or on the block, as transformers does), the next
        # forward finds it on the way from there to the block and turns it off again.
        self.root = ModuleRef(root)
        self.segments: tuple[str, ...] = tuple(path.split(".")) if path else ()
        self.preserve_rng_state = preserve_rng_state

    def forward(self, module: nn.Module, call_next: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        if not torch.compiler.is_compiling():
            root = self.root()
            found = library_checkpointing.switched_on(root, self.segments, module)
            if found is not None:
                library_checkpointing.keep_ours(root, module, found, str(self.policy))
        if not torch.is_grad_enabled():
            return call_next(*args, **kwargs)
        return self._run(module, call_next, args, kwargs)

    def _run(self, module: nn.Module, call_next: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        rng = self.preserve_rng_state
        if self.policy != BlockMode.OPS:
            return checkpoint_call(module, self.path, call_next, args, kwargs, preserve_rng_state=rng)
        if torch.compiler.is_compiling():
            # Under torch.compile context_fn must be a partial of constants, so nothing is recorded.
            context_fn = functools.partial(selective_context, self.retained, self.path)
            return checkpoint_call(
                module, self.path, call_next, args, kwargs, preserve_rng_state=rng, context_fn=context_fn
            )
        # torch 2.13 no longer calls the policy during recompute, so a block that retained nothing
        # is detected here, right after its forward, from what the policy saw.
        record = BlockRetention()
        context_fn = functools.partial(selective_context, self.retained, self.path, record, module)
        out = checkpoint_call(module, self.path, call_next, args, kwargs, preserve_rng_state=rng, context_fn=context_fn)
        if not record.retained and self.expects_attention:
            warn_nothing_retained(type(module).__name__, record)
        return out


def install(block: nn.Module, layer: CheckpointLayer) -> None:
    """Checkpoint ``block`` as ``layer`` says; replaces an earlier ac-core checkpoint of it."""
    _chain.add(block, layer)


def uninstall(block: nn.Module) -> bool:
    """Stop checkpointing ``block``; returns whether ac-core checkpointed it."""
    return _chain.remove(block, KIND) is not None


def layer_of(block: nn.Module) -> CheckpointLayer | None:
    """``block``'s checkpoint layer, or None."""
    found = _chain.get(block, KIND)
    return found if isinstance(found, CheckpointLayer) else None
