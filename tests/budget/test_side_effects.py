"""Planning leaves no trace on real tensors: RNG, parameters, buffers, training flags, example inputs and the
user's hooks are as they were after it (on error too); a block changing its input in place, or failing, is
named."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ac_core import apply_activation_checkpointing, checkpointed_blocks, remove_activation_checkpointing
from ac_core.budget import Budget, plan_activation_checkpointing
from ac_core.measure import held_for_backward
from tests.budget.noisy import (
    DIM,
    Counts,
    FailingBlock,
    InPlaceBlock,
    Noisy,
    NoisyBlock,
    assert_unchanged,
    snapshot,
)


@pytest.fixture
def noisy():
    torch.manual_seed(0)
    model, x = Noisy().train(), torch.randn(8, DIM) * 2
    counts = Counts(model)
    yield model, x, counts
    counts.remove()


@pytest.mark.parametrize("budget", [0.75, 0.9, 1.0])
def test_planning_leaves_the_model_inputs_rng_and_hooks_as_they_were(noisy, budget):
    model, x, counts = noisy
    before = snapshot(model, x)
    plan = plan_activation_checkpointing(model, x, budget, blocks=["layers"])
    assert_unchanged(before, model, x)
    assert counts.calls == dict.fromkeys(counts.calls, 0)
    # The planned model trains: one forward runs every hook once and changes what the forward changes.
    apply_activation_checkpointing(model, plan)
    try:
        model(x.clone()).sum().backward()
    finally:
        remove_activation_checkpointing(model)
    assert counts.calls["root"] == counts.calls["block"] == counts.calls["root pre"] == 1
    assert model.calls.item() == 1 and not torch.equal(model.layers[0].norm.running_mean, torch.zeros(DIM))


def test_the_budget_policy_plans_without_a_trace(noisy):
    model, x, counts = noisy
    before = snapshot(model, x)
    apply_activation_checkpointing(model, Budget(0.75, example_inputs=x), blocks=["layers"])
    try:
        assert checkpointed_blocks(model)
        assert_unchanged(before, model, x)
    finally:
        remove_activation_checkpointing(model)
    assert counts.calls == dict.fromkeys(counts.calls, 0)


def test_hooks_of_torch_and_the_model_libraries_run_in_planning(noisy):
    model, x, counts = noisy
    seen = []

    def library_hook(module: nn.Module, args: tuple) -> None:
        seen.append(type(module).__name__)

    library_hook.__module__ = "transformers.integrations.example"  # as if defined there
    handle = model.layers[1].register_forward_pre_hook(library_hook)
    try:
        plan_activation_checkpointing(model, x, 0.5, blocks=["layers"])
    finally:
        handle.remove()
    assert seen and set(seen) == {"NoisyBlock"}  # the whole forward, the block alone, all checkpointed
    assert counts.calls == dict.fromkeys(counts.calls, 0)


def test_a_failing_block_is_named_and_nothing_changes():
    torch.manual_seed(0)
    model, x = Noisy((NoisyBlock, NoisyBlock, FailingBlock)).train(), torch.randn(8, DIM) * 2
    counts = Counts(model)
    before = snapshot(model, x)
    try:
        with pytest.raises(
            ValueError, match=r"planning failed in block 'layers\.2' \(FailingBlock\): RuntimeError: boom"
        ):
            plan_activation_checkpointing(model, x, 0.5, blocks=["layers"])
    finally:
        counts.remove()
    assert_unchanged(before, model, x)
    assert counts.calls == dict.fromkeys(counts.calls, 0)


def test_a_failing_op_is_named():
    class Mismatch(NoisyBlock):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ torch.ones(DIM + 1, DIM)

    model = Noisy((NoisyBlock, Mismatch, NoisyBlock))
    with pytest.raises(ValueError, match=r"block 'layers\.1' \(Mismatch\) at aten::mm: RuntimeError"):
        plan_activation_checkpointing(model, torch.randn(8, DIM), 0.5, blocks=["layers"])


def test_a_block_changing_its_input_in_place_is_refused_by_name_and_op():
    torch.manual_seed(0)
    model, x = Noisy((NoisyBlock, InPlaceBlock, NoisyBlock)).train(), torch.randn(8, DIM) * 2
    # Legal in the plain model, which holds for backward what it holds.
    _, held = held_for_backward(lambda: model(x.clone()))
    assert held > 0
    before = snapshot(model, x)
    with pytest.raises(ValueError) as refused:
        plan_activation_checkpointing(model, x, 0.5, blocks=["layers"])
    message = str(refused.value)
    assert "block 'layers.1' (InPlaceBlock) changes its input in place in its forward (0 by aten::mul_)" in message
    assert "x = x.clone()" in message and "blocks=[...]" in message
    assert_unchanged(before, model, x)


def test_the_fixes_the_refusal_names_plan():
    class Cloning(InPlaceBlock):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x.clone())

    x = torch.randn(8, DIM)
    plan = plan_activation_checkpointing(Noisy((NoisyBlock, Cloning, NoisyBlock)), x, 0.95, blocks=["layers"])
    assert [b.class_name for b in plan.blocks] == ["NoisyBlock", "Cloning", "NoisyBlock"]

    class TwoStacks(nn.Module):
        """The in-place block in a container of its own, left unchecked by naming only the other."""

        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(NoisyBlock() for _ in range(2))
            self.head = nn.ModuleList(InPlaceBlock() for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in [*self.layers, *self.head]:
                x = layer(x)
            return x

    plan = plan_activation_checkpointing(TwoStacks(), x, 0.95, blocks=["layers"])
    assert [b.path for b in plan.blocks] == ["layers.0", "layers.1"]
