"""Check 2: a checkpointed model trains exactly like the plain one, with dropout active too."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from ac_core import PolicyConfig, apply_activation_checkpointing

from ..base import AdapterTests
from ..policies import Policy, as_policy, label
from ..subjects import Subject
from ..training import EAGER_TOLERANCE, STEP_SEED, Step, Tolerance, assert_same_step, build, enable_dropout, plain_step
from ..training import step as train_step

DROPOUT_P = 0.1
"""Dropout probability the dropout variant sets on every dropout module and attention-dropout float."""


def check_gradients(
    subject: Subject, policy: Policy, device: str = "cpu", *, tolerance: Tolerance = EAGER_TOLERANCE
) -> Step:
    """Fail unless loss and every parameter gradient under ``policy`` equal the plain model's within ``tolerance``."""
    config = as_policy(policy)
    expected = plain_step(subject, device)
    case = build(subject, device)
    apply_activation_checkpointing(case.model, config, adapter=subject.adapter)
    got = train_step(case)
    assert_same_step(
        got,
        expected,
        tolerance,
        f"{subject.id} under {label(config)} on {device} vs plain (if two plain builds differ too, the tiny factory is "
        "not deterministic)",
    )
    return got


def _dropout_is_live(subject: Subject, device: str) -> bool:
    case = build(subject, device)
    if enable_dropout(case.model, DROPOUT_P) == 0:
        return False
    losses = []
    with torch.no_grad():
        for seed in (STEP_SEED, STEP_SEED + 1):
            torch.manual_seed(seed)
            losses.append(case.run())
    return not torch.equal(losses[0], losses[1])


def check_gradients_with_dropout(
    subject: Subject, policy: Policy, device: str = "cpu", *, tolerance: Tolerance = EAGER_TOLERANCE
) -> Step:
    """As :func:`check_gradients`, with dropout ``p=0.1`` switched on in train mode and the same seed.

    Recompute must replay the forward's dropout masks. Skips a model with no dropout to switch on.
    """
    build(subject, device)  # skips first where the device or tiny factory is missing
    if not _dropout_is_live(subject, device):
        pytest.skip(f"{subject.model.class_name} has no dropout module or attention-dropout float that acts")
    config = as_policy(policy)
    expected = plain_step(subject, device, dropout=DROPOUT_P)
    case = build(subject, device)
    enable_dropout(case.model, DROPOUT_P)
    apply_activation_checkpointing(case.model, config, adapter=subject.adapter)
    got = train_step(case)
    assert_same_step(got, expected, tolerance, f"{subject.id} under {label(config)} on {device} with dropout vs plain")
    return got


RANDOM_DROP = 0.25
"""Share of features the random-op hooks zero: randomness drawn with ``torch.rand``, no dropout module."""

RATE_SCHEDULES: dict[str, tuple[float, float]] = {
    "steady": (RANDOM_DROP, RANDOM_DROP),
    "warm-up from 0": (0.0, RANDOM_DROP),
    "down to 0": (RANDOM_DROP, 0.0),
}
"""The drop rate of the random-op hooks at the first and the second step. A rate warmed up from 0 draws no
random number at first: recompute must replay the RNG state of every call all the same."""


class RandomRate:
    """The drop rate the hooks of :func:`add_random_ops` read at each call; change ``p`` between steps."""

    def __init__(self, p: float = RANDOM_DROP) -> None:
        self.p = p

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        # Randomness ac-core cannot recognise by type: no nn.Dropout, no dropout float, only torch.rand, and
        # (as timm's stochastic depth at rate 0) no draw at all while the rate is 0.
        if not isinstance(output, torch.Tensor) or not torch.is_grad_enabled() or self.p == 0:
            return output
        keep = torch.rand(output.shape[-1], device=output.device) >= self.p
        return output * keep.to(output.dtype) / (1 - self.p)


def add_random_ops(subject: Subject, model: nn.Module, rate: RandomRate | None = None) -> int:
    """Hook each block's first Linear to drop features drawn with ``torch.rand`` at ``rate`` (default
    :data:`RANDOM_DROP`); returns how many were hooked.

    The hooks run inside the blocks, so recompute runs them again: only replaying the forward's RNG state
    gives the same masks.
    """
    hook = rate if rate is not None else RandomRate()
    hooked = 0
    for block in subject.blocks(model):
        linear = next((m for m in block.module.modules() if isinstance(m, nn.Linear)), None)
        if linear is not None:
            linear.register_forward_hook(hook)
            hooked += 1
    return hooked


def check_gradients_with_random_ops(
    subject: Subject, policy: Policy, device: str = "cpu", *, tolerance: Tolerance = EAGER_TOLERANCE
) -> Step:
    """As :func:`check_gradients`, with randomness inside every block that no dropout module carries.

    Stochastic depth drawn with ``torch.rand`` or ``F.dropout`` with p in a plain attribute look like
    this: gradients must still equal the plain model's, so recompute must replay the RNG state, at each of two
    steps whose rates follow every :data:`RATE_SCHEDULES` entry (0 at the first step and then not, too).
    """
    config = as_policy(policy)
    got: Step | None = None
    for schedule, rates in RATE_SCHEDULES.items():
        plain, case = build(subject, device), build(subject, device)
        plain_rate, case_rate = RandomRate(), RandomRate()
        if add_random_ops(subject, plain.model, plain_rate) == 0:
            pytest.skip(f"{subject.model.class_name}'s blocks have no nn.Linear to draw random masks after")
        add_random_ops(subject, case.model, case_rate)
        apply_activation_checkpointing(case.model, config, adapter=subject.adapter)
        for attempt, p in zip(("first", "second"), rates, strict=True):
            plain_rate.p = case_rate.p = p
            plain.model.zero_grad(set_to_none=True)
            case.model.zero_grad(set_to_none=True)
            expected = train_step(plain)
            got = train_step(case)
            what = (
                f"{subject.id} under {label(config)} on {device} with torch.rand masks in every block "
                f"({schedule}: rate {p} at the {attempt} step)"
            )
            assert_same_step(got, expected, tolerance, what)
    assert got is not None
    return got


class GradientTests(AdapterTests):
    """Check 2: loss and every gradient equal the plain model's, with dropout too."""

    def test_gradients(self, subject: Subject, policy: PolicyConfig, device: str) -> None:
        check_gradients(subject, policy, device)

    def test_gradients_with_dropout(self, subject: Subject, policy: PolicyConfig, device: str) -> None:
        check_gradients_with_dropout(subject, policy, device)

    def test_gradients_with_random_ops(self, subject: Subject, policy: PolicyConfig, device: str) -> None:
        check_gradients_with_random_ops(subject, policy, device)


__all__ = [
    "DROPOUT_P",
    "RANDOM_DROP",
    "RATE_SCHEDULES",
    "GradientTests",
    "RandomRate",
    "add_random_ops",
    "check_gradients",
    "check_gradients_with_dropout",
    "check_gradients_with_random_ops",
]
