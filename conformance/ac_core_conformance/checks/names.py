"""Check 5: checkpointing leaves every name alone, and save_pretrained/from_pretrained round-trips."""

from __future__ import annotations

import tempfile

import pytest
import torch
from torch import nn

from ac_core import apply_activation_checkpointing, is_activation_checkpointed

from ..subjects import Subject
from ..training import EAGER_TOLERANCE, STEP_SEED, build, tensors_of


def _names(model: nn.Module) -> dict[str, list[str]]:
    return {
        "named_parameters()": [n for n, _ in model.named_parameters()],
        "state_dict()": list(model.state_dict().keys()),
        "named_modules()": [n for n, _ in model.named_modules()],
    }


def check_names(subject: Subject, policy: str, *, n_layer: int = 2) -> None:
    """Fail unless parameter, state_dict and module names are exactly those of the plain model, in order."""
    case = build(subject)
    before = _names(case.model)
    apply_activation_checkpointing(case.model, policy, n_layer, adapter=subject.adapter)
    after = _names(case.model)
    for what, names in before.items():
        if after[what] != names:
            changed = sorted(set(names) ^ set(after[what]))[:5] or "order"
            raise AssertionError(f"{subject.id} under {policy}: {what} changed: {changed}")


def can_save_pretrained(model: nn.Module) -> bool:
    """Whether the model has ``save_pretrained`` and its class ``from_pretrained`` (diffusers and transformers)."""
    return callable(getattr(model, "save_pretrained", None)) and callable(getattr(type(model), "from_pretrained", None))


def check_save_pretrained(subject: Subject, policy: str, device: str = "cpu", *, n_layer: int = 2) -> None:
    """``save_pretrained`` of a checkpointed model reloads with ``from_pretrained`` as a plain model, same outputs."""
    case = build(subject, device)
    if not can_save_pretrained(case.model):
        pytest.skip(f"{type(case.model).__name__} has no save_pretrained/from_pretrained")
    apply_activation_checkpointing(case.model, policy, n_layer, adapter=subject.adapter)
    with tempfile.TemporaryDirectory() as tmp:
        case.model.save_pretrained(tmp)
        reloaded = type(case.model).from_pretrained(tmp)
    reloaded.to(device).train(case.model.training)
    what = f"{subject.id} under {policy}: save_pretrained -> from_pretrained"
    assert not is_activation_checkpointed(reloaded), f"{what}: the reloaded model is checkpointed"
    assert list(reloaded.state_dict()) == list(case.model.state_dict()), f"{what}: state_dict keys differ"
    torch.manual_seed(STEP_SEED)
    expected = tensors_of(case.model(**case.inputs))
    torch.manual_seed(STEP_SEED)
    got = tensors_of(reloaded(**case.inputs))
    assert expected and len(got) == len(expected), f"{what}: {len(got)} output tensors, expected {len(expected)}"
    for index, (a, b) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(
            a,
            b,
            rtol=EAGER_TOLERANCE.rtol,
            atol=EAGER_TOLERANCE.atol,
            msg=lambda m, i=index: f"{what}: output {i}: {m}",
        )


__all__ = ["can_save_pretrained", "check_names", "check_save_pretrained"]
