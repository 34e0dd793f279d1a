"""Check 8: a model whose library checkpointing is on is taken over: turned off, said so, trained correctly."""

from __future__ import annotations

import pytest

from ac_core import PolicyConfig, apply_activation_checkpointing, reset_warnings
from ac_core.libraries.checkpointing import enable_library_checkpointing, library_checkpointing
from ac_core.measure import OpCounter
from ac_core.policies import retained_ops

from ..base import AdapterTests
from ..policies import Policy, as_policy, label
from ..probes import capture_logs
from ..subjects import Subject
from ..training import EAGER_TOLERANCE, assert_same_step, build, plain_step
from ..training import step as train_step


def check_library_checkpointing(subject: Subject, policy: Policy) -> str:
    """After ``enable_gradient_checkpointing()`` (diffusers) / ``activation_checkpointing_enable()`` (transformers).

    Applying ``policy`` turns the library's checkpointing off with a warning naming the model, and
    the model then trains like the plain one. Returns the warning. Skips a model without library
    checkpointing, or whose library refuses it for this class.
    """
    config = as_policy(policy)
    case = build(subject)
    try:
        method = enable_library_checkpointing(case.model)
    except (ValueError, NotImplementedError) as exc:
        pytest.skip(f"{subject.id}: {exc}")
    expected = plain_step(subject, "cpu")
    model_name = type(case.model).__name__
    what = f"{subject.id} under {label(config)} after {method}()"
    assert library_checkpointing(case.model), (
        f"{what}: no module reports gradient_checkpointing=True, so ac-core cannot see that it is on"
    )
    with capture_logs() as records:
        apply_activation_checkpointing(case.model, config, adapter=subject.adapter)
    warnings = [r.getMessage() for r in records if "gradient checkpointing" in r.getMessage()]
    assert len(warnings) == 1 and model_name in warnings[0], (
        f"{what}: expected one warning naming {model_name} that its gradient checkpointing was turned off, "
        f"got {warnings}"
    )
    still_on = library_checkpointing(case.model)
    assert not still_on, f"{what}: library checkpointing is still on for {still_on[:5]}"
    assert_same_step(train_step(case), expected, EAGER_TOLERANCE, what)
    return warnings[0]


def check_library_checkpointing_after(subject: Subject, policy: Policy) -> str:
    """The library's own checkpointing switched on AFTER ``policy`` was applied (``gradient_checkpointing_enable()``,
    ``Trainer(gradient_checkpointing=True)``): by the next forward ac-core turns it off again, says so once, and the
    model trains like the plain one with no block checkpointed twice. Returns the warning."""
    config = as_policy(policy)
    case = build(subject)
    apply_activation_checkpointing(case.model, config, adapter=subject.adapter)
    try:
        method = enable_library_checkpointing(case.model)
    except (ValueError, NotImplementedError) as exc:
        pytest.skip(f"{subject.id}: {exc}")
    expected = plain_step(subject, "cpu")
    what = f"{subject.id} under {label(config)}, then {method}()"
    reset_warnings()  # once per process and model class: start as a fresh process would
    with capture_logs() as records:
        first = train_step(case)
        case.model.zero_grad(set_to_none=True)
        with OpCounter() as ops:
            second = train_step(case)
    warnings = [r.getMessage() for r in records if "was switched on" in r.getMessage()]
    assert len(warnings) == 1 and type(case.model).__name__ in warnings[0], (
        f"{what}: expected one warning naming {type(case.model).__name__} that the library's checkpointing was "
        f"switched on and turned off again, got {warnings}"
    )
    still_on = library_checkpointing(case.model)
    assert not still_on, f"{what}: library checkpointing is still on for {still_on[:5]}"
    # Once found, each checkpointed block recomputes once: as many attention kernels in backward as ac-core alone.
    reference = build(subject)
    apply_activation_checkpointing(reference.model, config, adapter=subject.adapter)
    with OpCounter() as alone:
        train_step(reference)
    kernels = retained_ops(subject.blocks(reference.model))
    twice, once = ops.count(kernels, "backward"), alone.count(kernels, "backward")
    assert twice == once, f"{what}: backward ran attention {twice} times, ac-core alone {once}: checkpointed twice"
    assert_same_step(first, expected, EAGER_TOLERANCE, f"{what}, first step")
    assert_same_step(second, expected, EAGER_TOLERANCE, f"{what}, second step")
    return warnings[0]


class LibraryCheckpointingTests(AdapterTests):
    """Check 8: the library's own gradient checkpointing is turned off with a warning, and training is right."""

    def test_library_checkpointing_taken_over(self, subject: Subject, policy: PolicyConfig) -> None:
        check_library_checkpointing(subject, policy)

    def test_library_checkpointing_switched_on_after(self, subject: Subject, policy: PolicyConfig) -> None:
        check_library_checkpointing_after(subject, policy)


__all__ = ["LibraryCheckpointingTests", "check_library_checkpointing", "check_library_checkpointing_after"]
