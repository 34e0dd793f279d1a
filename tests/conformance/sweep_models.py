"""Model classes the sweep's tests point targets at: one it must prove, one whose recompute differs from its forward,
one that hangs, one whose process dies."""

from __future__ import annotations

import os
import time

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn


class SweptBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return x + self.out(attn.transpose(1, 2).reshape(b, n, d))


class SweptModel(ModelMixin, ConfigMixin):
    """A diffusers model declaring its repeated blocks: the library route serves it."""

    _repeated_blocks = ("SweptBlock",)

    @register_to_config
    def __init__(self, in_channels: int = 4, dim: int = 32, num_layers: int = 2) -> None:
        super().__init__()
        self.proj_in = nn.Linear(in_channels, dim)
        self.blocks = nn.ModuleList(SweptBlock(dim) for _ in range(num_layers))
        self.proj_out = nn.Linear(dim, in_channels)

    def forward(self, hidden_states: torch.Tensor, return_dict: bool = True) -> torch.Tensor:
        x = self.proj_in(hidden_states)
        for block in self.blocks:
            x = block(x)
        return self.proj_out(x)


class CountingBlock(SweptBlock):
    """Scales its output by how often it ran: a recompute in backward runs it again, with another scale."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CountingBlock.calls += 1
        return super().forward(x) * (1.0 + 0.5 * CountingBlock.calls)


class CountingModel(SweptModel):
    _repeated_blocks = ("CountingBlock",)

    @register_to_config
    def __init__(self, in_channels: int = 4, dim: int = 32, num_layers: int = 2) -> None:
        super().__init__(in_channels, dim, num_layers)
        self.blocks = nn.ModuleList(CountingBlock(dim) for _ in range(num_layers))


class HangingModel(SweptModel):
    @register_to_config
    def __init__(self, in_channels: int = 4, dim: int = 32, num_layers: int = 2) -> None:
        time.sleep(600)
        super().__init__(in_channels, dim, num_layers)


class DyingModel(SweptModel):
    @register_to_config
    def __init__(self, in_channels: int = 4, dim: int = 32, num_layers: int = 2) -> None:
        os._exit(3)
