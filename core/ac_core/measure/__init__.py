"""Measuring what checkpointing does: ops run where, memory held and peaked, FLOPs, one training step, and
what a compiled step saves and recomputes (``ac-core compare`` prints the comparison of routes)."""

from __future__ import annotations

from ..op_names import op_matches
from .attribution import attribute_ops
from .compiled import CompiledActivations, compiled_activations, with_and_without_pass
from .flops import SDPA_FLOP_FORMULAS, GlobalFlopCounter, flops_of, op_packet_name, register_sdpa_flop_formulas
from .memory import LivePeak, held_for_backward
from .ops import CompiledOpCounter, OpCounter
from .peak import PeakMemory
from .step import GRAD_TOLERANCE, GradCheck, StepMeasurement, compare_grads, measure_step, time_steps, zero_grads_

__all__ = [
    "GRAD_TOLERANCE",
    "SDPA_FLOP_FORMULAS",
    "CompiledActivations",
    "CompiledOpCounter",
    "GlobalFlopCounter",
    "GradCheck",
    "LivePeak",
    "OpCounter",
    "PeakMemory",
    "StepMeasurement",
    "attribute_ops",
    "compare_grads",
    "compiled_activations",
    "flops_of",
    "held_for_backward",
    "measure_step",
    "op_matches",
    "op_packet_name",
    "register_sdpa_flop_formulas",
    "time_steps",
    "with_and_without_pass",
    "zero_grads_",
]
