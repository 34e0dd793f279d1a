"""Toy models and deliberately wrong adapter specs: each false declaration must make one check fail."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from ac_core import AdapterSpec, AttentionBackend, ExcludedContainer, ModelCase, ModelSpec
from ac_core.testing import TOY_ADAPTER, LibraryCheckpointingToy, ToyBlock, ToyTransformer, toy_case
from ac_core_conformance import Subject

DIM, HEADS = 32, 2
TOY_MODEL = TOY_ADAPTER.models[0]


class ToyWithRefiner(ToyTransformer):
    """A toy whose ``refiner`` ModuleList of ToyBlocks runs before ``layers``, as HunyuanVideo's token refiner."""

    def __init__(self, refiner: type[nn.Module] = ToyBlock) -> None:
        super().__init__(DIM, HEADS, depth=3)
        self.refiner = nn.ModuleList(refiner(DIM, HEADS) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in [*self.refiner, *self.layers]:
            x = block(x)
        return self.head(x)


class AttentionOnly(nn.Module):
    """No block class anyone declares, but it runs attention: only the dynamic cross-check can find it."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.qkv = heads, nn.Linear(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return x + F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)


class Mlp(nn.Module):
    """No attention; listed as a block class only in the model's own ``_no_split_modules``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x).relu()


class ToyWithAttentionList(ToyWithRefiner):
    def __init__(self) -> None:
        super().__init__(AttentionOnly)


class ToyWithMlpList(ToyWithRefiner):
    _no_split_modules = ["ToyBlock", "Mlp"]

    def __init__(self) -> None:
        super().__init__(Mlp)


class ToyWithLibraryCheckpointing(LibraryCheckpointingToy):
    """A toy with diffusers' checkpointing methods: its forward checkpoints each layer itself when enabled."""

    def __init__(self) -> None:
        super().__init__(DIM, HEADS, depth=3)


def _factory(cls: type[nn.Module]):
    def tiny() -> ModelCase:
        model = cls()
        return ModelCase(model, {"x": torch.randn(2, 16, DIM)}, lambda out: out.pow(2).mean())

    return tiny


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def spec(cls: type[nn.Module], **model_fields) -> AdapterSpec:
    """The toy adapter, serving ``cls`` with ``layers`` declared, changed by ``model_fields``."""
    fields = {"containers": ("layers",), "attention_calls": {"ToyBlock": 1}, **model_fields}
    model = ModelSpec(cls=_class_path(cls), tiny=_factory(cls), **fields)
    return replace(TOY_ADAPTER, name=f"broken-{cls.__name__}", models=(model,))


def subject(adapter: AdapterSpec) -> Subject:
    return Subject(adapter, adapter.models[0], adapter)


def toy_adapter(name: str = "broken", *, backends=None, default_backend="sdpa", **model_fields) -> AdapterSpec:
    """TOY_ADAPTER with its model spec or backends replaced."""
    model = replace(TOY_MODEL, **model_fields)
    return replace(
        TOY_ADAPTER,
        name=name,
        models=(model,),
        backends=TOY_ADAPTER.backends if backends is None else backends,
        default_backend=default_backend,
    )


# Module-level, so that `--ac-core-adapter tests.conformance.broken:WRONG_CALLS` can name it.
WRONG_CALLS = toy_adapter("wrong-calls", attention_calls={"ToyBlock": 2})
REFINER_EXCLUDED = spec(ToyWithRefiner, excluded=(ExcludedContainer("refiner", "two blocks over few tokens"),))
MATH_CLAIMED_RETAINABLE = toy_adapter(
    "math-claimed-retainable",
    backends=(AttentionBackend("math", ops=("aten::_scaled_dot_product_flash_attention_for_cpu",)),),
    default_backend="math",
    tiny=lambda: toy_case(attention="math"),
)
SDPA_CLAIMED_NOT_RETAINABLE = toy_adapter(
    "sdpa-claimed-not-retainable",
    backends=(AttentionBackend("sdpa", not_retainable="(false) decomposes"),),
)

# Module-level, so that `--ac-core-adapter tests.conformance.broken:OLD_LIBRARY` can name it.
OLD_LIBRARY = toy_adapter("old-library", versions="torch<2.0")
