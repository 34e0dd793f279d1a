"""Budget plans with activation offload, on the toy model through offload's CPU double: what stays on the device."""

from __future__ import annotations

import dataclasses
import gc
import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ac_core import (
    OffloadConfig,
    apply_activation_checkpointing,
    remove_activation_checkpointing,
    remove_activation_offload,
    use_offload_transport,
)
from ac_core.budget import Budget, CheckpointPlan, plan_activation_checkpointing
from ac_core.measure import held_for_backward, measure_step
from ac_core.offload.testing import RecordingTransport
from ac_core.testing import ToyTransformer, toy_case

BLOCKS = ["layers"]
# The toy's activations are far below offload's 1 MiB default; no copy in flight past one, one tensor prefetched.
OFFLOAD = OffloadConfig(min_bytes=1, max_inflight_bytes=0, prefetch_bytes=1)
BLOCK_INPUT = 2 * 32 * 64 * 4  # one block's input: batch x tokens x width, float32


@pytest.fixture(scope="module")
def toy():
    case = toy_case()
    return case, measure_step(case)


def _plan(case, budget, offload=OFFLOAD) -> CheckpointPlan:
    return plan_activation_checkpointing(case.model, case.inputs, budget, blocks=BLOCKS, offload=offload)


def _held_with_double(case, transport: RecordingTransport) -> int:
    with use_offload_transport(transport):
        _, held = held_for_backward(lambda: case.model(**case.inputs))
    gc.collect()  # the forward's graph goes: host memory goes back
    return held


@pytest.mark.parametrize("fraction", [0.05, 0.1, 0.25])
def test_offload_plan_holds_what_the_double_leaves_on_the_device_and_trains_the_same(toy, fraction):
    case, reference = toy
    plan = _plan(case, fraction)
    assert any(b.offload for b in plan.blocks)
    apply_activation_checkpointing(case.model, plan, blocks=BLOCKS)
    try:
        transport = RecordingTransport()
        held = _held_with_double(case, transport)
        with use_offload_transport(RecordingTransport()) as stepped:
            step = measure_step(case)
    finally:
        remove_activation_checkpointing(case.model)
    assert held == plan.held_bytes  # exact on the toy: offloaded inputs off the device, the rest as planned
    assert plan.device_bytes == plan.held_bytes + plan.window_bytes <= plan.budget_bytes
    # What moved is the planned blocks' inputs, each once, and nothing else (the head's input stays).
    moved = [b for b in plan.blocks if b.offload]
    assert [r.shape for r in transport.offloaded] == [(2, 32, 64)] * len(moved)
    assert sum(r.nbytes for r in transport.offloaded) == plan.host_bytes == plan.freed_bytes
    assert transport.violations == [] and transport.live_tickets == 0
    assert stepped.violations == [] and stepped.finished_reloads == len(moved)
    assert step.flops - reference.flops == plan.recompute_flops
    for name, grad in reference.grads.items():
        torch.testing.assert_close(step.grads[name], grad, rtol=0, atol=0)


def test_offload_lowers_the_least_possible_and_below_it_names_the_bytes(toy):
    case, _ = toy
    without = _plan(case, 0.5, offload=None)
    least = _plan(case, 0.5).min_bytes
    # Every block's input on the host but the one tensor prefetched; the head's input stays.
    assert least == without.min_bytes - 4 * BLOCK_INPUT + BLOCK_INPUT < without.min_bytes
    at_least = _plan(case, least)
    assert {(b.mode, b.offload) for b in at_least.blocks} == {("full", True)}
    assert at_least.device_bytes == least
    with pytest.raises(ValueError, match=rf"least any plan holds.*: {least} bytes.*offload moves on the host"):
        _plan(case, least - 1)


@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.5, 0.75])
def test_offload_never_recomputes_more_and_moves_only_what_the_budget_needs(toy, fraction):
    case, _ = toy
    with_offload, without = _plan(case, fraction), _plan(case, fraction, offload=None)
    assert with_offload.recompute_flops <= without.recompute_flops
    if with_offload.recompute_flops == without.recompute_flops:
        assert not any(b.offload for b in with_offload.blocks)
    else:  # the first blocks' inputs go first: backward needs them last
        flags = [b.offload for b in with_offload.blocks if b.mode != "none"]
        assert flags == sorted(flags, reverse=True)


def test_default_settings_keep_the_toy_on_the_device():
    # Every toy tensor is below offload's 1 MiB threshold, and its window (copies in flight, prefetch) is larger
    # than anything the toy could move: offload=True changes nothing here, and says so.
    case = toy_case()
    plan = _plan(case, 0.25, offload=True)
    assert plan == dataclasses.replace(_plan(case, 0.25, offload=None), offload=plan.offload)
    assert "offload: allowed, not needed" in str(plan)


