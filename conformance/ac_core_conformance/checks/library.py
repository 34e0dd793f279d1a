"""Check 8: a model whose library checkpointing is on is taken over: turned off, said so, trained correctly."""

from __future__ import annotations

import pytest

from ac_core import apply_activation_checkpointing
from ac_core.library_checkpointing import enable_library_checkpointing, library_checkpointing

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


__all__ = ["check_library_checkpointing"]
