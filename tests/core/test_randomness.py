"""Gradients equal the plain model's for every kind of randomness in a block, not only nn.Dropout modules."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ac_core import BlockSkip, Full, Ops, apply_activation_checkpointing


class _FunctionalDropout(nn.Module):
    """Dropout through F.dropout with p in a plain attribute: no nn.Dropout module to recognise."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.p = 0.3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.dropout(self.proj(x), self.p, self.training)


class _DropPath(nn.Module):
    """Stochastic depth drawn with torch.rand; at rate 0 it draws nothing (as timm's DropPath)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.p = 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.p == 0 or not self.training:
            return x + self.proj(x)
        keep = (torch.rand(x.shape[0], 1, 1) > self.p).to(x.dtype)
        return x + self.proj(x) * keep / (1 - self.p)


class _AttentionDropout(nn.Module):
    """SDPA's own dropout_p, as transformers' and diffusers' processors pass it."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return x + F.scaled_dot_product_attention(q, k, v, dropout_p=0.3 if self.training else 0.0)


class _Stack(nn.Module):
    def __init__(self, block: type[nn.Module], depth: int = 3, dim: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList(block(dim) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _grads(model: nn.Module, x: torch.Tensor, seed: int) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    model(x).pow(2).mean().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("block", [_FunctionalDropout, _DropPath, _AttentionDropout, nn.Dropout])
@pytest.mark.parametrize("policy", [Full(), Ops(), BlockSkip(every=2)], ids=["full", "ops", "block_skip"])
def test_gradients_equal_plain_for_every_kind_of_randomness(block, policy):
    def make(dim: int) -> nn.Module:
        return nn.Sequential(nn.Linear(dim, dim), nn.Dropout(0.3)) if block is nn.Dropout else block(dim)

    torch.manual_seed(0)
    plain = _Stack(make).train()  # type: ignore[arg-type]
    ours = _Stack(make).train()  # type: ignore[arg-type]
    ours.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(ours, policy, blocks=["layers"])
    x = torch.randn(4, 8, 16)
    for seed in (1, 2):  # the first step and a later one, after the block's randomness was observed
        expected, got = _grads(plain, x, seed), _grads(ours, x, seed)
        for e, g in zip(expected, got, strict=True):
            torch.testing.assert_close(g, e, rtol=0, atol=0)
        assert any(e.abs().sum() > 0 for e in expected)


@pytest.mark.parametrize("block", [_FunctionalDropout, _DropPath])
@pytest.mark.parametrize("rates", [(0.0, 0.3), (0.3, 0.0, 0.3)], ids=["warm-up from 0", "down to 0 and back"])
@pytest.mark.parametrize("policy", [Full(), Ops(), BlockSkip(every=2)], ids=["full", "ops", "block_skip"])
def test_gradients_equal_plain_when_the_rate_changes_between_steps(block, rates, policy):
    # A rate warmed up from 0 draws no random number at first; later calls draw, and recompute must replay them.
    torch.manual_seed(0)
    plain = _Stack(block).double().train()
    ours = _Stack(block).double().train()
    ours.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(ours, policy, blocks=["layers"])
    x = torch.randn(4, 8, 16, dtype=torch.float64)
    for seed, rate in enumerate(rates):
        for model in (plain, ours):
            for layer in model.layers:
                layer.p = rate
        expected = _grads(plain, x, seed)
        plain_rng = torch.get_rng_state()
        got = _grads(ours, x, seed)
        assert all(torch.equal(g, e) for e, g in zip(expected, got, strict=True)), (seed, rate)
        assert torch.equal(torch.get_rng_state(), plain_rng), "the global RNG ends where the plain one's does"
