"""Planning from the user's own training step: the same plan as from example inputs, no trace on the step, and
models that only run in their caller's context."""

from __future__ import annotations

import contextvars
import copy

import pytest
import torch
from torch import nn

import ac_core
from ac_core import apply_activation_checkpointing, checkpointed_blocks, remove_activation_checkpointing
from ac_core.blocks import resolve_blocks
from ac_core.budget import StepProfile, plan_activation_checkpointing, profile_model, profile_step
from ac_core.budget.profile import _held_all_full
from ac_core.measure import held_for_backward, measure_step
from ac_core.testing import LibraryCheckpointingToy, toy_case
from tests.budget.noisy import DIM, Counts, InPlaceBlock, Noisy, NoisyBlock

BLOCKS = ["layers"]
FRACTIONS = (0.25, 0.5, 0.75)


def _step(case) -> StepProfile:
    with profile_step(case.model, blocks=BLOCKS) as rec:
        case.run().backward()
    return rec


@pytest.fixture(scope="module")
def toy():
    case = toy_case()
    return case, profile_model(resolve_blocks(case.model, None, BLOCKS), case.inputs), _step(case)


def test_exported_lazily():
    assert ac_core.profile_step is profile_step
    assert "profile_step" in ac_core.__all__


def test_the_steps_figures_are_those_of_the_example_inputs(toy):
    _, expected, rec = toy
    got = rec.profile
    assert got.none_bytes == expected.none_bytes
    assert got.min_bytes == expected.min_bytes
    assert got.blocks == expected.blocks and got.inputs == expected.inputs
    assert got.model_class == expected.model_class


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_the_steps_plan_is_the_example_inputs_plan(toy, fraction):
    case, _, rec = toy
    plan = rec.plan(fraction)
    assert plan == plan_activation_checkpointing(case.model, case.inputs, fraction, blocks=BLOCKS)
    assert {b.mode for b in plan.blocks} != {"none"}


def test_min_bytes_is_what_the_forward_with_every_block_checkpointed_holds(toy):
    case, _, rec = toy
    full, _ = _held_all_full(resolve_blocks(case.model, None, BLOCKS), case.inputs)
    assert rec.profile.min_bytes == full == 5 * 2 * 32 * 64 * 4  # the blocks' 4 inputs and the last one's output
    plan = rec.plan(rec.profile.min_bytes)
    assert {b.mode for b in plan.blocks} == {"full"}
    apply_activation_checkpointing(case.model, plan)
    try:
        _, held = held_for_backward(lambda: case.model(**case.inputs))
    finally:
        remove_activation_checkpointing(case.model)
    assert held == plan.held_bytes == full


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_gradients_under_the_steps_plan_equal_the_plain_models(fraction):
    case = toy_case(dropout=0.1)
    case.model.double()
    case.inputs["x"] = case.inputs["x"].double()
    reference = measure_step(case)
    torch.manual_seed(0)
    plan = _step(case).plan(fraction)
    apply_activation_checkpointing(case.model, plan)
    try:
        _, held = held_for_backward(case.run)  # the loss's float32 copy of the output counted, as in the step
        step = measure_step(case)
    finally:
        remove_activation_checkpointing(case.model)
    assert held == plan.held_bytes <= plan.budget_bytes
    assert step.loss == reference.loss
    for name, grad in reference.grads.items():
        assert torch.equal(step.grads[name], grad), name


def _noisy_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(1)
    loss = model(x.clone()).pow(2).mean()
    loss.backward()
    return loss


def test_the_step_is_as_the_step_alone_leaves_it():
    torch.manual_seed(0)
    plain, x = Noisy().train(), torch.randn(8, DIM) * 2
    profiled = copy.deepcopy(plain)
    plain_counts, profiled_counts = Counts(plain), Counts(profiled)
    try:
        expected = _noisy_step(plain, x)
        expected_rng = torch.get_rng_state()
        with profile_step(profiled, blocks=BLOCKS) as rec:
            got = _noisy_step(profiled, x)
        got_rng = torch.get_rng_state()
    finally:
        plain_counts.remove()
        profiled_counts.remove()
    assert torch.equal(got, expected) and torch.equal(got_rng, expected_rng)
    assert profiled_counts.calls == plain_counts.calls
    assert plain_counts.calls["block"] == plain_counts.calls["inner"] == 1
    for (name, a), (_, b) in zip(plain.named_parameters(), profiled.named_parameters(), strict=True):
        assert torch.equal(a, b), name
        assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad), name
    for (name, a), (_, b) in zip(plain.named_buffers(), profiled.named_buffers(), strict=True):
        assert torch.equal(a, b), name
    assert rec.plan(0.9).none_bytes == rec.profile.none_bytes


SCALE: contextvars.ContextVar[float] = contextvars.ContextVar("scale")


