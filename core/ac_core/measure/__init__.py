"""Measuring what checkpointing does: ops run where, memory held and peaked, FLOPs, one training step."""

from __future__ import annotations

from .flops import SDPA_FLOP_FORMULAS, GlobalFlopCounter, flops_of, op_packet_name, register_sdpa_flop_formulas
from .memory import held_for_backward
from .ops import OpCounter, op_matches
from .peak import PeakMemory
from .step import GRAD_TOLERANCE, GradCheck, StepMeasurement, compare_grads, measure_step, time_steps, zero_grads_

__all__ = [
    "GRAD_TOLERANCE",
    "SDPA_FLOP_FORMULAS",
    "GlobalFlopCounter",
    "GradCheck",
    "OpCounter",
    "PeakMemory",
    "StepMeasurement",
    "compare_grads",
    "flops_of",
    "held_for_backward",
    "measure_step",
    "op_matches",
    "op_packet_name",
    "register_sdpa_flop_formulas",
    "time_steps",
    "zero_grads_",
]
