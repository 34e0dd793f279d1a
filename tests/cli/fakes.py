"""Adapters for CLI tests: a toy with a library's own checkpointing switch, and one whose library is missing."""

from __future__ import annotations

import torch

from ac_core import AdapterSpec, ModelCase, ModelSpec
from ac_core.testing import LibraryCheckpointingToy


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
