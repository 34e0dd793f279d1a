"""Each served class trains under ac-core exactly as without it, with the adapter found from the model's class."""

from __future__ import annotations

import logging

import pytest

from ac_core import DEFAULT_RETAINED_OPS, apply_activation_checkpointing, checkpointed_blocks
from ac_core.measure import OpCounter

from .cases import assert_same_training, blocks, loss_and_grads, per_call_ops, served


@pytest.mark.parametrize("kind", ["ops", "full"])
@pytest.mark.parametrize(("spec", "model_spec"), list(served()))
def test_trains_like_the_plain_model(spec, model_spec, kind, caplog):
    """Loss and gradients bitwise equal (tolerance 0, float32). In backward 'ops' reruns no attention kernel and
    'full' reruns each block's once; no 'retained nothing' warning (attention-free blocks are declared so)."""
    plain = model_spec.build_tiny()
    in_blocks = sum(sum(calls) for calls in per_call_ops(plain, model_spec, DEFAULT_RETAINED_OPS).values())
    plain.model.zero_grad(set_to_none=True)
    expected = loss_and_grads(plain)

    case = model_spec.build_tiny()
    apply_activation_checkpointing(case.model, kind)
    assert set(checkpointed_blocks(case.model)) == {fqn for fqn, _ in blocks(case, model_spec)}
    with caplog.at_level(logging.WARNING, logger="ac_core"), OpCounter() as counter:
        got = loss_and_grads(case)
    assert_same_training(got, expected)
    assert in_blocks > 0
    assert counter.count(DEFAULT_RETAINED_OPS, "backward") == (0 if kind == "ops" else in_blocks)
    assert [r for r in caplog.records if "retained nothing" in r.getMessage()] == []
