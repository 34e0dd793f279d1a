"""A plan made with blocks= carries its containers: applied and compiled without repeating them."""

from __future__ import annotations

import copy

import pytest
import torch

import ac_core
from ac_core import apply_activation_checkpointing, checkpointed_blocks, resolve_blocks
from ac_core.budget import CheckpointPlan, plan_activation_checkpointing, profile_model
from ac_core.errors import AdapterError
from ac_core.testing import TOY_ADAPTER, toy_case


def _grads(case) -> tuple[torch.Tensor, list[torch.Tensor]]:
    case.model.zero_grad(set_to_none=True)
    loss = case.run()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in case.model.parameters() if p.grad is not None]


def test_a_plan_made_with_blocks_applies_without_them_and_says_so_in_json():
    case = toy_case(dim=32, heads=2, depth=3, tokens=8)
    plain = copy.deepcopy(case)
    plan = plan_activation_checkpointing(case.model, case.inputs, 0.5, blocks=["layers"])
    assert plan.containers == ("layers",)
    assert CheckpointPlan.from_json(plan.to_json()).containers == ("layers",)
    apply_activation_checkpointing(case.model, plan)  # no adapter serves the toy: the plan names its blocks
    checkpointed = [b.path for b in plan.blocks if b.mode != "none"]
    assert checkpointed and sorted(checkpointed_blocks(case.model)) == checkpointed
    expected, got = _grads(plain), _grads(case)
    assert torch.equal(got[0], expected[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], expected[1], strict=True))


def test_a_plan_made_by_the_adapter_records_no_containers():
    case = toy_case(dim=32, heads=2, depth=2, tokens=8)
    plan = plan_activation_checkpointing(case.model, case.inputs, 0.5, adapter=TOY_ADAPTER)
    assert plan.containers is None


def test_a_plan_with_containers_still_refuses_another_layout():
    case = toy_case(dim=32, heads=2, depth=3, tokens=8)
    plan = plan_activation_checkpointing(case.model, case.inputs, 0.5, blocks=["layers"])
    other = toy_case(dim=32, heads=2, depth=4, tokens=8)
    with pytest.raises(ValueError, match="this checkpoint plan is for 3 blocks and the model has 4"):
        apply_activation_checkpointing(other.model, plan)
    assert not checkpointed_blocks(other.model)
    with pytest.raises(AdapterError, match="names block container 'nope'"):
        apply_activation_checkpointing(case.model, CheckpointPlan(**{**vars(plan), "containers": ("nope",)}))


def test_a_plan_made_with_blocks_compiles_without_them():
    case = toy_case(dim=32, heads=2, depth=2, tokens=8)
    plain = copy.deepcopy(case)
    plan = plan_activation_checkpointing(case.model, case.inputs, 0.5, blocks=["layers"])
    case.model = ac_core.compile(case.model, plan, backend="aot_eager")
    expected, got = _grads(plain), _grads(case)
    assert torch.equal(got[0], expected[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], expected[1], strict=True))


class _Scaled(torch.nn.Module):
    """One class, two behaviours: ``inplace`` changes the first matmul's output in place (keeping it is wrong)."""

    def __init__(self, dim: int, inplace: bool) -> None:
        super().__init__()
        self.inplace = inplace
        self.inp, self.out = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h.mul_(2).relu_() if self.inplace else torch.relu(h * 2)
        return x + self.out(h)


class _Mixed(torch.nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Scaled(dim, inplace=i == 2) for i in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_each_block_is_profiled_on_its_own_so_no_plan_keeps_an_output_its_block_changes():
    torch.manual_seed(0)
    model = _Mixed().double()
    plain = copy.deepcopy(model)
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    profile = dict(profile_model(resolve_blocks(model, blocks=["layers"]), x).blocks)
    keepable = {path: {(op.op, op.index) for op in p.candidates} for path, p in profile.items()}
    assert ("aten::addmm", 0) in keepable["layers.0"] and ("aten::addmm", 0) in keepable["layers.1"]
    assert ("aten::addmm", 0) not in keepable["layers.2"]  # its first matmul's output is changed in place
    plan = plan_activation_checkpointing(model, x, 0.75, blocks=["layers"])
    assert all(("aten::addmm", 0) not in b.keep for b in plan.blocks if b.path == "layers.2")
    apply_activation_checkpointing(model, plan)
    model(x).pow(2).sum().backward()
    plain(x).pow(2).sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), model.parameters(), strict=True))


def test_blocks_the_forward_never_calls_are_named_with_the_blocks_argument_that_leaves_them_out():
    case = toy_case(dim=32, heads=2, depth=2, tokens=8)
    case.model.unused = copy.deepcopy(case.model.layers)  # a tower the inputs never reach (text-only training)
    with pytest.raises(ValueError, match="never called") as caught:
        plan_activation_checkpointing(case.model, case.inputs, 0.5, blocks=["layers", "unused"])
    assert "['unused.0', 'unused.1']" in str(caught.value)
    assert "leave unused out of the plan with blocks=['layers']" in str(caught.value)
    plan = plan_activation_checkpointing(case.model, case.inputs, 0.5, blocks=["layers"])
    assert [b.path for b in plan.blocks] == ["layers.0", "layers.1"]
