"""The memory-budget policy: the least recompute that fits the memory you have (issue 12), offload included.

Plan from example inputs (:func:`plan_activation_checkpointing`) or from your own training step
(:func:`profile_step`). Importing this package registers the ``plan`` and ``budget`` policy configs.
"""

from __future__ import annotations

from .checkpoint_plan import CheckpointPlan, PlannedBlock
from .memory_budget import MemoryBudget
from .planner import plan_from_profile
from .planning import StepPlanner, plan_activation_checkpointing
from .policy import Budget
from .predict import StepPeak, predict_step
from .profile import BlockProfile, ModelProfile, OpOccurrence, profile_model
from .solve import solve
from .step import StepProfile, profile_step
from .step_budget import StepBudget

__all__ = [
    "BlockProfile",
    "Budget",
    "CheckpointPlan",
    "MemoryBudget",
    "ModelProfile",
    "OpOccurrence",
    "PlannedBlock",
    "StepBudget",
    "StepPeak",
    "StepPlanner",
    "StepProfile",
    "plan_activation_checkpointing",
    "plan_from_profile",
    "predict_step",
    "profile_model",
    "profile_step",
    "solve",
]
