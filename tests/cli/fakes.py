"""Adapters for CLI tests: a toy with a library's own checkpointing switch, one whose library is missing, and one
whose first forward is slow."""

from __future__ import annotations

import gc
import time

import torch

from ac_core import AdapterSpec, ModelCase, ModelSpec
from ac_core.testing import LibraryCheckpointingToy, ToyTransformer


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
