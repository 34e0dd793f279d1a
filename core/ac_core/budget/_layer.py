"""Checkpointing one block as a plan says: keep given op occurrences (op name + index in the block's forward).

``ops`` keeps every call of an op name; a plan keeps, say, the first and third ``aten::addmm`` only. The
selective-checkpoint policy below counts calls per op name during the block's forward (torch 2.13 calls the
policy in forward only; the recompute replays the decisions it cached) and keeps the listed occurrences.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext, create_selective_checkpoint_contexts

from .._checkpoint import CheckpointLayer, _checkpoint
from ..policy import CheckpointType
from .profile import Signature, describe_signature, signature


class _OccurrencePolicy:
    """Keeps the outputs of ``keep``'s occurrences, recomputes the rest; one instance per checkpointed call."""

    __slots__ = ("keep", "seen")

    def __init__(self, keep: frozenset[tuple[str, int]]) -> None:
        self.keep = keep
        self.seen: dict[str, int] = defaultdict(int)

    def __call__(self, ctx: SelectiveCheckpointContext, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if ctx.is_recompute:  # not called there by torch 2.13; were it, the forward's decisions stand
            return CheckpointPolicy.PREFER_RECOMPUTE
        name = func.name()
        index = self.seen[name]
        self.seen[name] += 1
        return CheckpointPolicy.MUST_SAVE if (name, index) in self.keep else CheckpointPolicy.PREFER_RECOMPUTE


def occurrence_context(keep: frozenset[tuple[str, int]]) -> Any:
    """``context_fn`` for torch.utils.checkpoint keeping the listed (op name, occurrence) outputs."""
    return create_selective_checkpoint_contexts(_OccurrencePolicy(keep))


class PlannedLayer(CheckpointLayer):
    """A block checkpointed by a plan: FULL, or OPS keeping ``keep``; refuses inputs of other shapes than planned."""

    def __init__(
        self,
        keep: tuple[tuple[str, int], ...],
        planned: Signature,
        path: str,
        expects_attention: bool = True,
        *,
        root: nn.Module | None = None,
    ) -> None:
        kind = CheckpointType.OPS if keep else CheckpointType.FULL
        super().__init__(kind, frozenset(op for op, _ in keep), path, expects_attention, root=root)
        self.keep = frozenset(keep)
        self.planned = planned

    def forward(self, module: nn.Module, call_next: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            got = signature(args, kwargs)
            if got != self.planned:
                raise ValueError(
                    f"this checkpoint plan was made for other input shapes: block {self.path!r} was planned for "
                    f"({describe_signature(self.planned)}) and got ({describe_signature(got)}); plan again with "
                    "ac_core.plan_activation_checkpointing at these inputs"
                )
        return super().forward(module, call_next, args, kwargs)

    def _run(
        self, module: nn.Module, call_next: Callable[..., Any], args: tuple, kwargs: dict[str, Any], preserve_rng: bool
    ) -> Any:
        if not self.keep:
            return _checkpoint(call_next, args, kwargs, preserve_rng_state=preserve_rng)
        context_fn = functools.partial(occurrence_context, self.keep)
        return _checkpoint(call_next, args, kwargs, preserve_rng_state=preserve_rng, context_fn=context_fn)
