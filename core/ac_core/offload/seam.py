"""What checkpointing and the planner need of offload, in one place: whether a session runs and its scopes (a
checkpoint marks its saved inputs), which tensors it would keep on the device, whether a tensor can move, and
offload prepared on a model. ``_checkpoint`` and :mod:`ac_core.budget` use offload through these, not through
offload's private modules."""

from __future__ import annotations

from ._regions import (
    checkpoint_inputs_scope,
    in_checkpoint_inputs,
    lift_no_offload,
    session_active,
    session_scope,
)
from ._session import kept_reason
from ._transport import can_offload, transport_for
from .model import PreparedOffload

__all__ = [
    "PreparedOffload",
    "can_offload",
    "checkpoint_inputs_scope",
    "in_checkpoint_inputs",
    "kept_reason",
    "lift_no_offload",
    "session_active",
    "session_scope",
    "transport_for",
]
