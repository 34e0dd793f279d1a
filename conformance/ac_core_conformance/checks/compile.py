"""Check 6: torch.compile of a checkpointed model gives the eager loss and gradients."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from ac_core import PolicyConfig, apply_activation_checkpointing

from ..base import COMPILE_BACKEND_OPTION, AdapterTests
from ..policies import Policy, as_policy, label
from ..subjects import Subject
from ..training import (
    EAGER_TOLERANCE,
    INDUCTOR_TOLERANCE,
    Step,
    Tolerance,
    assert_same_step,
    build,
    fresh_compile,
    plain_step,
)
from ..training import step as train_step

COMPILE_BACKEND_ENV = "AC_CORE_COMPILE_BACKEND"
"""Environment variable naming the torch.compile backend of check 6 when no option or attribute does."""

DEFAULT_COMPILE_BACKEND = "aot_eager"
"""aot_eager traces forward and backward through AOTAutograd, as inductor does, in seconds instead of a minute."""


def compile_backend(choice: str | None = None) -> str:
    """``choice``, else ``$AC_CORE_COMPILE_BACKEND``, else ``aot_eager``."""
    return choice or os.environ.get(COMPILE_BACKEND_ENV) or DEFAULT_COMPILE_BACKEND


def compile_tolerance(backend: str) -> Tolerance:
    """Eager tolerance for graph-capturing backends that run the same kernels; inductor's for the rest."""
    return EAGER_TOLERANCE if backend in ("eager", "aot_eager") else INDUCTOR_TOLERANCE


def _compiled(model: nn.Module, backend: str) -> nn.Module:
    # torch.compile of a module returns an OptimizedModule, a module; its annotation says only "callable".
    compiled = torch.compile(model, backend=backend)
    assert isinstance(compiled, nn.Module)
    return compiled


def _graphs_compiled() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def check_compile(subject: Subject, policy: Policy, device: str = "cpu", *, backend: str | None = None) -> Step:
    """``torch.compile(model)`` with ``policy`` applied trains like the plain eager model.

    Tolerance: the eager one for ``aot_eager``, :data:`INDUCTOR_TOLERANCE` for inductor.
    """
    name = compile_backend(backend)
    config = as_policy(policy)
    if subject.model.compile_unsupported:
        _check_declared_unsupported(subject, device, name)
    expected = plain_step(subject, device)
    case = build(subject, device)
    apply_activation_checkpointing(case.model, config, adapter=subject.adapter)
    with fresh_compile():
        graphs = _graphs_compiled()
        case.model = _compiled(case.model, name)
        got = train_step(case)
        graphs = _graphs_compiled() - graphs
    what = f"{subject.id} under {label(config)} on {device}, torch.compile(backend={name!r}) vs plain eager"
    assert graphs > 0, f"{what}: dynamo compiled no graph (it fell back to eager)"
    assert_same_step(got, expected, compile_tolerance(name), what)
    return got


def _check_declared_unsupported(subject: Subject, device: str, backend: str) -> None:
    """Hold the adapter to its claim that torch.compile cannot train the plain model, then skip ours."""
    reason = subject.model.compile_unsupported
    case = build(subject, device)
    with fresh_compile():
        case.model = _compiled(case.model, backend)
        try:
            train_step(case)
        except Exception:
            pytest.skip(f"{subject.id}: torch.compile cannot train the plain model (declared: {reason})")
    raise AssertionError(
        f"{subject.id} declares compile_unsupported ({reason}), but torch.compile(backend={backend!r}) trains the "
        "plain model: drop the declaration so that check 6 runs"
    )


class CompileTests(AdapterTests):
    """Check 6: torch.compile of the checkpointed model trains like eager."""

    compile_backend: str | None = None
    """torch.compile backend; None: ``--ac-core-compile-backend``, ``$AC_CORE_COMPILE_BACKEND``, else ``aot_eager``."""

    def test_compile(self, subject: Subject, policy: PolicyConfig, device: str, request: pytest.FixtureRequest) -> None:
        backend = compile_backend(self.compile_backend or request.config.getoption(COMPILE_BACKEND_OPTION, None))
        check_compile(subject, policy, device, backend=backend)


__all__ = [
    "COMPILE_BACKEND_ENV",
    "DEFAULT_COMPILE_BACKEND",
    "CompileTests",
    "check_compile",
    "compile_backend",
    "compile_tolerance",
]
