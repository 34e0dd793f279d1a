"""Small models whose forwards have effects (BatchNorm statistics, dropout, in-place changes, hooks), and the
snapshot of everything planning must leave as it was."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DIM = 16


class NoisyBlock(nn.Module):
    """Linear, BatchNorm in train mode and F.dropout with p in a plain attribute: draws numbers, updates buffers."""

    def __init__(self, p: float = 0.25) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.norm = nn.BatchNorm1d(DIM)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.dropout(self.norm(self.linear(x)), self.p, self.training)


class InPlaceBlock(NoisyBlock):
    """Halves its input in place first: legal in the plain model, not recomputable from that input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(0.5)
        return super().forward(x)


class FailingBlock(NoisyBlock):
    """Raises after its NoisyBlock forward has drawn numbers and updated its statistics."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        super().forward(x)
        raise RuntimeError("boom")


class Noisy(nn.Module):
    """An input projection and three blocks (``kinds`` of them), around which the forward clamps its input in
    place, replaces a buffer counting its calls and moves a parameter under no_grad."""

    def __init__(self, kinds: tuple[type[nn.Module], ...] = (NoisyBlock, NoisyBlock, NoisyBlock)) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList(kind() for kind in kinds)
        self.drift = nn.Parameter(torch.zeros(DIM), requires_grad=False)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.clamp_(-1.0, 1.0)
        self.calls = self.calls + 1
        with torch.no_grad():
            self.drift.add_(0.125)
        x = self.embed(x) + self.drift
        for layer in self.layers:
            x = layer(x)
        return x


def snapshot(model: nn.Module, x: torch.Tensor) -> dict[str, object]:
    state: dict[str, object] = {f"param {n}": p.detach().clone() for n, p in model.named_parameters()}
    state |= {f"buffer {n}": b.clone() for n, b in model.named_buffers()}
    state |= {f"training {n}": m.training for n, m in model.named_modules()}
    state["rng cpu"] = torch.get_rng_state()
    if torch.cuda.is_available():
        state |= {f"rng cuda:{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())}
    state["input"] = x.clone()
    return state


def assert_unchanged(before: dict[str, object], model: nn.Module, x: torch.Tensor) -> None:
    after = snapshot(model, x)
    assert after.keys() == before.keys()
    for key, value in before.items():
        same = torch.equal(value, after[key]) if isinstance(value, torch.Tensor) else value == after[key]
        assert same, key


class Counts:
    """Forward hooks and pre-hooks of user code, counting their calls: on a block, its submodule, the root, global."""

    def __init__(self, model: nn.Module) -> None:
        self.calls: dict[str, int] = {"block": 0, "inner": 0, "root": 0, "root pre": 0, "global": 0}
        self.handles = [
            model.layers[0].register_forward_hook(lambda *_: self._count("block")),
            model.layers[0].linear.register_forward_hook(lambda *_: self._count("inner")),
            model.register_forward_hook(lambda *_: self._count("root")),
            model.register_forward_pre_hook(lambda *_: self._count("root pre")),
            nn.modules.module.register_module_forward_hook(lambda *_: self._count("global")),
        ]

    def _count(self, name: str) -> None:
        self.calls[name] += 1

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
