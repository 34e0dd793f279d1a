"""The conformance checks as plain functions: each fails with an AssertionError naming what is wrong.

Each takes a :class:`~ac_core_conformance.subjects.Subject` (an adapter and one of its model specs)
and skips (``pytest.skip``) only where the adapter declares no such capability or the device is absent.
"""

from __future__ import annotations

from .attention import (
    AttentionContext,
    AttentionCounts,
    check_attention_recomputed,
    check_attention_retained,
    check_not_retainable_backend,
    no_context,
    offload_context,
    preferred_retainable_backend,
)
from .budget import BudgetReport, check_budget, check_meta_planning
from .compile import COMPILE_BACKEND_ENV, DEFAULT_COMPILE_BACKEND, check_compile, compile_backend
from .coverage import CoverageReport, check_coverage
from .fsdp import check_fsdp
from .gradients import (
    DROPOUT_P,
    RANDOM_DROP,
    RATE_SCHEDULES,
    RandomRate,
    add_random_ops,
    check_gradients,
    check_gradients_with_dropout,
    check_gradients_with_random_ops,
)
from .library import check_library_checkpointing, check_library_checkpointing_after
from .memory import check_memory
from .names import check_names, check_save_pretrained
from .pickling import ROUND_TRIPS, check_pickle_round_trip

__all__ = [
    "COMPILE_BACKEND_ENV",
    "DEFAULT_COMPILE_BACKEND",
    "DROPOUT_P",
    "RANDOM_DROP",
    "RATE_SCHEDULES",
    "ROUND_TRIPS",
    "AttentionContext",
    "AttentionCounts",
    "BudgetReport",
    "CoverageReport",
    "RandomRate",
    "add_random_ops",
    "check_attention_recomputed",
    "check_attention_retained",
    "check_budget",
    "check_compile",
    "check_coverage",
    "check_fsdp",
    "check_gradients",
    "check_gradients_with_dropout",
    "check_gradients_with_random_ops",
    "check_library_checkpointing",
    "check_library_checkpointing_after",
    "check_memory",
    "check_meta_planning",
    "check_names",
    "check_not_retainable_backend",
    "check_pickle_round_trip",
    "check_save_pretrained",
    "compile_backend",
    "no_context",
    "offload_context",
    "preferred_retainable_backend",
]
