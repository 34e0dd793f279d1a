"""Check 5: checkpointing leaves every name alone, and save_pretrained/from_pretrained round-trips."""

from __future__ import annotations

import tempfile

import pytest
import torch
from torch import nn

from ac_core import PolicyConfig, apply_activation_checkpointing, is_activation_checkpointed

from ..base import AdapterTests
from ..policies import Policy, as_policy, label
from ..subjects import Subject
from ..training import EAGER_TOLERANCE, STEP_SEED, build, tensors_of


def _names(model: nn.Module) -> dict[str, list[str]]:
    return {
        "named_parameters()": [n for n, _ in model.named_parameters()],
        "state_dict()": list(model.state_dict().keys()),
        "named_modules()": [n for n, _ in model.named_modules()],
    }


def check_names(subject: Subject, policy: Policy) -> None:
    """Fail unless parameter, state_dict and module names are exactly those of the plain model, in order."""
    case = build(subject)
    before = _names(case.model)
    config = as_policy(policy)
    apply_activation_checkpointing(case.model, config, adapter=subject.adapter)
    after = _names(case.model)
    for what, names in before.items():
        if after[what] != names:
            changed = sorted(set(names) ^ set(after[what]))[:5] or "order"
            raise AssertionError(f"{subject.id} under {label(config)}: {what} changed: {changed}")


def check_save_pretrained(subject: Subject, policy: Policy, device: str = "cpu") -> None:
    """``save_pretrained`` of a checkpointed model reloads with ``from_pretrained`` as a plain model, same outputs."""
    case = build(subject, device)
    # diffusers' and transformers' methods, looked up: a plain nn.Module has neither.
    save_pretrained = getattr(case.model, "save_pretrained", None)
    from_pretrained = getattr(type(case.model), "from_pretrained", None)
    if not (callable(save_pretrained) and callable(from_pretrained)):
        pytest.skip(f"{type(case.model).__name__} has no save_pretrained/from_pretrained")
    config = as_policy(policy)
    apply_activation_checkpointing(case.model, config, adapter=subject.adapter)
    what = f"{subject.id} under {label(config)}: save_pretrained -> from_pretrained"
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(tmp)
        reloaded = from_pretrained(tmp)
    assert isinstance(reloaded, nn.Module), f"{what}: from_pretrained returned a {type(reloaded).__name__}"
    reloaded.to(device).train(case.model.training)
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


class NameTests(AdapterTests):
    """Check 5: names unchanged; save_pretrained/from_pretrained round trip where the model has them."""

    def test_names(self, subject: Subject, policy: PolicyConfig) -> None:
        check_names(subject, policy)

    def test_save_pretrained_round_trip(self, subject: Subject, policy: PolicyConfig) -> None:
        check_save_pretrained(subject, policy)


__all__ = ["NameTests", "check_names", "check_save_pretrained"]
