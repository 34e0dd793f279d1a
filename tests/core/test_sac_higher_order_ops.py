"""Higher-order ops under ``ops``: ac-core's selective-checkpoint modes take those torch's own modes take
(``flex_attention``: kept in forward, not rerun in backward) and refuse the others, naming the fix.

flex attention has no backward on CPU, so its inputs here need no gradient; the gradient reaches the block's
weight through the projection after it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.attention.flex_attention import flex_attention
from torch.utils._python_dispatch import TorchDispatchMode

from ac_core import Ops, apply_activation_checkpointing, observe_retention


class _HigherOrderCount(TorchDispatchMode):
    """Calls by phase of every op that runs, higher-order ops included (OpCounter refuses those)."""

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # flex_attention runs through torch.compile even in eager, which refuses any other mode.
        return True

    def __init__(self) -> None:
        super().__init__()
        self.forward: Counter[str] = Counter()
        self.backward: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        phase = self.backward if torch._C._current_graph_task_id() != -1 else self.forward
        phase[func.name()] += 1
        return func(*args, **(kwargs or {}))


class _FlexBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = k = v = x.detach().unflatten(-1, (2, 4)).transpose(1, 2)  # (batch, heads, tokens, head_dim)
        return x + self.proj(flex_attention(q, k, v).transpose(1, 2).flatten(2))


class _CondBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return torch.cond(h.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (h,))


class _Model(nn.Module):
    def __init__(self, block: type[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList([block(), block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model(x).pow(2).mean().backward()
    return [p.grad for p in model.parameters() if p.grad is not None]


def test_ops_keeps_flex_attention_and_does_not_rerun_it():
    torch.manual_seed(0)
    model, x = _Model(_FlexBlock), torch.randn(1, 16, 8)
    plain = _grads(model, x)
    model.zero_grad(set_to_none=True)
    apply_activation_checkpointing(model, Ops(retain=frozenset({"flex_attention"})), blocks=["layers"])
    with observe_retention() as kept, _HigherOrderCount() as ran:
        got = _grads(model, x)
    assert (ran.forward["flex_attention"], ran.backward["flex_attention"]) == (2, 0)
    assert {(out.block, out.op) for out in kept.outputs} == {
        ("layers.0", "flex_attention"),
        ("layers.1", "flex_attention"),
    }
    assert len(got) == len(plain) == 4
    for a, b in zip(got, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_flex_attention_reruns_where_ops_does_not_keep_it():
    torch.manual_seed(0)
    model, x = _Model(_FlexBlock), torch.randn(1, 16, 8)
    apply_activation_checkpointing(model, Ops(), blocks=["layers"])
    with _HigherOrderCount() as ran:
        _grads(model, x)
    assert (ran.forward["flex_attention"], ran.backward["flex_attention"]) == (2, 2)


def test_a_higher_order_op_torch_keeps_no_rule_for_is_refused_naming_the_fix():
    model = _Model(_CondBlock)
    apply_activation_checkpointing(model, Ops(), blocks=["layers"])
    with pytest.raises(NotImplementedError, match=r"no rule for the higher-order op 'cond'.*with Full\(\)"):
        model(torch.randn(2, 8)).sum().backward()
