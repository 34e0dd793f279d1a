"""Check 2: a checkpointed model trains exactly like the plain one, with dropout active too."""

from __future__ import annotations

import pytest
import torch

from ac_core import apply_activation_checkpointing

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


__all__ = ["DROPOUT_P", "check_gradients", "check_gradients_with_dropout"]
