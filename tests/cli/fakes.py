"""Adapters for CLI tests: a toy with a library's own checkpointing switch, one whose library is missing, and one
whose first forward is slow; and a model class whose constructor takes a config object, with factories for
``ac-core inspect --factory``."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import torch
from torch import nn

from ac_core import AdapterSpec, ModelCase, ModelSpec
from ac_core.testing import LibraryCheckpointingToy, ToyBlock, ToyTransformer


class LibraryToy(LibraryCheckpointingToy):
    """A class of its own, so that LIBRARY_TOY serves it and not TOY_ADAPTER's ToyTransformer alone."""


def library_toy_case() -> ModelCase:
    torch.manual_seed(0)
    return ModelCase(LibraryToy(), {"x": torch.randn(2, 32, 64)}, lambda out: out.pow(2).mean())


LIBRARY_TOY = AdapterSpec(
    name="librarytoy",
    models=(
        ModelSpec(
            cls=f"{__name__}.LibraryToy", containers=("layers",), attention_calls={"ToyBlock": 1}, tiny=library_toy_case
        ),
    ),
)

GHOST = AdapterSpec(
    name="ghost",
    library="ac-core-ghost-library",
    extra="ghost",
    models=(ModelSpec(cls="ghost_library.GhostTransformer", containers=("blocks",), tiny=library_toy_case),),
)


class ColdToy(ToyTransformer):
    """A toy whose first forward pays a one-time cost (a cache built lazily, a kernel loaded), as a library
    model's first call does; ``forwards`` counts its forwards and ``collector`` whether gc was on in each."""

    cold_s = 0.5

    def __init__(self) -> None:
        super().__init__()
        self.forwards = 0
        self.collector: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        self.collector.append(gc.isenabled())
        if self.forwards == 1:
            time.sleep(self.cold_s)
        return super().forward(x)


COLD_MODELS: list[ColdToy] = []


def cold_toy_case() -> ModelCase:
    torch.manual_seed(0)
    COLD_MODELS.append(ColdToy())
    return ModelCase(COLD_MODELS[-1], {"x": torch.randn(2, 32, 64)}, lambda out: out.pow(2).mean())


COLD_TOY = AdapterSpec(
    name="coldtoy",
    models=(
        ModelSpec(
            cls=f"{__name__}.ColdToy", containers=("layers",), attention_calls={"ToyBlock": 1}, tiny=cold_toy_case
        ),
    ),
)


@dataclass(frozen=True)
class PatchConfig:
    in_channels: int = 4
    width: int = 32
    patch_size: int = 2
    layers: int = 2


class ConfiguredPatchModel(nn.Module):
    """A model built from a config object, as other frameworks' models are (no derived keyword config builds it):
    a Conv2d patch embedding, then ToyBlocks over the patches."""

    def __init__(self, config: PatchConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = nn.Conv2d(config.in_channels, config.width, config.patch_size, stride=config.patch_size)
        self.blocks = nn.ModuleList(ToyBlock(config.width, 2) for _ in range(config.layers))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(hidden_states).flatten(2).transpose(1, 2)
        for block in self.blocks:
            x = block(x)
        return x


def tiny_configured_patch_model() -> ConfiguredPatchModel:
    return ConfiguredPatchModel(PatchConfig(layers=3))


def not_the_class() -> nn.Module:
    return nn.Linear(2, 2)


NOT_A_FUNCTION = 3
