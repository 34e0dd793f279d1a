"""The memory-budget policy: the least recompute that fits the memory you have (issue 12), offload included.

Importing this package registers the ``plan`` and ``budget`` policy configs.
"""

from __future__ import annotations

from .plan import (
    Budget,
    CheckpointPlan,
    PlannedBlock,
    parse_budget,
    plan_activation_checkpointing,
    plan_from_profile,
)
from .profile import BlockProfile, ModelProfile, OpOccurrence, profile_model
from .solve import solve

__all__ = [
    "BlockProfile",
    "Budget",
    "CheckpointPlan",
    "ModelProfile",
    "OpOccurrence",
    "PlannedBlock",
    "parse_budget",
    "plan_activation_checkpointing",
    "plan_from_profile",
    "profile_model",
    "solve",
]
