"""Shared assertions for the core tests."""

from __future__ import annotations

import torch
from torch import nn

from ac_core import ModelCase


def loss_and_grads(case: ModelCase) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = case.run()
    loss.backward()
    # Parameters a model leaves unused (HunyuanVideo 1.5's last text stream) have no gradient.
    grads = {
        name.replace("_orig_mod.", ""): p.grad.detach().clone()
        for name, p in case.model.named_parameters()
        if p.grad is not None
    }
    return loss.detach(), grads


def assert_same_training(a: tuple, b: tuple, atol: float = 0.0) -> None:
    loss_a, grads_a = a
    loss_b, grads_b = b
    torch.testing.assert_close(loss_a, loss_b, rtol=0, atol=atol)
    # A parameter no loss path reaches has no gradient in eager, and a zero one from a compiled backward.
    for name in grads_a.keys() ^ grads_b.keys():
        only = grads_a.get(name, grads_b.get(name))
        assert not only.any(), f"{name} has a gradient on one side only"
    for name in grads_a.keys() & grads_b.keys():
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=0, atol=atol, msg=f"gradient of {name}")


def structure(model: nn.Module) -> tuple:
    """Names, state_dict keys and instance-level forwards: what applying must leave alone or restore."""
    return (
        [n for n, _ in model.named_modules()],
        [n for n, _ in model.named_parameters()],
        list(model.state_dict().keys()),
        [n for n, m in model.named_modules() if "forward" in m.__dict__],
    )
