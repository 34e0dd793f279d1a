"""Check 8: a model whose library checkpointing is on is taken over: turned off, said so, trained correctly."""

from __future__ import annotations

import pytest
from torch import nn

from ac_core import apply_activation_checkpointing

from ..probes import capture_logs
from ..subjects import Subject
from ..training import EAGER_TOLERANCE, assert_same_step, build, plain_step
from ..training import step as train_step

# diffusers ModelMixin; transformers PreTrainedModel (5.x name, then the deprecated one).
_ENABLERS = ("enable_gradient_checkpointing", "activation_checkpointing_enable", "gradient_checkpointing_enable")


def _library_checkpointed(model: nn.Module) -> list[str]:
    return [name or "<root>" for name, m in model.named_modules() if getattr(m, "gradient_checkpointing", 0) is True]


def enable_library_checkpointing(model: nn.Module) -> str:
    """Turn on the model library's own gradient checkpointing; returns the method used, or skips without one."""
    for method in _ENABLERS:
        enable = getattr(model, method, None)
        if callable(enable):
            try:
                enable()
            except (ValueError, NotImplementedError) as exc:  # the library says this class does not support it
                pytest.skip(f"{type(model).__name__}.{method}() refused: {exc}")
            return method
    pytest.skip(f"{type(model).__name__} has neither {' nor '.join(m + '()' for m in _ENABLERS)}")


def check_library_checkpointing(subject: Subject, policy: str, *, n_layer: int = 2) -> str:
    """After ``enable_gradient_checkpointing()`` (diffusers) / ``gradient_checkpointing_enable()`` (transformers).

    Applying ``policy`` turns the library's checkpointing off with a warning naming the model, and
    the model then trains like the plain one. Returns the warning.
    """
    case = build(subject)
    method = enable_library_checkpointing(case.model)
    expected = plain_step(subject, "cpu")
    model_name = type(case.model).__name__
    what = f"{subject.id} under {policy} after {method}()"
    assert _library_checkpointed(case.model), (
        f"{what}: no module reports gradient_checkpointing=True, so ac-core cannot see that it is on"
    )
    with capture_logs() as records:
        apply_activation_checkpointing(case.model, policy, n_layer, adapter=subject.adapter)
    warnings = [r.getMessage() for r in records if "gradient checkpointing" in r.getMessage()]
    assert len(warnings) == 1 and model_name in warnings[0], (
        f"{what}: expected one warning naming {model_name} that its gradient checkpointing was turned off, "
        f"got {warnings}"
    )
    still_on = _library_checkpointed(case.model)
    assert not still_on, f"{what}: library checkpointing is still on for {still_on[:5]}"
    assert_same_step(train_step(case), expected, EAGER_TOLERANCE, what)
    return warnings[0]


__all__ = ["check_library_checkpointing", "enable_library_checkpointing"]
