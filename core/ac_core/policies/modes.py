"""How a block is checkpointed, one enum for every route; and the policy names a training config spells.

:class:`BlockMode` is what eager selections, checkpoint plans, the solver and the graph pass all say of a block;
:class:`BlockDecision` is one block's mode with what it keeps, as plans store it and the graph pass reads it.
:class:`CheckpointType` names the fixed policies as FastVideo's configs spell them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class BlockMode(str, Enum):
    """One block's checkpointing: ``NONE`` unchecked (all saved), ``FULL`` recomputed whole, ``OPS`` recomputed but
    for the outputs of the ops it keeps."""

    NONE = "none"
    FULL = "full"
    OPS = "ops"

    def __str__(self) -> str:
        return self.value


class CheckpointType(str, Enum):
    """The fixed policies by name: ``FULL`` recomputes every block; ``OPS`` keeps the outputs of the retained ops
    (attention) and recomputes the rest of each block; ``BLOCK_SKIP`` fully checkpoints every n-th block."""

    FULL = "full"
    OPS = "ops"
    BLOCK_SKIP = "block_skip"

    def __str__(self) -> str:
        return self.value


def block_mode(value: object, what: str) -> BlockMode:
    """``value`` (a :class:`BlockMode`, its string, or ``CheckpointType.FULL``/``OPS``) as a BlockMode."""
    try:
        return BlockMode(value)
    except ValueError:
        valid = ", ".join(repr(m.value) for m in BlockMode)
        given = value.value if isinstance(value, Enum) else value
        raise ValueError(f"{what}: mode {given!r} is not a block mode; valid modes are {valid}") from None


@dataclass(frozen=True)
class BlockDecision:
    """One block's checkpointing: its FQN, ``mode``, and for ``OPS`` what it keeps: ``keep``, (op name, occurrence)
    pairs counted per call of the block in op order (a plan's choice), and ``retain``, op names every occurrence
    of which is kept (a fixed policy's). :class:`~ac_core.budget.PlannedBlock` is one, with its predicted costs."""

    path: str
    mode: BlockMode
    keep: tuple[tuple[str, int], ...] = ()
    retain: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", block_mode(self.mode, f"block {self.path!r}"))
        object.__setattr__(self, "keep", tuple(sorted((str(op), int(i)) for op, i in self.keep)))
        object.__setattr__(self, "retain", frozenset(self.retain))
        if (self.mode == BlockMode.OPS) != bool(self.keep or self.retain):
            raise ValueError(
                f"block {self.path!r}: mode {self.mode.value!r} with keep={list(self.keep)}, retain="
                f"{sorted(self.retain)} is no decision ('ops' keeps something, 'none' and 'full' keep nothing)"
            )


def resolve_checkpointing_type(checkpointing_type: str | None, training_config: Any) -> str | None:
    """Return a role's own checkpointing type, else ``training_config.model.enable_gradient_checkpointing_type``.

    Returns None when neither is set, so that a trainer can skip checkpointing for that role.
    """
    if checkpointing_type:
        return checkpointing_type
    model_config = getattr(training_config, "model", None)
    return getattr(model_config, "enable_gradient_checkpointing_type", None)
