"""The memory-budget policy on the toy model and on the tiny Wan model: budget held, gradients, plans."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ac_core import CheckpointType, apply_activation_checkpointing, checkpointed_blocks, remove_activation_checkpointing
from ac_core.budget import Budget, CheckpointPlan, MemoryBudget, plan_activation_checkpointing
from ac_core.measure import held_for_backward, measure_step
from ac_core.testing import ToyTransformer, toy_case

BLOCKS = ["layers"]


def _held(case) -> int:
    """Bytes the model's forward holds for backward (the loss's own saved tensors left out, as a plan does)."""
    _, held = held_for_backward(lambda: case.model(**case.inputs))
    return held


@pytest.fixture(scope="module")
def toy():
    case = toy_case()
    reference = measure_step(case)
    return case, reference, _held(case)


def _fixed_policies(case, none_held: int, none_flops: int) -> dict[str, tuple[int, int]]:
    """policy -> (held bytes, recompute FLOPs), measured, for full, ops and block_skip with every n."""
    found = {"none": (none_held, 0)}
    for name, config in [("full", "full"), ("ops", "ops")] + [(f"block_skip{n}", n) for n in (2, 3, 4)]:
        if isinstance(config, int):
            apply_activation_checkpointing(case.model, "block_skip", config, blocks=BLOCKS)
        else:
            apply_activation_checkpointing(case.model, config, blocks=BLOCKS)
        held = _held(case)
        found[name] = (held, measure_step(case, keep_grads=False).flops - none_flops)
        remove_activation_checkpointing(case.model)
    return found


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_budget_holds_gradients_equal_and_beats_fixed_policies(toy, fraction):
    case, reference, none_held = toy
    plan = plan_activation_checkpointing(case.model, case.inputs, fraction, blocks=BLOCKS)
    assert plan.none_bytes == none_held
    apply_activation_checkpointing(case.model, plan, blocks=BLOCKS)
    try:
        held = _held(case)
        step = measure_step(case)
    finally:
        remove_activation_checkpointing(case.model)
    assert held <= plan.budget_bytes == int(fraction * none_held)
    assert held == plan.held_bytes  # the prediction is exact on the toy
    assert step.flops - reference.flops == plan.recompute_flops
    for name, grad in reference.grads.items():
        torch.testing.assert_close(step.grads[name], grad, rtol=0, atol=0)
    fixed = _fixed_policies(case, none_held, reference.flops)
    fitting = [flops for held_fixed, flops in fixed.values() if held_fixed <= plan.budget_bytes]
    assert plan.recompute_flops <= min(fitting)


def test_budget_at_a_fixed_policys_own_bytes_does_no_worse(toy):
    case, reference, none_held = toy
    fixed = _fixed_policies(case, none_held, reference.flops)
    for name, (held, flops) in fixed.items():
        if name == "none":
            continue
        plan = plan_activation_checkpointing(case.model, case.inputs, held, blocks=BLOCKS)
        assert plan.held_bytes <= held and plan.recompute_flops <= flops, name


def test_apply_through_the_verb_and_budget_config(toy):
    case, _, none_held = toy
    apply_activation_checkpointing(case.model, Budget(0.5, example_inputs=case.inputs), blocks=BLOCKS)
    try:
        kinds = checkpointed_blocks(case.model)
        assert _held(case) <= none_held // 2
    finally:
        remove_activation_checkpointing(case.model)
    assert set(kinds) == {"layers.0", "layers.1", "layers.2", "layers.3"}
    # Through the verb alone: the plan's own layers, keeping the planned occurrences (the same bytes).
    apply_activation_checkpointing(case.model, Budget(0.5, example_inputs=case.inputs), blocks=BLOCKS)
    try:
        held = _held(case)
        assert held <= none_held // 2
        assert set(checkpointed_blocks(case.model).values()) <= {CheckpointType.FULL, CheckpointType.OPS}
    finally:
        remove_activation_checkpointing(case.model)
    plan = plan_activation_checkpointing(case.model, case.inputs, 0.5, blocks=BLOCKS)
    assert held == plan.held_bytes
    apply_activation_checkpointing(case.model, plan, blocks=BLOCKS)
    try:
        assert _held(case) == plan.held_bytes
    finally:
        remove_activation_checkpointing(case.model)


def test_json_round_trip_and_table(toy):
    case, _, _ = toy
    plan = plan_activation_checkpointing(case.model, case.inputs, 0.3, blocks=BLOCKS)
    again = CheckpointPlan.from_json(plan.to_json())
    assert again == plan and again.fingerprint == plan.fingerprint
    table = str(plan)
    assert "layers.3" in table and "ToyBlock" in table and "recompute" in table
    with pytest.raises(ValueError, match="edited"):
        CheckpointPlan.from_json(plan.to_json().replace('"ToyBlock"', '"OtherBlock"', 1))


def test_refused_on_another_shape_class_and_layout(toy):
    case, _, _ = toy
    plan = plan_activation_checkpointing(case.model, case.inputs, 0.3, blocks=BLOCKS)
    apply_activation_checkpointing(case.model, plan, blocks=BLOCKS)
    try:
        with pytest.raises(ValueError, match=r"other input shapes.*layers\.0.*\[2, 32, 64\].*\[2, 16, 64\]"):
            case.model(x=torch.randn(2, 16, 64))
    finally:
        remove_activation_checkpointing(case.model)
    with pytest.raises(ValueError, match="4 blocks and the model has 6"):
        apply_activation_checkpointing(ToyTransformer(depth=6), plan, blocks=BLOCKS)
    other = torch.nn.Sequential(ToyTransformer())
    with pytest.raises(ValueError, match=r"is for ac_core\.testing\.ToyTransformer, not torch\.nn"):
        apply_activation_checkpointing(other, plan, blocks=["0.layers"])


def test_bad_budgets(toy, caplog):
    case, _, _ = toy
    for bad in (0, 0.0, -1, -0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match="memory_budget"):
            plan_activation_checkpointing(case.model, case.inputs, bad, blocks=BLOCKS)
    for bad in (None, [0.5], True):
        with pytest.raises(TypeError, match="fraction"):
            plan_activation_checkpointing(case.model, case.inputs, bad, blocks=BLOCKS)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a size"):
        plan_activation_checkpointing(case.model, case.inputs, "lots", blocks=BLOCKS)
    minimum = plan_activation_checkpointing(case.model, case.inputs, 0.5, blocks=BLOCKS).min_bytes
    with pytest.raises(ValueError, match=f"least any plan holds.*: {minimum} bytes"):
        plan_activation_checkpointing(case.model, case.inputs, minimum - 1, blocks=BLOCKS)
    at_least = plan_activation_checkpointing(case.model, case.inputs, minimum, blocks=BLOCKS)
    assert {b.mode for b in at_least.blocks} == {"full"}
    with caplog.at_level(logging.WARNING, logger="ac_core"):
        plan = plan_activation_checkpointing(case.model, case.inputs, 1.0, blocks=BLOCKS)
    assert {b.mode for b in plan.blocks} == {"none"} and "checkpoints no block" in caplog.text
    assert MemoryBudget.of("40GiB").nbytes == 40 * 2**30
    assert MemoryBudget.of("1.5 MB").nbytes == 1_500_000
    assert MemoryBudget.of(0.5).bytes_of(1000) == 500 and MemoryBudget.of("1KB").fraction_of(4000) == 0.25
    assert MemoryBudget.of(MemoryBudget.of(0.5)) == MemoryBudget.of(0.5)  # parsed once, taken as is downstream
    with pytest.raises(ValueError, match="needs memory_budget"):
        Budget()
    with pytest.raises(ValueError, match=r"made by ac_core\.plan_activation_checkpointing"):
        CheckpointPlan()


def test_meta_planning_matches_real_and_is_reproducible(toy):
    case, _, _ = toy
    real = plan_activation_checkpointing(case.model, case.inputs, 0.4, blocks=BLOCKS)
    assert plan_activation_checkpointing(case.model, case.inputs, 0.4, blocks=BLOCKS) == real
    with torch.device("meta"):
        model = ToyTransformer()
    meta = plan_activation_checkpointing(model, {"x": torch.empty(2, 32, 64, device="meta")}, 0.4, blocks=BLOCKS)
    assert meta == real and meta.to_json() == real.to_json()


def test_fake_tensor_planning_matches_real(toy):
    # Planning a model built under torch's FakeTensorMode, as a framework tracing it does: the same plan.
    case, _, _ = toy
    with FakeTensorMode():
        model = ToyTransformer()
        fakes = [
            plan_activation_checkpointing(model, {"x": torch.empty(2, 32, 64)}, budget, blocks=BLOCKS)
            for budget in (0.25, 0.4, 0.75)
        ]
    for budget, fake in zip((0.25, 0.4, 0.75), fakes, strict=True):
        real = plan_activation_checkpointing(case.model, case.inputs, budget, blocks=BLOCKS)
        assert fake == real and fake.to_json() == real.to_json()


def test_tiny_wan_budget_holds_and_gradients_equal():
    pytest.importorskip("diffusers")
    from ac_core_adapters.models.wan import tiny_wan

    case = tiny_wan()
    reference = measure_step(case)
    none_held = _held(case)
    plan = plan_activation_checkpointing(case.model, case.inputs, 0.25)
    assert plan.none_bytes == none_held
    assert plan_activation_checkpointing(case.model, case.inputs, 0.25) == plan
    assert CheckpointPlan.from_json(plan.to_json()) == plan
    apply_activation_checkpointing(case.model, plan)
    try:
        held = _held(case)
        step = measure_step(case)
    finally:
        remove_activation_checkpointing(case.model)
    # The timestep projection, freed under none, is kept by checkpointed blocks: counted in the prediction.
    assert held == plan.held_bytes <= plan.budget_bytes
    for name, grad in reference.grads.items():
        torch.testing.assert_close(step.grads[name], grad)


def test_blocks_called_several_times_per_forward_count_every_call():
    # Wan-Animate's motion encoder runs its res blocks once per chunk of frames: a kept output is kept per call.
    pytest.importorskip("diffusers")
    from ac_core_adapters.models.wan import tiny_animate

    case = tiny_animate()
    plan = plan_activation_checkpointing(case.model, case.inputs, 0.5)
    apply_activation_checkpointing(case.model, plan)
    try:
        held = _held(case)
    finally:
        remove_activation_checkpointing(case.model)
    assert held == plan.held_bytes <= plan.budget_bytes


class _ReadsAValue(torch.nn.Module):
    """A model whose forward branches on a tensor's value, as HunyuanVideo 1.5's does."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.all(x == 0):
            return x
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_forward_reading_values_cannot_be_planned_from_shapes_and_says_so():
    with torch.device("meta"):
        model, x = _ReadsAValue(), torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"_ReadsAValue's forward reads a tensor's value .* plan it on real tensors"):
        plan_activation_checkpointing(model, x, 0.5, blocks=BLOCKS)
    plan = plan_activation_checkpointing(_ReadsAValue(), torch.randn(2, 8, requires_grad=True), 1.0, blocks=BLOCKS)
    assert [b.mode for b in plan.blocks] == ["none", "none"]  # real tensors plan
