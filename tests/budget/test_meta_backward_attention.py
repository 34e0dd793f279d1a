"""A custom autograd Function that runs SDPA again in its backward (diffusers' context-parallel attention does, for
every backend): planned on ``meta``, that backward takes the fused CPU kernel as on real tensors, not the math
path's sequence-squared scores, so the predicted transient is the real one."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ac_core import StepBudget, predict_step
from ac_core.budget.profile import cpu_attention_on_meta_in_backward

TOKENS, HEADS, HEAD_DIM = 512, 2, 16


class _AttentionAgainInBackward(torch.autograd.Function):
    """SDPA without a graph in forward; in backward, SDPA again under grad and its gradients: as diffusers'
    ``_native_attention_backward_op``."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(q, k, v)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            return torch.autograd.grad(out, (q, k, v), grads[0])


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(HEADS * HEAD_DIM, 3 * HEADS * HEAD_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(1, TOKENS, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        out = _AttentionAgainInBackward.apply(q.contiguous(), k.contiguous(), v.contiguous())
        return x + out.transpose(1, 2).reshape(1, TOKENS, HEADS * HEAD_DIM)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[0](x)


def _transient(device: str) -> int:
    torch.manual_seed(0)
    with torch.device(device):
        model, x = _Model(), torch.randn(1, TOKENS, HEADS * HEAD_DIM)
    return predict_step(model, {"x": x}, "full", StepBudget("1GiB", device="cpu"), blocks=["layers"]).transient


def test_a_meta_plan_predicts_the_backward_of_the_real_kernel():
    real = _transient("cpu")
    # The math path's scores alone, per head: 512 x 512 float32 = 1 MiB; the fused kernel makes none of them.
    assert real < HEADS * TOKENS * TOKENS * 4
    assert _transient("meta") == real


def test_the_name_is_bound_back_on_leaving_and_on_error():
    bound = torch.nn.functional.scaled_dot_product_attention
    try:
        with cpu_attention_on_meta_in_backward():
            assert torch.nn.functional.scaled_dot_product_attention is not bound
            raise RuntimeError("in the block")
    except RuntimeError:
        pass
    assert torch.nn.functional.scaled_dot_product_attention is bound
