"""'ops' that retains nothing in a block says so once per process, on torch 2.13."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from ac_core import apply_activation_checkpointing
from ac_core.testing import TOY_ADAPTER, toy_case

from .helpers import assert_same_training, loss_and_grads


def _warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "ac_core" and "retained nothing" in r.getMessage()]


def test_math_attention_warns_once_naming_block_and_op(caplog):
    case = toy_case(depth=3, attention="math")
    apply_activation_checkpointing(case.model, "ops", blocks=["layers"])
    with caplog.at_level(logging.WARNING, logger="ac_core"):
        case.run().backward()
        case.run().backward()
    records = _warnings(caplog)
    assert len(records) == 1
    message = records[0].getMessage()
    assert "ToyBlock" in message and "aten::_softmax" in message and "Ops(retain=" in message


def test_block_without_attention_says_it_saw_none(caplog):
    case = toy_case(depth=2)
    apply_activation_checkpointing(case.model, "ops", blocks=["layers.0.mlp"])
    with caplog.at_level(logging.WARNING, logger="ac_core"):
        case.run().backward()
    (record,) = _warnings(caplog)
    assert "Linear" in record.getMessage() and "no op that looks like attention" in record.getMessage()


def test_retaining_block_does_not_warn(caplog):
    case = toy_case(depth=2)
    apply_activation_checkpointing(case.model, "ops", blocks=["layers"])
    with caplog.at_level(logging.WARNING, logger="ac_core"):
        case.run().backward()
    assert _warnings(caplog) == []


def test_not_retainable_attention_still_trains_correctly():
    plain = loss_and_grads(toy_case(depth=3, attention="math"))
    case = toy_case(depth=3, attention="math")
    apply_activation_checkpointing(case.model, "ops", blocks=["layers"])
    assert_same_training(loss_and_grads(case), plain)


@pytest.mark.parametrize(("declared_calls", "warnings"), [(0, 0), (1, 1)])
def test_block_its_adapter_declares_attention_free_does_not_warn(caplog, declared_calls, warnings):
    # A conv block (e.g. Wan-Animate's motion encoder) retains nothing under 'ops' by design.
    model_spec = dataclasses.replace(TOY_ADAPTER.models[0], attention_calls={"ToyBlock": declared_calls})
    adapter = dataclasses.replace(TOY_ADAPTER, models=(model_spec,))
    case = toy_case(depth=2, attention="math")
    apply_activation_checkpointing(case.model, "ops", adapter=adapter)
    with caplog.at_level(logging.WARNING, logger="ac_core"):
        case.run().backward()
    assert len(_warnings(caplog)) == warnings
