"""Building a subject's tiny model on a device, one training step, and comparing two steps within a stated tolerance."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from ac_core import ModelCase

from .subjects import Subject

SEED = 0
"""Seed set before a tiny factory runs, so that every build of a subject has the same weights and inputs."""

STEP_SEED = 1234
"""Seed set before a training step, so that dropout draws the same masks in the runs being compared."""


@dataclass(frozen=True)
class Tolerance:
    """``|actual - expected| <= atol + rtol * |expected|``, elementwise (torch.testing.assert_close)."""

    rtol: float
    atol: float


EAGER_TOLERANCE = Tolerance(rtol=1e-5, atol=1e-6)
"""Checkpointed vs plain, float32. CPU recompute is bit-exact; CUDA attention backward kernels may reorder sums."""

INDUCTOR_TOLERANCE = Tolerance(rtol=1e-4, atol=1e-5)
"""Inductor-compiled vs eager, float32: inductor fuses and reorders reductions."""


@dataclass
class Step:
    """The loss and every parameter gradient of one training step (``None`` gradients left out)."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor]


def require_device(device: str) -> None:
    """Skip when ``device`` is not present here."""
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device here")


def require_tiny(subject: Subject) -> None:
    """Skip a subject whose adapter declares no tiny factory for it."""
    if subject.model.tiny is None:
        pytest.skip(f"adapter {subject.adapter.name!r} declares no tiny factory for {subject.model.class_name}")


def switch_backend(subject: Subject, model: nn.Module, backend: str) -> None:
    """Run ``model`` on the declared attention ``backend``: through ``set_backend``, or as built for the default."""
    declared = subject.adapter.backend(backend)  # raises for an undeclared name
    if subject.adapter.set_backend is not None:
        subject.adapter.set_backend(model, declared.name)
    elif declared.name != subject.adapter.default_backend:
        pytest.skip(
            f"adapter {subject.adapter.name!r} declares no set_backend, so backend {declared.name!r} cannot be "
            f"selected (its tiny models run the default, {subject.adapter.default_backend!r})"
        )


def build(subject: Subject, device: str = "cpu", *, backend: str | None = None) -> ModelCase:
    """The subject's tiny model (seeded, float32, train mode) with its inputs, on ``device`` and ``backend``."""
    require_device(device)
    require_tiny(subject)
    torch.manual_seed(SEED)
    case = subject.model.build_tiny()
    if not isinstance(case, ModelCase):
        raise AssertionError(
            f"{subject.id}: the tiny factory returned a {type(case).__name__}, not an ac_core.ModelCase"
        )
    # matches(), not adapter.model_spec(): an adapter may declare one class twice (two tiny variants).
    if not subject.model.matches(type(case.model)):
        raise AssertionError(
            f"{subject.id}: the tiny factory builds a {type(case.model).__name__}, which the ModelSpec for "
            f"{subject.model.cls} does not serve"
        )
    # Cast only parameters that are not float32 already: diffusers warns on every dtype cast through .to(),
    # and some models keep float64 buffers (rotary tables) on purpose.
    cast = any(p.is_floating_point() and p.dtype != torch.float32 for p in case.model.parameters())
    case.to(device, torch.float32 if cast else None)
    case.model.train()
    if backend is not None:
        switch_backend(subject, case.model, backend)
    return case


def step(case: ModelCase) -> Step:
    """Forward, loss and backward under the step seed; gradient names without torch.compile's prefix."""
    torch.manual_seed(STEP_SEED)
    loss = case.run()
    loss.backward()
    grads = {
        name.replace("_orig_mod.", ""): p.grad.detach().clone()
        for name, p in case.model.named_parameters()
        if p.grad is not None
    }
    return Step(loss.detach(), grads)


