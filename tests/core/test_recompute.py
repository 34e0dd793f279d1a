"""What recompute must not change or hide: buffers updated once a step, inputs changed in place refused, torch's
recompute limits named by block and fix."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ac_core
from ac_core import BlockSkip, Full, Ops, apply_activation_checkpointing
from ac_core.testing import ToyTransformer

POLICIES = [Full(), Ops(), BlockSkip(every=1)]
IDS = ["full", "ops", "block_skip"]


class _NormBlock(nn.Module):
    """BatchNorm in train mode: its running statistics change in every forward, and recompute runs it again."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.BatchNorm1d(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return x + self.norm(h.transpose(1, 2)).transpose(1, 2).relu()


class _Scales(nn.Module):
    """Changes its input in place: legal in the plain model, not recomputable."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(0.5)
        return self.proj(x)


class _Stack(nn.Module):
    def __init__(self, make: type[nn.Module], depth: int = 3, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.layers = nn.ModuleList(make(dim) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x


def _step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_buffers_after_steps_equal_the_plain_models(policy):
    torch.manual_seed(0)
    plain = _Stack(_NormBlock).double().train()
    ours = copy.deepcopy(plain)
    apply_activation_checkpointing(ours, policy, blocks=["layers"])
    for step in range(2):
        x = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        assert torch.equal(_step(ours, x), _step(plain, x))
    for (name, expected), (_, got) in zip(plain.named_buffers(), ours.named_buffers(), strict=True):
        assert torch.equal(got, expected), name  # running statistics and num_batches_tracked updated once a step
    assert int(ours.layers[0].norm.num_batches_tracked) == 2
    for p, q in zip(plain.parameters(), ours.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_a_block_changing_its_input_in_place_is_refused_at_its_forward_naming_it(policy):
    model = _Stack(_Scales)
    apply_activation_checkpointing(model, policy, blocks=["layers"])
    with pytest.raises(RuntimeError, match=r"block 'layers\.0' \(_Scales\) changes its input \(argument 0\) in place"):
        model(torch.randn(2, 5, 8))
    with torch.no_grad():  # nothing is recomputed without gradients: the plain forward runs
        model(torch.randn(2, 5, 8))


def test_a_second_backward_through_an_ops_block_names_the_block_and_the_fix():
    torch.manual_seed(0)
    model = ToyTransformer(dim=16, heads=2, depth=2)
    apply_activation_checkpointing(model, Ops(), blocks=["layers"])
    loss = model(torch.randn(2, 4, 16)).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"recomputing block 'layers\.1' \(ToyBlock\).*retain_graph=True.*Full\(\)"):
        loss.backward()
    # Full() recomputes again for the second backward, as torch's checkpoint does.
    apply_activation_checkpointing(model, Full(), blocks=["layers"])
    loss = model(torch.randn(2, 4, 16)).sum()
    loss.backward(retain_graph=True)
    loss.backward()


class _Twice(ToyTransformer):
    """Calls each block twice per forward (a weight-shared loop)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(layer(x))
        return self.head(x)


def _autocast_step(model: nn.Module, x: torch.Tensor, cache: bool) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
        loss = model(x).float().pow(2).mean()
    loss.backward()
    return [p.grad for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("policy", ["ops", "plan"])
def test_autocast_around_the_forward_of_a_block_called_twice_trains_as_the_plain_model(policy):
    # autocast's cast cache serves the second call's weight casts in forward; each recompute casts again.
    torch.manual_seed(0)
    plain = _Twice(dim=16, heads=2, depth=2)
    ours = copy.deepcopy(plain)
    x = torch.randn(2, 4, 16)
    if policy == "plan":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            config = ac_core.plan_activation_checkpointing(ours, {"x": x}, 0.5, blocks=["layers"])
        assert any(b.keep for b in config.blocks)  # a plan keeping op outputs: matched op by op as ops is
    else:
        config = Ops()
    apply_activation_checkpointing(ours, config, blocks=["layers"])
    for _ in range(2):
        expected, got = _autocast_step(plain, x, cache=True), _autocast_step(ours, x, cache=True)
        assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


class _Fails(nn.Module):
    """Fails in recompute only: any error there is named by block."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("state changed")
        return F.gelu(self.proj(x))


def test_any_error_in_recompute_names_the_block():
    model = _Stack(_Fails, depth=1)
    apply_activation_checkpointing(model, "full", blocks=["layers"])
    with pytest.raises(
        RuntimeError, match=r"recomputing block 'layers\.0' \(_Fails\) in backward failed: state changed"
    ):
        model(torch.randn(2, 5, 8)).sum().backward()


class _ScalesAttention(nn.Module):
    """Changes the attention output, which ``ops`` keeps, in place."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        attn = F.scaled_dot_product_attention(q, k, v)
        attn.mul_(2)
        return x + attn.squeeze(1)


def test_a_kept_output_changed_in_place_names_the_block_and_the_fix():
    model = _Stack(_ScalesAttention, depth=1)
    apply_activation_checkpointing(model, Ops(), blocks=["layers"])
    named = r"block 'layers\.0' \(_ScalesAttention\).*kept op output in place.*Full\(\)"
    with pytest.raises(RuntimeError, match=named):
        model(torch.randn(2, 5, 8)).sum().backward()
    apply_activation_checkpointing(model, Full(), blocks=["layers"])
    model(torch.randn(2, 5, 8)).sum().backward()
