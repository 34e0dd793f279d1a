"""A zoo of small blocks and the stacks built from them, described by readable specs.

A falsifying example is printed as its specs, so each spec's repr reads as the model it builds:
``Stack(list[mlp(inplace), f_dropout(kwargs, returns=dict)], twice=0)``. Everything here is plain PyTorch: the tests
apply ac-core to it through the public API only, as a third party would.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

DIM = 8
SEQ = 4
BATCH = 2
HEADS = 2

# Block kinds. Those in RATED draw random numbers at a rate (Stack.set_rate) that steps change.
MLP = "mlp"
ATTENTION = "attention"  # SDPA without dropout
ATTENTION_DROPOUT = "attention_dropout"  # SDPA's dropout_p, read from an attribute as transformers does
DROPOUT = "dropout"  # an nn.Dropout module
F_DROPOUT = "f_dropout"  # F.dropout with the rate in a plain attribute: no module to recognise
DROP_PATH = "drop_path"  # stochastic depth drawn with torch.rand
BATCH_NORM = "batch_norm"  # BatchNorm1d: running stats are buffers a forward updates
NESTED = "nested"  # the block calls torch.utils.checkpoint itself, around an inner dropout
INPUT_INPLACE = "input_inplace"  # modifies its own input in place (torch cannot recompute that)
KINDS = (MLP, ATTENTION, ATTENTION_DROPOUT, DROPOUT, F_DROPOUT, DROP_PATH, BATCH_NORM, NESTED, INPUT_INPLACE)
RATED = frozenset({ATTENTION_DROPOUT, DROPOUT, F_DROPOUT, DROP_PATH, NESTED})
ATTENDING = frozenset({ATTENTION, ATTENTION_DROPOUT})

# How a block returns its result: a tensor, a tuple (hidden, aux) or a dict with a non-tensor entry.
RETURNS = ("tensor", "tuple", "dict")
# The block container; ac-core may not accept every one yet (see test_train_equal.supported_containers).
CONTAINERS = ("list", "sequential", "dict")


@dataclass(frozen=True)
class BlockSpec:
    """One block: its kind and options. ``kwargs``: called as ``block(x, scale=0.5, mask=...)``."""

    kind: str
    inplace: bool = False  # ``h.mul_(scale).relu_()`` on a non-leaf intermediate
    returns: str = "tensor"
    kwargs: bool = False
    frozen: bool = False  # every parameter requires_grad=False

    def __repr__(self) -> str:
        flags = [name for name in ("inplace", "kwargs", "frozen") if getattr(self, name)]
        if self.returns != "tensor":
            flags.append(f"returns={self.returns}")
        return f"{self.kind}({', '.join(flags)})" if flags else self.kind


@dataclass(frozen=True)
class StackSpec:
    """A model: an embedding, the blocks in a container, a head.

    ``shared``: the index of a block whose instance is listed again at the end of the container;
    ``twice``: the index of a block called twice in a row per forward. ``embed_frozen`` with inputs that
    need no grad makes the first block's input need none either.
    """

    blocks: tuple[BlockSpec, ...]
    container: str = "list"
    shared: int | None = None
    twice: int | None = None
    embed_frozen: bool = False
    dtype: torch.dtype = torch.float64

    def __repr__(self) -> str:
        parts = [f"{self.container}[{', '.join(map(repr, self.blocks))}]"]
        if self.shared is not None:
            parts.append(f"shared={self.shared}")
        if self.twice is not None:
            parts.append(f"twice={self.twice}")
        if self.embed_frozen:
            parts.append("embed_frozen")
        if self.dtype != torch.float64:
            parts.append(str(self.dtype).removeprefix("torch."))
        return f"Stack({', '.join(parts)})"

    @property
    def order(self) -> tuple[int, ...]:
        """Block index at each position of the container (the shared instance appears twice)."""
        return tuple(range(len(self.blocks))) + (() if self.shared is None else (self.shared,))

    def names(self) -> list[str]:
        """The container's child names, position by position."""
        return [f"b{i}" if self.container == "dict" else str(i) for i in range(len(self.order))]