def test_offload_plans_on_meta_and_fake_tensors_match_real(toy):
    # Planning for a GPU on a machine without one: shapes and bytes are all the offload model needs.
    case, _ = toy
    real = _plan(case, 0.1)
    with torch.device("meta"):
        model = ToyTransformer()
    assert (
        plan_activation_checkpointing(
            model, {"x": torch.empty(2, 32, 64, device="meta")}, 0.1, blocks=BLOCKS, offload=OFFLOAD
        )
        == real
    )
    with FakeTensorMode():
        model = ToyTransformer()
        fake = plan_activation_checkpointing(model, {"x": torch.empty(2, 32, 64)}, 0.1, blocks=BLOCKS, offload=OFFLOAD)
    assert fake == real and fake.to_json() == real.to_json()


def test_copies_in_flight_stay_within_the_planned_window(toy):
    case, _ = toy
    config = dataclasses.replace(OFFLOAD, max_inflight_bytes=BLOCK_INPUT)
    plan = _plan(case, 0.1, offload=config)
    apply_activation_checkpointing(case.model, plan, blocks=BLOCKS)
    try:
        # A copy engine so slow that no copy finishes during the forward: offload holds back one input.
        held = _held_with_double(case, RecordingTransport(lag=1000))
    finally:
        remove_activation_checkpointing(case.model)
    assert plan.held_bytes + BLOCK_INPUT == held <= plan.device_bytes <= plan.budget_bytes


def test_keep_on_device_blocks_never_offload(toy):
    case, _ = toy
    plan = _plan(case, 0.1, offload=dataclasses.replace(OFFLOAD, keep_on_device=("layers.0",)))
    assert not plan.blocks[0].offload and all(b.offload for b in plan.blocks[1:])


def test_json_round_trip_table_and_format_1(toy):
    case, _ = toy
    plan = _plan(case, 0.1)
    again = CheckpointPlan.from_json(plan.to_json())
    assert again == plan and again.offload == plan.offload and again.held_bytes == plan.held_bytes
    table = str(plan)
    assert "inputs" in table and "host 16.00 KiB" in table and "counted in the budget" in table
    # A plan written before offload (format 1) still loads, as the same plan without offload.
    plain = _plan(case, 0.3, offload=None)
    data = json.loads(plain.to_json())
    for key in ("base_bytes", "offload", "freed_bytes", "window_bytes"):
        del data[key]
    for block in data["blocks"]:
        del block["offload"], block["host_bytes"]
    assert CheckpointPlan.from_json(json.dumps({**data, "format": 1})) == plain
    with pytest.raises(ValueError, match="format 1 to 4"):
        CheckpointPlan.from_json(json.dumps({**data, "format": 5}))


def test_budget_config_plans_and_applies_offload_and_removal_takes_it_off(toy):
    case, _ = toy
    plan = _plan(case, 0.1)
    apply_activation_checkpointing(case.model, Budget(0.1, example_inputs=case.inputs, offload=OFFLOAD), blocks=BLOCKS)
    try:
        assert _held_with_double(case, RecordingTransport()) == plan.held_bytes
    finally:
        remove_activation_checkpointing(case.model)
    assert "_ac_core_chain" not in case.model.__dict__  # the plan's offload went with it
    with pytest.raises(ValueError, match="checkpoint_inputs=True"):
        Budget(0.1, example_inputs=case.inputs, offload=OffloadConfig(checkpoint_inputs=False))
    with pytest.raises(TypeError, match="OffloadConfig"):
        _plan(case, 0.1, offload="yes")  # type: ignore[arg-type]


def test_running_an_offload_plan_off_cuda_raises_naming_the_fix(toy, monkeypatch):
    case, _ = toy
    plan = _plan(case, 0.1)
    apply_activation_checkpointing(case.model, plan, blocks=BLOCKS)
    try:
        with pytest.raises(RuntimeError, match=r"'layers\.0' to host memory.*needs a CUDA device.*offload=None"):
            case.model(**case.inputs)
        with torch.no_grad():
            case.model(**case.inputs)  # nothing is saved for backward: nothing to move
        # A GPU machine with the model left on the CPU.
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        with pytest.raises(RuntimeError, match=r"they are on cpu\. Move the model and its inputs to CUDA"):
            case.model(**case.inputs)
        monkeypatch.undo()
        remove_activation_offload(case.model)
        with use_offload_transport(RecordingTransport()), pytest.raises(RuntimeError, match="not on the model"):
            case.model(**case.inputs)
    finally:
        remove_activation_checkpointing(case.model)


def test_planning_again_sets_the_plans_offload_aside(toy):
    # The verb plans a Budget before it takes the earlier one off: that plan's offload must not run in the profile.
    case, _ = toy
    plan = _plan(case, 0.1)
    apply_activation_checkpointing(case.model, plan, blocks=BLOCKS)
    try:
        with use_offload_transport(RecordingTransport()) as transport:
            again = _plan(case, 0.1)
    finally:
        remove_activation_checkpointing(case.model)
    assert again == plan and transport.offloaded == []
