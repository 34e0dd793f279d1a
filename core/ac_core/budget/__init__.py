"""The memory-budget policy: the least recompute that fits the memory you have (issue 12), offload included.

Plan from example inputs (:func:`plan_activation_checkpointing`) or from your own training step
(:func:`profile_step`). Importing this package registers the ``plan`` and ``budget`` policy configs.
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
from .step import StepProfile, profile_step

__all__ = [
    "BlockProfile",
    "Budget",
    "CheckpointPlan",
    "ModelProfile",
    "OpOccurrence",
    "PlannedBlock",
    "StepProfile",
    "parse_budget",
    "plan_activation_checkpointing",
    "plan_from_profile",
    "profile_model",
    "profile_step",
    "solve",
]
