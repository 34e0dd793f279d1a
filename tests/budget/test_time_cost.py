"""The knapsack costed in predicted time (the roofline on a fixed Device) against FLOPs; the plan records it."""

from __future__ import annotations

import copy
import json
from typing import NamedTuple

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ac_core import ModelCase, OffloadConfig, apply_activation_checkpointing, remove_activation_checkpointing
from ac_core.blocks import resolve_blocks
from ac_core.budget import CheckpointPlan, ModelProfile, plan_activation_checkpointing, plan_from_profile, profile_model
from ac_core.budget.devices import CALIBRATION_ENV, Device, save_calibration
from ac_core.budget.roofline import op_time, transfer_seconds
from ac_core.budget.solve import forward_seconds, none_step_seconds, offload_seconds
from ac_core.measure import held_for_backward, measure_step
from ac_core.testing import make_case, toy_case

# Fixed figures, so no test measures the machine: 1 TFLOP/s in float32 against 100 GB/s, a ridge of 10 FLOPs per
# byte, where an elementwise op (no FLOPs, 8 bytes moved per float32 element) is memory-bound.
DEVICE = Device("test", 1e12, 2e12, None, 1e11, 1e10, 2**34)
BLOCKS = ["layers"]


class Elementwise(nn.Module):
    """One small matmul, then elementwise ops: its recompute is memory-bound."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.proj(x))
        h = torch.sigmoid(h) * torch.tanh(h)
        return x + h.exp()


class Matmul(nn.Module):
    """An MLP: its recompute is its first matmul (compute-bound) and a ReLU."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.up(x).relu())


