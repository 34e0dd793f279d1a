"""The CPU SDPA FLOP formulas, and counting FLOPs without disturbing a memory measurement."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from ac_core import apply_activation_checkpointing
from ac_core.measure import (
    GlobalFlopCounter,
    PeakMemory,
    flops_of,
    register_sdpa_flop_formulas,
    zero_grads_,
)
from ac_core.testing import TOY_ADAPTER, toy_case

aten = torch.ops.aten
B, S_Q, S_K, D = 2, 16, 24, 8


@pytest.mark.parametrize(("q_heads", "kv_heads"), [(3, 3), (4, 2)])
def test_cpu_sdpa_flops_equal_the_closed_forms(q_heads, kv_heads):
    register_sdpa_flop_formulas()
    q = torch.randn(B, q_heads, S_Q, D, requires_grad=True)
    k = torch.randn(B, kv_heads, S_K, D, requires_grad=True)
    v = torch.randn(B, kv_heads, S_K, D, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=q_heads != kv_heads)
        forward = dict(counter.get_flop_counts()["Global"])
        out.sum().backward()
    counts = counter.get_flop_counts()["Global"]
    # Two matmuls forward (scores, then scores @ v), five backward (scores recomputed), 2 FLOPs a multiply-add.
    assert forward == {aten._scaled_dot_product_flash_attention_for_cpu: 4 * B * q_heads * S_Q * S_K * D}
    assert counts[aten._scaled_dot_product_flash_attention_for_cpu_backward] == 10 * B * q_heads * S_Q * S_K * D
    assert flops_of(counts, ["aten::_scaled_dot_product_flash_attention_for_cpu"]) == 14 * B * q_heads * S_Q * S_K * D


def test_registration_is_idempotent():
    register_sdpa_flop_formulas()
    assert register_sdpa_flop_formulas() == []


def test_global_counter_counts_what_flop_counter_mode_counts():
    case = toy_case()
    with FlopCounterMode(display=False) as reference:
        case.run().backward()
    with GlobalFlopCounter() as counter:
        case.run().backward()
    assert counter.get_total_flops() == reference.get_total_flops() > 0


def _peak(case, counter=None) -> int:
    zero_grads_(case.model)
    with PeakMemory("cpu", track=(case.model, case.inputs["x"])) as peak:
        if counter is None:
            case.run().backward()
        else:
            with counter:
                case.run().backward()
    return peak.bytes


def test_counting_flops_leaves_the_memory_peak_alone():
    case = toy_case()
    apply_activation_checkpointing(case.model, "full", adapter=TOY_ADAPTER)
    plain = _peak(case)
    assert _peak(case, GlobalFlopCounter()) == plain
    # FlopCounterMode's module tracker keeps recomputed activations alive: why GlobalFlopCounter exists.
    assert _peak(case, FlopCounterMode(display=False)) > plain
