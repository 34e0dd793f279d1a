"""Applying a plan: each block checkpointed as it says, keeping given op occurrences, and its offload.

``ops`` keeps every call of an op name; a plan keeps, say, the first and third ``aten::addmm`` only. The
selective-checkpoint policy below counts calls per op name during the block's forward (torch 2.13 calls the
policy in forward only; the recompute replays the decisions it cached) and keeps the listed occurrences.

A plan with offload puts ac-core's offload on the model with everything kept on the device, and each block
whose inputs go to the host lifts that around its checkpoint call (see :mod:`.offload`). Offload moves tensors
on CUDA: a block to offload whose inputs are elsewhere, with no transport for them (a test's CPU double), raises.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

from .._checkpoint import CheckpointLayer, checkpoint_call
from .._sac import selective_contexts
from ..collectives import CollectiveKeeper
from ..measure.memory import plain_tensors
from ..offload import OffloadConfig
from ..offload import seam as offload_seam
from ..ops import ROUTING_OPS, collective_decision, collective_keeper
from ..policies.modes import BlockMode
from .profile import Signature, describe_signature, signature


class _OccurrencePolicy:
    """Keeps the outputs of ``keep``'s occurrences, recomputes the rest; one instance per checkpointed call. A kept
    collective occurrence is kept where ``keeper`` finds it moves activations, and its wait with it (see
    :func:`~ac_core.ops.collective_decision`)."""

    __slots__ = ("keep", "keeper", "seen")

    def __init__(self, keep: frozenset[tuple[str, int]], keeper: CollectiveKeeper | None = None) -> None:
        self.keep = keep
        self.keeper = keeper
        self.seen: dict[str, int] = defaultdict(int)

    def __call__(self, ctx: SelectiveCheckpointContext, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if ctx.is_recompute:  # not called there by torch 2.13; were it, the forward's decisions stand
            return CheckpointPolicy.PREFER_RECOMPUTE
        name = func.name()
        index = self.seen[name]
        self.seen[name] += 1
        wanted = (name, index) in self.keep
        out = getattr(ctx, "op_output", None)
        collective = collective_decision(self.keeper, wanted, name, args, kwargs, out)
        if self.keeper is not None:
            self.keeper.saw(args, kwargs, out)
        if collective is not None:
            return collective
        return CheckpointPolicy.MUST_SAVE if wanted else CheckpointPolicy.PREFER_RECOMPUTE


def occurrence_context(keep: frozenset[tuple[str, int]], module: nn.Module | None = None) -> Any:
    """``context_fn`` for torch.utils.checkpoint keeping the listed (op name, occurrence) outputs of a call of
    ``module`` (a collective's where it moves activations, never with no ``module``)."""
    keeper = collective_keeper({op for op, _ in keep}, module)
    return selective_contexts(_OccurrencePolicy(keep, keeper), copied=ROUTING_OPS)


class PlannedLayer(CheckpointLayer):
    """A block checkpointed by a plan: FULL, or OPS keeping ``keep``; refuses inputs of other shapes than planned.

    With ``offload``, the inputs its checkpoint saves go to the host (the plan's offload runs on the model).
    """

    def __init__(
        self,
        keep: tuple[tuple[str, int], ...],
        planned: Signature,
        path: str,
        expects_attention: bool = True,
        *,
        root: nn.Module | None = None,
        offload: bool = False,
        preserve_rng_state: bool = True,
    ) -> None:
        kind = BlockMode.OPS if keep else BlockMode.FULL
        super().__init__(
            kind,
            frozenset(op for op, _ in keep),
            path,
            expects_attention,
            root=root,
            preserve_rng_state=preserve_rng_state,
        )
        self.keep = frozenset(keep)
        self.planned = planned
        self.offload = offload

    def forward(self, module: nn.Module, call_next: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            got = signature(args, kwargs)
            if got != self.planned:
                raise ValueError(
                    f"this checkpoint plan was made for other input shapes: block {self.path!r} was planned for "
                    f"({describe_signature(self.planned)}) and got ({describe_signature(got)}); plan again with "
                    "ac_core.plan_activation_checkpointing at these inputs"
                )
            if self.offload:
                self._check_offload(args, kwargs)
        return super().forward(module, call_next, args, kwargs)

    def _check_offload(self, args: tuple, kwargs: dict[str, Any]) -> None:
        """Raise, naming the fix, where this block's inputs would not go to the host as planned."""
        if not offload_seam.session_active():
            why = (
                "the plan's offload is not on the model (remove_activation_offload took it off)"
                if offload_seam.can_offload()
                else "it needs a CUDA device, and none is available"
            )
            raise RuntimeError(
                f"this checkpoint plan moves the inputs of block {self.path!r} to host memory, and no activation "
                f"offload runs: {why}. Apply the plan on a CUDA machine, or plan without offload (offload=None)"
            )
        tensor = next(plain_tensors((args, kwargs)), None)
        if tensor is not None and offload_seam.transport_for(tensor) is None:
            raise RuntimeError(
                f"this checkpoint plan moves the inputs of block {self.path!r} to host memory, which offload does "
                f"for tensors on CUDA; they are on {tensor.device}. Move the model and its inputs to CUDA "
                "(model.cuda()), or plan without offload (offload=None)"
            )

    def _run(self, module: nn.Module, call_next: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        options: dict[str, Any] = {"preserve_rng_state": self.preserve_rng_state}
        if self.keep:
            options["context_fn"] = functools.partial(occurrence_context, self.keep, module)
        if not self.offload:
            return checkpoint_call(module, self.path, call_next, args, kwargs, **options)
        with offload_seam.lift_no_offload():  # the plan keeps the rest of the model on the device
            return checkpoint_call(module, self.path, call_next, args, kwargs, **options)


def _every_forward(model: nn.Module, inputs: Any) -> int:
    # A plan is for its inputs' shapes: every training forward at them offloads (min_tokens is 1).
    return 1


class PlanOffload:
    """A plan's offload, put on the model by the first block layer that offloads: every saved tensor of the
    model kept on the device but the inputs of the blocks the plan lifts that for."""

    def __init__(self, model: nn.Module, config: OffloadConfig) -> None:
        self.prepared = offload_seam.PreparedOffload(model, config, _every_forward, "a checkpoint plan", keep=(model,))
        self.installed = False

    def install(self) -> None:
        if not self.installed:
            self.prepared.install()
            self.installed = True
