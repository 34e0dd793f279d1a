"""Each policy trains exactly like the plain model and checkpoints exactly the blocks it should."""

from __future__ import annotations

import pytest
import torch

from ac_core import (
    DEFAULT_RETAINED_OPS,
    BlockSkip,
    CheckpointType,
    Full,
    Ops,
    apply_activation_checkpointing,
    checkpointed_blocks,
)
from ac_core.measure import OpCounter
from ac_core.testing import toy_case

from .helpers import assert_same_training, loss_and_grads

DEPTH = 5


@pytest.fixture(scope="module")
def plain():
    return loss_and_grads(toy_case(depth=DEPTH))


@pytest.mark.parametrize(
    ("kind", "n_layer", "expected"),
    [
        ("full", 1, {f"layers.{i}": CheckpointType.FULL for i in range(DEPTH)}),
        ("ops", 1, {f"layers.{i}": CheckpointType.OPS for i in range(DEPTH)}),
        ("block_skip", 2, {f"layers.{i}": CheckpointType.FULL for i in (0, 2, 4)}),
        ("block_skip", 3, {f"layers.{i}": CheckpointType.FULL for i in (0, 3)}),
        ("block_skip", 1, {f"layers.{i}": CheckpointType.FULL for i in range(DEPTH)}),
    ],
)
def test_policy_checkpoints_exactly_these_blocks_and_keeps_gradients(plain, kind, n_layer, expected):
    case = toy_case(depth=DEPTH)
    returned = apply_activation_checkpointing(case.model, kind, n_layer, blocks=["layers"])
    assert returned is case.model
    assert checkpointed_blocks(case.model) == expected
    assert_same_training(loss_and_grads(case), plain)


@pytest.mark.parametrize(
    ("kind", "n_layer", "recomputed_attention"),
    [("full", 1, DEPTH), ("ops", 1, 0), ("block_skip", 2, 3)],
)
def test_attention_kernel_runs_in_backward_only_where_recomputed(kind, n_layer, recomputed_attention):
    case = toy_case(depth=DEPTH)
    apply_activation_checkpointing(case.model, kind, n_layer, blocks=["layers"])
    with OpCounter() as ops:
        case.run().backward()
    assert ops.count(["aten::_scaled_dot_product_flash_attention_for_cpu"]) == DEPTH
    assert ops.count(DEFAULT_RETAINED_OPS, "backward") == recomputed_attention


def test_ops_recomputes_the_rest_of_the_block():
    case = toy_case(depth=DEPTH)
    apply_activation_checkpointing(case.model, "ops", blocks=["layers"])
    with OpCounter() as ops:
        case.run().backward()
    # qkv, proj and the first MLP linear run again; attention does not, and recompute stops
    # early before the last linear, whose output backward does not need.
    assert ops.count(["aten::addmm"], "backward") == 3 * DEPTH
    assert ops.count(["aten::gelu"], "backward") == DEPTH


def test_plain_model_recomputes_nothing():
    case = toy_case(depth=DEPTH)
    with OpCounter() as ops:
        case.run().backward()
    assert ops.count(["aten::addmm", "aten::gelu", *DEFAULT_RETAINED_OPS], "backward") == 0


def test_no_grad_forward_is_plain():
    case = toy_case(depth=DEPTH)
    apply_activation_checkpointing(case.model, "full", blocks=["layers"])
    reference = toy_case(depth=DEPTH)
    with torch.no_grad():
        torch.testing.assert_close(case.model(**case.inputs), reference.model(**reference.inputs), rtol=0, atol=0)


def test_retain_ops_extends_the_retained_set():
    case = toy_case(depth=2)
    apply_activation_checkpointing(case.model, "ops", blocks=["layers"], retain={"aten::gelu"})
    with OpCounter() as ops:
        case.run().backward()
    assert ops.count(["aten::gelu"], "backward") == 0
    assert ops.count(["aten::addmm"], "backward") == 3 * 2


@pytest.mark.parametrize("kind", ["full", "ops"])
def test_dropout_block_gets_the_plain_gradients(kind):
    def run(checkpointed: bool, seed: int = 1234):
        case = toy_case(depth=3, dropout=0.3)
        case.model.train()
        if checkpointed:
            apply_activation_checkpointing(case.model, kind, blocks=["layers"])
        torch.manual_seed(seed)
        return loss_and_grads(case)

    plain = run(False)
    assert_same_training(run(True), plain)
    # The result depends on the dropout masks, so replaying the wrong RNG state would show.
    assert not torch.equal(run(False, seed=99)[0], plain[0])


def test_rng_state_is_kept_on_every_call_unless_the_config_opts_out(monkeypatch):
    import torch.utils.checkpoint as tuc

    seen: list[bool] = []
    original = tuc.checkpoint

    def spy(*args, preserve_rng_state=True, **kwargs):
        seen.append(preserve_rng_state)
        return original(*args, preserve_rng_state=preserve_rng_state, **kwargs)

    monkeypatch.setattr("ac_core._checkpoint.checkpoint", spy)
    cases = [(0.0, True, "full", True), (0.3, False, Ops(), True), (0.0, True, Full(preserve_rng_state=False), False)]
    cases.append((0.3, True, BlockSkip(every=1, preserve_rng_state=False), False))
    for dropout, training, policy, expected in cases:
        case = toy_case(depth=2, dropout=dropout)
        case.model.train(training)
        apply_activation_checkpointing(case.model, policy, blocks=["layers"])
        for _ in range(2):  # never inferred from an earlier call: a block with no randomness yet may draw later
            seen.clear()
            case.run().backward()
            assert seen == [expected, expected], (dropout, training, policy)


@pytest.mark.parametrize("config", [Full, Ops, BlockSkip])
def test_preserve_rng_state_takes_a_bool(config):
    with pytest.raises(TypeError, match=r"preserve_rng_state=\.\.\.\) takes True or False, got 'no'"):
        config(preserve_rng_state="no")