class ZooBlock(nn.Module):
    """What every kind shares: an input projection (where ``inplace`` acts), the kind's body, a residual.

    Each kind is its own subclass, so a plan (profiled per block class) sees distinct classes.
    """

    rate_attr: str | None = None

    def __init__(self, spec: BlockSpec, dim: int) -> None:
        super().__init__()
        self.spec = spec
        self.inp = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def body(self, h: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def set_rate(self, rate: float) -> None:
        """Set the kind's random rate (a no-op for kinds that draw nothing)."""

    def forward(self, x: torch.Tensor, scale: float = 1.0, mask: torch.Tensor | None = None) -> Any:
        if self.spec.kind == INPUT_INPLACE:
            x.mul_(1.5)  # the block's own input, in place
        h = self.inp(x)
        # A Linear's output is not saved by its own backward, so the in-place ops are legal in plain eager.
        h = h.mul_(scale).relu_() if self.spec.inplace else F.relu(h * scale)
        h = self.out(self.body(h, mask))
        y = x + h
        aux = h.mean(dim=-1, keepdim=True)
        if self.spec.returns == "tuple":
            return y, aux
        if self.spec.returns == "dict":
            return {"hidden": y, "aux": aux, "calls": 1}
        return y


class MLPBlock(ZooBlock):
    def __init__(self, spec: BlockSpec, dim: int) -> None:
        super().__init__(spec, dim)
        self.fc = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(2 * dim, dim)

    def body(self, h: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(h)))


class InputInPlaceBlock(MLPBlock):
    pass


