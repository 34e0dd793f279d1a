"""Test helpers: :func:`make_case`, the recipe of every tiny and preset factory, and a toy transformer built
from a config in code, for tests, examples and the graph-pass figures.

They need nothing beyond torch, so they serve where no adapter's library is installed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ._context_parallel import ring_attention, shard_sequence, ulysses_attention
from .ops import DEFAULT_RETAINED_OPS
from .spec import AdapterSpec, AttentionBackend, ContextParallel, ModelCase, ModelSpec


def make_case(
    model: Callable[[], nn.Module],
    inputs: Callable[[], Mapping[str, Any]],
    loss: Callable[[Any], torch.Tensor],
    *,
    seed: int | None = 0,
) -> ModelCase:
    """A :class:`ModelCase` of ``model()`` in training mode, ``inputs()`` and ``loss``, with torch seeded first.

    The model is built before the inputs are drawn, so that ``seed`` fixes both and every call returns the
    same weights and inputs: a factory is then only its data, e.g. ``make_case(lambda: Model(layers=2),
    lambda: {"x": torch.randn(1, 8, 16)}, loss)``. ``seed=None`` leaves torch's generator as it is (the
    real-width presets, which are measured, not compared).
    """
    if seed is not None:
        torch.manual_seed(seed)
    built = model().train()
    return ModelCase(built, dict(inputs()), loss)


def _mean_square(output: torch.Tensor) -> torch.Tensor:
    return output.float().pow(2).mean()


# The context-parallel attentions a ToyBlock runs by name, each rank on its chunk of the sequence.
_CONTEXT_PARALLEL = {"ulysses": ulysses_attention, "ring": ring_attention}


class ToyBlock(nn.Module):
    """Pre-norm self-attention and MLP. ``attention="sdpa"`` reaches a fused kernel; ``"math"`` does not;
    ``"ulysses"`` and ``"ring"`` are context parallel (:func:`ulysses_attention`, :func:`ring_attention`: inside
    a process group, each rank given its chunk of the tokens)."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.0, attention: str = "sdpa") -> None:
        super().__init__()
        self.heads, self.attention = heads, attention
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.dropout = nn.Dropout(dropout)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.attention == "sdpa":
            return F.scaled_dot_product_attention(q, k, v)
        if self.attention in _CONTEXT_PARALLEL:
            return _CONTEXT_PARALLEL[self.attention](q, k, v)
        scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        return scores.softmax(dim=-1) @ v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = self._attend(q, k, v).transpose(1, 2).reshape(b, n, d)
        x = x + self.dropout(self.proj(attn))
        return x + self.dropout(self.mlp(self.norm2(x)))


class ToyTransformer(nn.Module):
    """An input projection, ``depth`` ToyBlocks in ``layers``, and an output head."""

    def __init__(
        self, dim: int = 64, heads: int = 4, depth: int = 4, dropout: float = 0.0, attention: str = "sdpa"
    ) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.layers = nn.ModuleList(ToyBlock(dim, heads, dropout, attention) for _ in range(depth))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class LibraryCheckpointingToy(ToyTransformer):
    """A ToyTransformer that checkpoints its own layers while ``gradient_checkpointing`` is on, switched by
    diffusers-style ``enable_/disable_gradient_checkpointing()`` (duck-typed: no diffusers needed)."""

    def __init__(
        self, dim: int = 64, heads: int = 4, depth: int = 4, dropout: float = 0.0, attention: str = "sdpa"
    ) -> None:
        super().__init__(dim, heads, depth, dropout, attention)
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


def toy_case(
    dim: int = 64,
    heads: int = 4,
    depth: int = 4,
    tokens: int = 32,
    batch: int = 2,
    dropout: float = 0.0,
    attention: str = "sdpa",
    seed: int = 0,
) -> ModelCase:
    """A seeded ToyTransformer with one batch of inputs and a mean-square loss."""
    return make_case(
        lambda: ToyTransformer(dim, heads, depth, dropout, attention),
        lambda: {"x": torch.randn(batch, tokens, dim)},
        _mean_square,
        seed=seed,
    )


def toy_wide(*, layers: int = 4, seq: int | None = None) -> ModelCase:
    """The ``toy-wide`` preset: ``layers`` ToyBlocks of width 1024 (16 heads) over ``seq`` tokens (1024), batch 1.

    Wide enough that matmuls and attention, not Python overhead, dominate a step on CPU.
    """
    return toy_case(dim=1024, heads=16, depth=layers, tokens=seq or 1024, batch=1)


def _set_attention(model: nn.Module, name: str) -> None:
    for block in model.modules():
        if isinstance(block, ToyBlock):
            block.attention = name


def _token_count(model: nn.Module, inputs) -> int:
    x = inputs["x"]
    return x.shape[0] * x.shape[1]


def shard_toy_inputs(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """This rank's chunk of a toy case's tokens (``x``: ``[batch, tokens, dim]``), for a context-parallel toy."""
    return {**inputs, "x": shard_sequence(inputs["x"], dim=1)}


TOY_CONTEXT_PARALLEL = ContextParallel(("ulysses", "ring"), enable=_set_attention, shard=shard_toy_inputs)
"""The toy's context parallelism: :func:`ulysses_attention` or :func:`ring_attention` in every ToyBlock, each rank
given its chunk of the tokens (:func:`shard_toy_inputs`)."""


TOY_ADAPTER = AdapterSpec(
    name="toy",
    models=(
        ModelSpec(
            cls=f"{ToyTransformer.__module__}.ToyTransformer",
            containers=("layers",),
            attention_calls={"ToyBlock": 1},
            tiny=toy_case,
            presets={"toy-wide": toy_wide},
        ),
    ),
    backends=(
        AttentionBackend("sdpa", ops=tuple(sorted(DEFAULT_RETAINED_OPS))),
        AttentionBackend("math", not_retainable="matmul and softmax in Python: no single op carries the output"),
    ),
    default_backend="sdpa",
    set_backend=_set_attention,
    token_count=_token_count,
    context_parallel=TOY_CONTEXT_PARALLEL,
)
"""A spec for ToyTransformer, not registered by default: ``register_adapter(TOY_ADAPTER)`` to use it by name."""

__all__ = [
    "TOY_ADAPTER",
    "TOY_CONTEXT_PARALLEL",
    "LibraryCheckpointingToy",
    "ToyBlock",
    "ToyTransformer",
    "make_case",
    "ring_attention",
    "shard_sequence",
    "shard_toy_inputs",
    "toy_case",
    "toy_wide",
    "ulysses_attention",
]
