"""The memory-budget policy: the least recompute that fits the memory you have (issue 12), offload included.

Plan from example inputs (:func:`plan_activation_checkpointing`) or from your own training step
(:func:`profile_step`). Importing this package registers the ``plan`` and ``budget`` policy configs.
"""

from __future__ import annotations

from .checkpoint_plan import CheckpointPlan, PlannedBlock
from .memory_budget import MemoryBudget
from .planner import plan_activation_checkpointing, plan_from_profile
from .policy import Budget
from .profile import BlockProfile, ModelProfile, OpOccurrence, profile_model
from .solve import solve
from .step import StepProfile, profile_step

__all__ = [
    "BlockProfile",
    "Budget",
    "CheckpointPlan",
    "MemoryBudget",
    "ModelProfile",
    "OpOccurrence",
    "PlannedBlock",
    "StepProfile",
    "plan_activation_checkpointing",
    "plan_from_profile",
    "profile_model",
    "profile_step",
    "solve",
]