class AttentionBlock(ZooBlock):
    rate_attr = "attention_dropout"

    def __init__(self, spec: BlockSpec, dim: int) -> None:
        super().__init__(spec, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.attention_dropout = 0.0

    def body(self, h: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, s, d = h.shape
        q, k, v = (t.reshape(b, s, HEADS, d // HEADS).transpose(1, 2) for t in self.qkv(h).chunk(3, dim=-1))
        p = self.attention_dropout if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        return a.transpose(1, 2).reshape(b, s, d)

    def set_rate(self, rate: float) -> None:
        if self.spec.kind == ATTENTION_DROPOUT:
            self.attention_dropout = rate


class DropoutBlock(ZooBlock):
    def __init__(self, spec: BlockSpec, dim: int) -> None:
        super().__init__(spec, dim)
        self.fc = nn.Linear(dim, dim)
        self.drop = nn.Dropout(0.0)

    def body(self, h: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self.drop(self.fc(h))

    def set_rate(self, rate: float) -> None:
        self.drop.p = rate


class FunctionalDropoutBlock(ZooBlock):
    def __init__(self, spec: BlockSpec, dim: int) -> None:
        super().__init__(spec, dim)
        self.fc = nn.Linear(dim, dim)
        self.p = 0.0

    def body(self, h: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return F.dropout(self.fc(h), self.p, self.training)

    def set_rate(self, rate: float) -> None:
        self.p = rate


class DropPathBlock(ZooBlock):
    """timm's DropPath: with drop_prob 0 (or in eval) it draws nothing at all."""

    def __init__(self, spec: BlockSpec, dim: int) -> None:
        super().__init__(spec, dim)
        self.fc = nn.Linear(dim, dim)
        self.drop_prob = 0.0

    def body(self, h: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        f = self.fc(h)
        if self.drop_prob == 0.0 or not self.training:
            return f
        keep = 1.0 - self.drop_prob
        mask_ = (torch.rand(f.shape[0], 1, 1, dtype=f.dtype) < keep).to(f.dtype)
        return f * mask_ / keep

    def set_rate(self, rate: float) -> None:
        self.drop_prob = rate


class BatchNormBlock(ZooBlock):
    def __init__(self, spec: BlockSpec, dim: int) -> None:
        super().__init__(spec, dim)
        self.fc = nn.Linear(dim, dim)
        self.bn = nn.BatchNorm1d(dim)

    def body(self, h: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, s, d = h.shape
        return self.bn(self.fc(h).reshape(b * s, d)).reshape(b, s, d)


class NestedCheckpointBlock(ZooBlock):
    """A user's own non-reentrant checkpoint inside the block, around an inner dropout module."""

    def __init__(self, spec: BlockSpec, dim: int) -> None:
        super().__init__(spec, dim)
        self.inner = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Dropout(0.0), nn.Linear(2 * dim, dim))

    def body(self, h: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return checkpoint(self.inner, h, use_reentrant=False)

    def set_rate(self, rate: float) -> None:
        self.inner[2].p = rate


_CLASSES: dict[str, type[ZooBlock]] = {
    MLP: MLPBlock,
    ATTENTION: AttentionBlock,
    ATTENTION_DROPOUT: AttentionBlock,
    DROPOUT: DropoutBlock,
    F_DROPOUT: FunctionalDropoutBlock,
    DROP_PATH: DropPathBlock,
    BATCH_NORM: BatchNormBlock,
    NESTED: NestedCheckpointBlock,
    INPUT_INPLACE: InputInPlaceBlock,
}


def make_container(kind: str, names: Sequence[str], modules: Sequence[nn.Module]) -> nn.Module:
    """The one place a container type is chosen: ``list`` (nn.ModuleList), ``sequential``, ``dict``."""
    if kind == "list":
        return nn.ModuleList(modules)
    if kind == "sequential":
        return nn.Sequential(*modules)
    if kind == "dict":
        return nn.ModuleDict(dict(zip(names, modules, strict=True)))
    raise ValueError(f"unknown container kind {kind!r}; one of {CONTAINERS}")


def _positions(container: nn.Module) -> list[nn.Module]:
    # named_children() skips an instance listed twice; the forward runs every position.
    return [module for module in container._modules.values() if module is not None]


class Stack(nn.Module):
    """embed -> blocks (container ``layers``) -> head. The forward reads each block's spec for its calling
    convention and return type."""

    def __init__(self, spec: StackSpec, dim: int = DIM) -> None:
        super().__init__()
        self.spec = spec
        self.embed = nn.Linear(dim, dim)
        built = [_CLASSES[b.kind](b, dim) for b in spec.blocks]
        self.layers = make_container(spec.container, spec.names(), [built[i] for i in spec.order])
        self.head = nn.Linear(dim, dim)
        self.embed.requires_grad_(not spec.embed_frozen)
        for block, b in zip(built, spec.blocks, strict=True):
            if b.frozen:
                block.requires_grad_(False)
        self.to(spec.dtype)

    def blocks_in_order(self) -> list[tuple[str, nn.Module, int]]:
        """(FQN, module, block index) at each position of the container, the shared one twice."""
        return [
            (f"layers.{name}", module, index)
            for name, module, index in zip(self.spec.names(), _positions(self.layers), self.spec.order, strict=True)
        ]

    def set_rate(self, rate: float) -> None:
        for module in self.modules():
            if isinstance(module, ZooBlock):
                module.set_rate(rate)

    def _call(self, block: nn.Module, index: int, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        spec = self.spec.blocks[index]
        # Keyword and non-tensor arguments; the mask is a tensor argument that needs no grad.
        out = block(h, scale=0.5, mask=mask if spec.kind in ATTENDING else None) if spec.kwargs else block(h)
        if spec.returns == "tuple":
            y, aux = out
            return y + aux
        if spec.returns == "dict":
            assert out["calls"] == 1
            return out["hidden"] + out["aux"]
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        s = x.shape[-2]
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()  # a tensor argument needing no grad
        for _, block, index in self.blocks_in_order():
            h = self._call(block, index, h, mask)
            if index == self.spec.twice:
                h = self._call(block, index, h, mask)
        return self.head(h)


@dataclass
class HookCounter:
    """Counts forward calls per block path through forward hooks registered on the blocks themselves."""

    counts: dict[str, int] = field(default_factory=dict)
    handles: list[Any] = field(default_factory=list)

    def attach(self, model: Stack) -> HookCounter:
        seen: set[int] = set()
        for path, block, _ in model.blocks_in_order():
            if id(block) in seen:  # one hook per instance: a shared block counts under its first path
                continue
            seen.add(id(block))
            self.handles.append(block.register_forward_hook(self._hook(path)))
        return self

    def _hook(self, path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            self.counts[path] = self.counts.get(path, 0) + 1

        return hook

    def take(self) -> dict[str, int]:
        """The counts since the last take, and start again."""
        counts, self.counts = self.counts, {}
        return counts


def inputs(step: int, micro: int, dtype: torch.dtype, seq: int = SEQ) -> torch.Tensor:
    """A batch made from its own generator: making inputs never moves the global RNG."""
    generator = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(BATCH, seq, DIM, generator=generator, dtype=torch.float64).to(dtype)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.double().pow(2).mean() * math.sqrt(DIM)
