"""Measuring what checkpointing does: which ops ran where, memory held for backward, and what a
compiled step saves and recomputes (``python -m ac_core.measure`` prints the comparison)."""

from __future__ import annotations

from .compiled import CompiledActivations, compare_routes, compiled_activations, with_and_without_pass
from .memory import held_for_backward
from .ops import CompiledOpCounter, OpCounter, op_matches

__all__ = [
    "CompiledActivations",
    "CompiledOpCounter",
    "OpCounter",
    "compare_routes",
    "compiled_activations",
    "held_for_backward",
    "op_matches",
    "with_and_without_pass",
]
