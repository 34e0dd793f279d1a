"""Measuring what checkpointing does: which ops ran where, and memory held for backward."""

from __future__ import annotations

from .memory import held_for_backward
from .ops import OpCounter, op_matches

__all__ = ["OpCounter", "held_for_backward", "op_matches"]
