"""Check 9: a checkpointed model survives pickling (``torch.save(model)``, ``copy.deepcopy``) still checkpointed."""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable

import pytest
import torch
from torch import nn

from ac_core import PolicyConfig, apply_activation_checkpointing, checkpointed_blocks

from ..base import AdapterTests
from ..policies import Policy, as_policy, label
from ..subjects import Subject
from ..training import EAGER_TOLERANCE, assert_same_step, build, plain_step
from ..training import step as train_step


def _torch_save_load(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


ROUND_TRIPS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "pickle": lambda model: pickle.loads(pickle.dumps(model)),
    "torch.save": _torch_save_load,
    "deepcopy": copy.deepcopy,
}
"""The ways a whole model is copied or saved and loaded back."""


def check_pickle_round_trip(subject: Subject, policy: Policy, how: str = "torch.save") -> None:
    """The copy of a checkpointed model is checkpointed on the same blocks and trains like the plain model."""
    config = as_policy(policy)
    expected = plain_step(subject, "cpu")
    case = build(subject, "cpu")
    apply_activation_checkpointing(case.model, config, adapter=subject.adapter)
    blocks = checkpointed_blocks(case.model)
    what = f"{subject.id} under {label(config)} after a {how} round trip"
    try:
        case.model = ROUND_TRIPS[how](case.model)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        # A model that cannot be pickled without ac-core is not ac-core's to fix.
        try:
            ROUND_TRIPS[how](build(subject, "cpu").model)
        except Exception:
            pytest.skip(f"{subject.model.class_name} cannot be copied by {how} even without ac-core: {exc}")
        raise AssertionError(f"{what}: failed only because of ac-core: {exc!r}") from exc
    assert checkpointed_blocks(case.model) == blocks, (
        f"{what}: checkpointed blocks {sorted(checkpointed_blocks(case.model))[:5]} instead of {sorted(blocks)[:5]}"
    )
    assert_same_step(train_step(case), expected, EAGER_TOLERANCE, what)


class PicklingTests(AdapterTests):
    """Check 9: ``torch.save(model)`` and ``copy.deepcopy`` keep the checkpointing, and the copy trains right."""

    @pytest.mark.parametrize("how", ["torch.save", "deepcopy"])
    def test_pickle_round_trip(self, subject: Subject, policy: PolicyConfig, how: str) -> None:
        check_pickle_round_trip(subject, policy, how)


__all__ = ["ROUND_TRIPS", "PicklingTests", "check_pickle_round_trip"]