class Mixed(nn.Module):
    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Elementwise(dim), Matmul(dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _mean_square(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


class Subject(NamedTuple):
    case: ModelCase
    profile: ModelProfile


def _subject(case: ModelCase) -> Subject:
    return Subject(case, profile_model(resolve_blocks(case.model, None, BLOCKS), case.inputs))


@pytest.fixture(scope="module")
def mixed() -> Subject:
    return _subject(make_case(Mixed, lambda: {"x": torch.randn(256, 64)}, _mean_square))


@pytest.fixture(scope="module")
def toy() -> Subject:
    return _subject(toy_case())


def _plan(subject: Subject, budget, cost, device: Device | str | None = DEVICE, **options) -> CheckpointPlan:
    """The plan from the subject's profile (profiled once per module)."""
    return plan_from_profile(subject.profile, budget, cost=cost, device=device, **options)


def _decisions(plan: CheckpointPlan) -> list[tuple[str, str, tuple[tuple[str, int], ...]]]:
    return [(b.path, b.mode.value, b.keep) for b in plan.blocks]


def test_time_keeps_the_memory_bound_ops_flops_recomputes_and_predicts_less(mixed):
    flops, timed = _plan(mixed, 0.5, "flops"), _plan(mixed, 0.5, "time")
    # FLOPs see nothing to save in the elementwise ops: only the small matmul is kept, and the MLP's first matmul
    # does not fit. Time sees each elementwise op's bytes: it keeps the dearest per byte (the mul) and the first of
    # four tied (the GELU).
    assert _decisions(flops) == [("layers.0", "ops", (("aten::addmm", 0),)), ("layers.1", "full", ())]
    assert _decisions(timed) == [
        ("layers.0", "ops", (("aten::addmm", 0), ("aten::gelu", 0), ("aten::mul.Tensor", 0))),
        ("layers.1", "full", ()),
    ]
    assert flops.recompute_flops == timed.recompute_flops  # equal FLOPs, less time
    assert timed.held_bytes <= timed.budget_bytes == flops.budget_bytes
    assert (timed.cost, flops.cost, timed.device, flops.device) == ("time", "flops", "test", "test")
    assert timed.recompute_seconds is not None and flops.recompute_seconds is not None
    assert timed.recompute_seconds < flops.recompute_seconds
    # The seconds saved by keeping an op are its roofline seconds.
    block = dict(mixed.profile.blocks)["layers.0"]
    kept = [op for op in block.recomputed if (op.op, op.index) in timed.blocks[0].keep]
    whole = block.recompute_seconds(DEVICE)
    assert timed.blocks[0].recompute_seconds == pytest.approx(whole - sum(op_time(op, DEVICE).seconds for op in kept))


@pytest.mark.parametrize("fraction", [0.2, 0.3, 0.5, 0.7, 0.9])
def test_at_equal_budget_time_predicts_no_more_than_flops(mixed, toy, fraction):
    for case in (mixed, toy):
        flops, timed = _plan(case, fraction, "flops"), _plan(case, fraction, "time")
        assert timed.held_bytes <= timed.budget_bytes
        assert timed.recompute_seconds is not None and flops.recompute_seconds is not None
        assert timed.recompute_seconds <= flops.recompute_seconds * (1 + 1e-9)


def test_a_time_plan_applies_holds_its_prediction_and_trains_the_same(mixed):
    plan = _plan(mixed, 0.5, "time")
    reference = measure_step(mixed.case)
    apply_activation_checkpointing(mixed.case.model, plan, blocks=BLOCKS)
    try:
        _, held = held_for_backward(lambda: mixed.case.model(**mixed.case.inputs))
        step = measure_step(mixed.case)
    finally:
        remove_activation_checkpointing(mixed.case.model)
    assert held == plan.held_bytes
    for name, grad in reference.grads.items():
        torch.testing.assert_close(step.grads[name], grad, rtol=0, atol=0)


# What the plans before time costing existed (FLOPs only) recomputed, at 0.25, 0.5 and 0.75 of what none holds:
# the FLOP-costed plans of now recompute as little. Which of identical blocks keeps an op of equal saving is a tie,
# so layouts are not compared.
_TOY_BEFORE = {0.25: 13_107_200, 0.5: 4_718_592, 0.75: 0}
_WAN_BEFORE = 324_608


@pytest.mark.parametrize("fraction", sorted(_TOY_BEFORE))
def test_flops_cost_recomputes_what_the_plans_of_before_did(toy, fraction):
    plan = _plan(toy, fraction, "flops")
    assert plan.recompute_flops == _TOY_BEFORE[fraction]
    assert plan.held_bytes <= plan.budget_bytes
    assert plan.cost == "flops" and plan.device == "test"
    # And through the planner's front door, whatever device this machine's calibration gives.
    again = plan_activation_checkpointing(toy.case.model, toy.case.inputs, fraction, blocks=BLOCKS, cost="flops")
    assert _decisions(again) == _decisions(plan)


def test_flops_cost_recomputes_what_the_plan_of_before_did_on_tiny_wan():
    pytest.importorskip("diffusers")
    from ac_core_adapters.models.wan import tiny_wan

    case = tiny_wan()
    plan = plan_activation_checkpointing(case.model, case.inputs, 0.25, cost="flops", device=DEVICE)
    assert plan.recompute_flops == _WAN_BEFORE
    assert plan.held_bytes <= plan.budget_bytes


def test_json_round_trip_keeps_cost_device_and_seconds(mixed):
    plan = _plan(mixed, 0.5, "time")
    again = CheckpointPlan.from_json(plan.to_json())
    assert again == plan
    assert (again.cost, again.device, again.none_seconds) == ("time", "test", plan.none_seconds)
    assert [b.recompute_seconds for b in again.blocks] == [b.recompute_seconds for b in plan.blocks]
    # A plan written before these fields loads as a FLOP-costed plan without a device.
    old = json.loads(plan.to_json())
    for key in ("cost", "device", "none_seconds"):
        del old[key]
    for block in old["blocks"]:
        del block["recompute_seconds"], block["offload_seconds"]
    loaded = CheckpointPlan.from_json(json.dumps(old))
    assert (loaded.cost, loaded.device, loaded.recompute_seconds, loaded.overhead) == ("flops", None, None, None)
    assert _decisions(loaded) == _decisions(plan)


def test_table_shows_held_and_predicted_time_per_block_and_the_overhead(mixed):
    plan = _plan(mixed, 0.5, "time")
    table = str(plan)
    header = next(line for line in table.splitlines() if line.startswith("block"))
    assert "held" in header and "recompute time" in header
    assert "predicted on test (knapsack cost: time): recompute 17.6 us" in table
    assert f"step-time overhead over none {plan.overhead:+.1%}" in table and "none's predicted step 106 us" in table
    assert "3.93 us" in table and "13.6 us" in table  # per block
    without = _plan(mixed, 0.5, "flops", device=None)
    assert "recompute time" not in str(without) and "predicted on" not in str(without)


def test_none_step_time_and_overhead_are_the_roofline_of_the_blocks(mixed):
    plan = _plan(mixed, 0.5, "time")
    profile = mixed.profile
    forward = sum(sum(op_time(op, DEVICE).seconds for op in p.forward) for _, p in profile.blocks)
    assert none_step_seconds(profile, DEVICE) == pytest.approx(3 * forward)
    assert plan.none_seconds == pytest.approx(3 * forward)
    assert plan.recompute_seconds is not None and plan.none_seconds is not None
    assert plan.overhead == pytest.approx(plan.recompute_seconds / plan.none_seconds)
    assert plan_from_profile(profile, 0.5).device is None  # a profile alone knows no device: FLOPs


def test_offload_is_priced_by_what_its_copies_leave_exposed(mixed):
    profile = mixed.profile
    first, second = (forward_seconds(p, DEVICE) for _, p in profile.blocks)
    nbytes = 2**20
    copy = transfer_seconds(nbytes, DEVICE)
    host = {"layers.0": nbytes, "layers.1": nbytes}
    exposed = offload_seconds(profile, host, DEVICE, OffloadConfig())
    # Out beside the block's own forward; back beside the next block's backward (twice its forward), the last
    # block's wholly exposed.
    assert exposed["layers.0"] == pytest.approx(max(0, copy - first) + max(0, copy - 2 * second))
    assert exposed["layers.1"] == pytest.approx(max(0, copy - second) + copy)
    # Past max_inflight_bytes compute waits for the copy out; past prefetch_bytes the copy back is on demand.
    waits = offload_seconds(profile, host, DEVICE, OffloadConfig(max_inflight_bytes=0, prefetch_bytes=nbytes // 4))
    quarter = transfer_seconds(nbytes // 4, DEVICE)
    assert waits["layers.0"] == pytest.approx(copy + (copy - quarter) + max(0, quarter - 2 * second))


def test_time_offloads_only_where_the_host_link_pays(toy):
    config = OffloadConfig(min_bytes=1, max_inflight_bytes=0, prefetch_bytes=1)
    flops, timed = (_plan(toy, 0.15, cost, offload=config) for cost in ("flops", "time"))
    # FLOPs see offload as free; at 10 GB/s the last block's reload, exposed whole, costs more than it saves.
    assert [b.offload for b in flops.blocks] == [True] * 4 and flops.offload_seconds > 0
    assert not any(b.offload for b in timed.blocks) and timed.offload_seconds == 0
    assert timed.overhead is not None and flops.overhead is not None and timed.overhead < flops.overhead
    fast = Device("fast", 1e12, 2e12, None, 1e11, 1e13, 2**34)  # a host link as fast as compute hides it
    timed = _plan(toy, 0.15, "time", device=fast, offload=config)
    assert any(b.offload for b in timed.blocks) and timed.device_bytes <= timed.budget_bytes


def test_the_default_costs_in_time_only_where_the_device_is_known_without_measuring(mixed, tmp_path, monkeypatch):
    path = tmp_path / "calibration.json"
    monkeypatch.setenv(CALIBRATION_ENV, str(path))
    plan = plan_activation_checkpointing(mixed.case.model, mixed.case.inputs, 0.5, blocks=BLOCKS)
    assert (plan.cost, plan.device) == ("flops", None)  # a CPU never calibrated: not measured while planning
    save_calibration(Device("cpu", 1e12, 2e12, None, 1e11, 1e10, 2**34), path)
    plan = plan_activation_checkpointing(mixed.case.model, mixed.case.inputs, 0.5, blocks=BLOCKS)
    assert (plan.cost, plan.device) == ("time", "cpu")
    assert _decisions(plan) == _decisions(_plan(mixed, 0.5, "time"))  # the same figures as DEVICE's
    assert _plan(mixed, 0.5, None, device="h100").device == "h100-sxm"
    wide = copy.deepcopy(mixed.case).model.double()  # no float64 rate in the calibration: FLOPs, not an error
    inputs = {k: v.double() if v.is_floating_point() else v for k, v in mixed.case.inputs.items()}
    plan = plan_activation_checkpointing(wide, inputs, 0.5, blocks=BLOCKS)
    assert (plan.cost, plan.device) == ("flops", None)


def test_bad_cost_and_time_without_a_device_are_refused(mixed, monkeypatch, tmp_path):
    monkeypatch.setenv(CALIBRATION_ENV, str(tmp_path / "none.json"))
    with pytest.raises(ValueError, match='cost takes "time" or "flops"'):
        _plan(mixed, 0.5, "seconds")
    with pytest.raises(ValueError, match=r'cost="time" needs a device.*device='):
        _plan(mixed, 0.5, "time", device=None)
