"""One measured step: memory, FLOPs, recompute counts and gradients, in closed form on the toy stack."""

from __future__ import annotations

import pytest
import torch

from ac_core import apply_activation_checkpointing, model_blocks
from ac_core.errors import AdapterError
from ac_core.measure import PeakMemory, compare_grads, measure_step, time_steps
from ac_core.testing import TOY_ADAPTER, toy_case

BATCH, TOKENS, DIM, DEPTH = 2, 32, 64, 4
N = BATCH * TOKENS
BLOCK_LINEAR = 24 * N * DIM * DIM  # qkv (3d), proj (d), mlp (4d and back): 2 FLOPs a multiply-add
BLOCK_ATTENTION = 4 * BATCH * TOKENS * TOKENS * DIM  # summed over heads
# Recompute stops after the last op whose output backward needs (torch.utils.checkpoint's early stop):
# a block's final Linear (4d -> d) saves only its input, so it is never re-run.
LAST_LINEAR = 8 * N * DIM * DIM
RECOMPUTED_LINEAR = BLOCK_LINEAR - LAST_LINEAR
ACT = N * DIM * 4


def _measure(policy: str | None, n_layer: int = 1):
    case = toy_case(dim=DIM, depth=DEPTH, tokens=TOKENS, batch=BATCH)
    if policy:
        apply_activation_checkpointing(case.model, policy, n_layer, adapter=TOY_ADAPTER)
    return measure_step(case, TOY_ADAPTER.retained_ops())


@pytest.fixture(scope="module")
def steps():
    return {
        "none": _measure(None),
        "full": _measure("full"),
        "ops": _measure("ops"),
        "block_skip": _measure("block_skip", 2),
    }


def test_recompute_flops_are_one_more_forward_of_the_recomputed_part(steps):
    none = steps["none"].flops
    assert steps["full"].flops - none == DEPTH * (RECOMPUTED_LINEAR + BLOCK_ATTENTION)
    assert steps["ops"].flops - none == DEPTH * RECOMPUTED_LINEAR  # attention is retained, not recomputed
    assert steps["block_skip"].flops - none == (DEPTH // 2) * (RECOMPUTED_LINEAR + BLOCK_ATTENTION)


def test_attention_flops_and_kernel_counts(steps):
    assert steps["none"].attention_flops == DEPTH * (BLOCK_ATTENTION + 10 * BLOCK_ATTENTION // 4)
    assert steps["full"].attention_flops - steps["none"].attention_flops == DEPTH * BLOCK_ATTENTION
    assert {k: s.attention_forward_calls for k, s in steps.items()} == dict.fromkeys(steps, DEPTH)
    assert {k: s.attention_recomputed for k, s in steps.items()} == {
        "none": 0,
        "full": DEPTH,
        "ops": 0,
        "block_skip": DEPTH // 2,
    }


def test_memory_figures(steps):
    # full keeps each block's input plus the head's input and output (as tests/core/test_measure.py derives).
    assert steps["full"].held_for_backward_bytes == (DEPTH + 2) * ACT
    assert steps["full"].held_for_backward_bytes < steps["ops"].held_for_backward_bytes
    assert steps["ops"].held_for_backward_bytes < steps["none"].held_for_backward_bytes
    for policy in ("full", "ops", "block_skip"):
        assert steps[policy].activation_peak_bytes < steps["none"].activation_peak_bytes
    assert steps["none"].activation_peak_bytes >= steps["none"].held_for_backward_bytes


def test_measurement_is_repeatable():
    assert _measure("ops") == _measure("ops")  # every figure (gradients are not compared by ==)


def test_gradients_are_equal_and_a_difference_is_caught(steps):
    assert steps["none"].loss == steps["full"].loss
    for policy in ("full", "ops", "block_skip"):
        assert compare_grads(steps[policy].grads, steps["none"].grads).max_abs_diff == 0.0
    changed = dict(steps["none"].grads)
    name = next(iter(changed))
    changed[name] = changed[name] + 1e-3
    check = compare_grads(changed, steps["none"].grads)
    assert not check.ok and check.max_abs_diff == pytest.approx(1e-3)
    assert not compare_grads({}, steps["none"].grads).ok


def test_peak_memory_counts_what_a_region_allocates():
    with PeakMemory("cpu") as peak:
        a = torch.ones(1024)  # 4 KiB
        b = a * 2  # 4 KiB more, both alive
        del a, b
        c = torch.ones(512)  # 2 KiB after both were freed
    assert peak.bytes == 8192
    assert c.numel() == 512


def test_peak_memory_follows_storages_resized_away():
    # FSDP frees unsharded weights with resize_(0) and keeps the storage object alive.
    with PeakMemory("cpu") as peak:
        a = torch.ones(1024)
        a.untyped_storage().resize_(0)
        b = torch.ones(1024)
    assert peak.bytes == 4096
    assert a.untyped_storage().nbytes() == 0 and b.numel() == 1024


def test_time_steps():
    case = toy_case(depth=1)
    calls = []
    times = time_steps(case, 3, 1, on_step=lambda: calls.append(1))
    assert len(times) == 3 and all(t > 0 for t in times) and len(calls) == 4
    with pytest.raises(ValueError, match="steps >= 1"):
        time_steps(case, 0)


def test_model_blocks():
    model = toy_case().model
    assert [fqn for fqn, _ in model_blocks(model, adapter=TOY_ADAPTER)] == [f"layers.{i}" for i in range(4)]
    assert [b for _, b in model_blocks(model, blocks=["layers"])] == list(model.layers)
    with pytest.raises(AdapterError, match="no registered adapter serves"):
        model_blocks(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="list of container paths"):
        model_blocks(model, blocks="layers")


def test_nans_in_the_same_places_are_equal_and_a_nan_against_a_number_is_not():
    reference = {"w": torch.tensor([1.0, float("nan"), 3.0])}
    same = compare_grads({"w": torch.tensor([1.0, float("nan"), 3.0])}, reference)
    assert same.ok and same.max_abs_diff == 0.0
    moved = compare_grads({"w": torch.tensor([float("nan"), 2.0, 3.0])}, reference)
    assert not moved.ok and moved.max_abs_diff == float("inf")
