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
    """Stochastic depth drawn with torch.rand."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = (torch.rand(x.shape[0], 1, 1) > 0.5).to(x.dtype)
        return x + self.proj(x) * keep * 2


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