def assert_same_step(actual: Step, expected: Step, tolerance: Tolerance, what: str) -> None:
    """Fail, naming the worst parameters, unless loss and every gradient agree within ``tolerance``."""
    # A parameter no loss path reaches has no gradient in eager and a zero one from a compiled backward:
    # the same fact. Any other gradient on one side only is a difference.
    one_sided = actual.grads.keys() ^ expected.grads.keys()
    nonzero = sorted(n for n in one_sided if (actual.grads[n] if n in actual.grads else expected.grads[n]).any())
    if nonzero:
        missing = [n for n in nonzero if n not in actual.grads]
        extra = [n for n in nonzero if n not in expected.grads]
        raise AssertionError(f"{what}: parameters with gradients differ; missing {missing[:5]}, extra {extra[:5]}")
    try:
        torch.testing.assert_close(actual.loss, expected.loss, rtol=tolerance.rtol, atol=tolerance.atol)
    except AssertionError as exc:
        raise AssertionError(f"{what}: loss {actual.loss.item()!r} != {expected.loss.item()!r}\n{exc}") from None
    bad: list[tuple[float, str]] = []
    shared = expected.grads.keys() & actual.grads.keys()
    for name, grad in expected.grads.items():
        if name not in shared:
            continue
        got = actual.grads[name]
        if got.shape != grad.shape or not torch.allclose(got, grad, rtol=tolerance.rtol, atol=tolerance.atol):
            diff = (got.float() - grad.float()).abs().max().item() if got.shape == grad.shape else float("inf")
            bad.append((diff, name))
    if bad:
        worst = ", ".join(f"{name} (max |diff| {diff:.3g})" for diff, name in sorted(bad, reverse=True)[:5])
        raise AssertionError(
            f"{what}: {len(bad)} of {len(expected.grads)} gradients differ beyond rtol={tolerance.rtol}, "
            f"atol={tolerance.atol}: {worst}"
        )


_DROPOUT_ATTRS = ("attention_dropout", "dropout_p")


def enable_dropout(model: nn.Module, p: float = 0.1) -> int:
    """Set dropout probability ``p`` on every dropout module and attention-dropout float; returns how many."""
    changed = 0
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = p
            changed += 1
        for attr in _DROPOUT_ATTRS:
            if isinstance(getattr(module, attr, None), float):
                setattr(module, attr, p)
                changed += 1
    return changed


# Values keep their adapter alive, so that its id() in the key cannot be reused by another spec.
_references: dict[tuple, tuple[object, Step]] = {}


def plain_step(subject: Subject, device: str, *, backend: str | None = None, dropout: float = 0.0) -> Step:
    """One step of the plain (never checkpointed) model, cached per process: the reference every check compares to."""
    key = (id(subject.adapter), id(subject.model), device, backend, dropout)
    if key not in _references:
        case = build(subject, device, backend=backend)
        if dropout:
            enable_dropout(case.model, dropout)
        _references[key] = (subject.adapter, step(case))
    return _references[key][1]


def tensors_of(output: Any) -> list[torch.Tensor]:
    """The tensors in a model output: a tensor, a tuple/list, a mapping, or a diffusers/transformers output."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, Mapping):
        return [t for value in output.values() for t in tensors_of(value)]
    if isinstance(output, (list, tuple)):
        return [t for value in output for t in tensors_of(value)]
    to_tuple = getattr(output, "to_tuple", None)
    return tensors_of(to_tuple()) if callable(to_tuple) else []


@contextmanager
def fresh_compile() -> Iterator[None]:
    """Dynamo caches cleared before and after, so earlier tests' graphs neither serve nor exhaust the cache."""
    torch._dynamo.reset()
    try:
        yield
    finally:
        torch._dynamo.reset()


__all__ = [
    "EAGER_TOLERANCE",
    "INDUCTOR_TOLERANCE",
    "SEED",
    "STEP_SEED",
    "Step",
    "Tolerance",
    "assert_same_step",
    "build",
    "enable_dropout",
    "fresh_compile",
    "plain_step",
    "require_device",
    "require_tiny",
    "step",
    "switch_backend",
    "tensors_of",
]
