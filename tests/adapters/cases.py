"""The served model classes as pytest parameters, and measurements the adapter tests share."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Iterator

import pytest
import torch
from torch import nn

from ac_core import AdapterSpec, ModelCase, ModelSpec, get_adapter, resolve_blocks
from ac_core.measure import OpCounter

ADAPTERS = ("wan", "hunyuan", "flux", "llama")


def case_id(spec: AdapterSpec, model_spec: ModelSpec) -> str:
    assert model_spec.tiny_name is not None
    return f"{spec.name}-{model_spec.tiny_name.removeprefix('tiny_')}"


def _skip_without(spec: AdapterSpec) -> pytest.MarkDecorator:
    missing = importlib.util.find_spec(spec.library) is None
    return pytest.mark.skipif(missing, reason=f"{spec.library} is not installed ({spec.install_hint})")


def served(adapters: Iterable[str] = ADAPTERS) -> Iterator:
    """One pytest param (adapter spec, model spec) per served class and variant, skipped without its library."""
    for name in adapters:
        spec = get_adapter(name)
        for model_spec in spec.models:
            yield pytest.param(spec, model_spec, id=case_id(spec, model_spec), marks=_skip_without(spec))


def blocks(case: ModelCase, model_spec: ModelSpec) -> list[tuple[str, nn.Module]]:
    """(FQN, block) of every block in the model spec's containers."""
    return [(block.path, block.module) for block in resolve_blocks(case.model, blocks=model_spec.containers)]


def per_call_ops(case: ModelCase, model_spec: ModelSpec, ops: Iterable[str]) -> dict[str, list[int]]:
    """Block FQN -> calls of ``ops`` in each forward call of that block, over one forward of ``case``."""
    wanted = frozenset(ops)
    named = blocks(case, model_spec)
    calls: dict[str, list[int]] = {fqn: [] for fqn, _ in named}
    started: list[int] = []
    with OpCounter() as counter:
        handles = []
        for fqn, block in named:
            handles.append(block.register_forward_pre_hook(lambda *_: started.append(counter.count(wanted))))
            handles.append(
                block.register_forward_hook(
                    lambda *_, fqn=fqn: calls[fqn].append(counter.count(wanted) - started.pop())
                )
            )
        try:
            case.run()
        finally:
            for handle in handles:
                handle.remove()
    return calls


def loss_and_grads(case: ModelCase) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    """Loss and every parameter's gradient (None where the loss does not reach a parameter)."""
    loss = case.run()
    loss.backward()
    grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in case.model.named_parameters()}
    return loss.detach(), grads


def assert_same_training(got: tuple, expected: tuple) -> None:
    """Loss and every gradient bitwise equal: recompute replays the same float32 kernels in the same order."""
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    assert got[1].keys() == expected[1].keys()
    for name, grad in expected[1].items():
        if grad is None:
            assert got[1][name] is None, name
        else:
            torch.testing.assert_close(got[1][name], grad, rtol=0, atol=0, msg=f"gradient of {name}")
