"""Adapters for CLI tests: a toy with a library's own checkpointing switch, and one whose library is missing."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ac_core import AdapterSpec, ModelCase, ModelSpec
from ac_core.testing import ToyTransformer


class LibraryToy(ToyTransformer):
    """A ToyTransformer with diffusers-style ``enable_gradient_checkpointing()`` (duck-typed, no diffusers)."""

    def __init__(self) -> None:
        super().__init__()
        self.gradient_checkpointing = False

    def enable_gradient_checkpointing(self) -> None:
        self.gradient_checkpointing = True

    def disable_gradient_checkpointing(self) -> None:
        self.gradient_checkpointing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x = checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        return self.head(x)


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