class _NeedsContext(nn.Module):
    """Reads a context variable its caller sets (as FastVideo's forward context): fails outside that context."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList(NoisyBlock(p=0.0) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = SCALE.get()  # LookupError where the caller did not set it
        x = self.embed(x) * scale
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_model_that_needs_its_callers_context_plans_from_the_step():
    torch.manual_seed(0)
    model, x = _NeedsContext().double(), torch.randn(8, DIM, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"failed outside its blocks: LookupError.*ac_core\.profile_step\(model\)"):
        plan_activation_checkpointing(model, x, 0.5, blocks=BLOCKS)
    plain = copy.deepcopy(model)

    def train_step(net: nn.Module) -> None:
        token = SCALE.set(0.5)
        try:
            net(x).pow(2).mean().backward()
        finally:
            SCALE.reset(token)

    with profile_step(model, blocks=BLOCKS) as rec:
        train_step(model)
    model.zero_grad(set_to_none=True)
    plan = rec.plan(0.5)
    assert {b.mode for b in plan.blocks} != {"none"}
    train_step(plain)
    apply_activation_checkpointing(model, plan)
    try:
        train_step(model)
    finally:
        remove_activation_checkpointing(model)
    for (name, a), (_, b) in zip(plain.named_parameters(), model.named_parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name


def test_a_checkpointed_model_is_profiled_unchecked_and_keeps_its_checkpointing(toy):
    case, expected, _ = toy
    apply_activation_checkpointing(case.model, "full", blocks=BLOCKS)
    try:
        rec = _step(case)
        assert set(checkpointed_blocks(case.model)) == {f"layers.{i}" for i in range(4)}
    finally:
        remove_activation_checkpointing(case.model)
    assert rec.profile.none_bytes == expected.none_bytes and rec.profile.blocks == expected.blocks


def test_the_librarys_own_checkpointing_is_set_aside_for_the_step(toy):
    case, expected, _ = toy
    model = LibraryCheckpointingToy()
    model.enable_gradient_checkpointing()
    with profile_step(model, blocks=BLOCKS) as rec:
        model(**case.inputs).pow(2).mean().backward()
    assert model.gradient_checkpointing is True
    assert rec.profile.none_bytes == expected.none_bytes


def test_a_block_changing_its_input_in_place_is_named_in_the_step():
    model = Noisy((NoisyBlock, InPlaceBlock, NoisyBlock))
    backward, hooks = torch.autograd.backward, dict(model.layers[1]._forward_pre_hooks)
    refused = r"block 'layers\.1' \(InPlaceBlock\) changes its input in place .*aten::mul_"
    with pytest.raises(ValueError, match=refused), profile_step(model, blocks=BLOCKS):
        model(torch.randn(8, DIM)).sum().backward()
    assert torch.autograd.backward is backward and model.layers[1]._forward_pre_hooks == hooks  # all taken off


def test_what_a_step_cannot_plan_is_refused(toy):
    case, _, rec = toy
    with pytest.raises(ValueError, match="offload"):
        rec.plan(0.5, offload=True)
    with profile_step(case.model, blocks=BLOCKS) as early:
        with pytest.raises(ValueError, match="once backward starts"):
            early.plan(0.5)
        case.run().backward()
    with profile_step(case.model, blocks=BLOCKS) as partial:
        case.model.embed(case.inputs["x"]).sum().backward()
    with pytest.raises(ValueError, match=r"no forward with grad through block\(s\) \['layers\.0', 'layers\.1'"):
        partial.plan(0.5)
    with pytest.raises(RuntimeError, match="records one step"), rec:
        pass
    with pytest.raises(KeyError), profile_step(case.model, blocks=BLOCKS) as failed:
        case.model(**case.inputs)
        raise KeyError("the step failed")
    with pytest.raises(ValueError, match="without an error"):
        failed.plan(0.5)


def test_tiny_models_step_figures_equal_the_example_inputs_ones():
    # A diffusers model (Wan's timestep projection: a block input the forward frees) and a transformers one whose
    # config has use_cache on: the step runs without the KV cache, as a plan does.
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from ac_core_adapters.models.llama import tiny_llama_model
    from ac_core_adapters.models.wan import tiny_wan

    for case in (tiny_wan(), tiny_llama_model()):
        with profile_step(case.model) as rec:
            case.run().backward()
        config = case.model.config
        if getattr(config, "use_cache", None) is True:  # transformers': left as it was
            config.use_cache = False  # as the step ran
        resolved = resolve_blocks(case.model)
        expected = profile_model(resolved, dict(case.inputs))
        got = rec.profile
        assert (got.none_bytes, got.min_bytes, got.blocks) == (expected.none_bytes, expected.min_bytes, expected.blocks)
        assert got.min_bytes == _held_all_full(resolved, dict(case.inputs))[0]
        for fraction in FRACTIONS:
            assert rec.plan(fraction) == plan_activation_checkpointing(case.model, dict(case.inputs), fraction)


def test_the_step_runs_without_the_kv_cache_and_refuses_one_passed():
    pytest.importorskip("transformers")
    from ac_core_adapters.models.llama import tiny_llama_model

    case = tiny_llama_model()
    assert case.model.config.use_cache is True  # by default: a cache made in every forward
    refused = r"block 'layers\.0' \(LlamaDecoderLayer\) got a KV cache \(\w+\) in a forward with gradients"
    with pytest.raises(ValueError, match=refused), profile_step(case.model):
        case.model(**case.inputs, use_cache=True)
    assert case.model.config.use_cache is True
