"""Policies as frozen configs: validation, the registry, the seed-compatible strings, renamed keywords."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

import ac_core
from ac_core import (
    BlockSelection,
    BlockSkip,
    CheckpointType,
    Full,
    Ops,
    PolicyConfig,
    apply_activation_checkpointing,
    checkpointed_blocks,
    register_policy,
    registered_policies,
)
from ac_core.testing import toy_case

from .helpers import assert_same_training, loss_and_grads, structure


def test_registry_lists_the_three_policies_in_order():
    assert registered_policies() == {"full": Full, "ops": Ops, "block_skip": BlockSkip}


@pytest.mark.parametrize(
    ("config", "string", "n_layer"),
    [
        (Full(), "full", None),
        (Ops(), "ops", None),
        (BlockSkip(every=2), "block_skip", 2),
        (BlockSkip(1), "block_skip", None),
    ],
)
def test_a_config_and_its_string_checkpoint_the_same_blocks(config, string, n_layer):
    by_config, by_string = toy_case(depth=4), toy_case(depth=4)
    apply_activation_checkpointing(by_config.model, config, blocks=["layers"])
    apply_activation_checkpointing(by_string.model, string, n_layer, blocks=["layers"])
    assert checkpointed_blocks(by_config.model) == checkpointed_blocks(by_string.model)
    assert checkpointed_blocks(by_config.model)  # not vacuously equal


def test_configs_are_frozen_and_validated():
    with pytest.raises(dataclasses.FrozenInstanceError):
        BlockSkip(2).every = 3  # type: ignore[misc]
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="BlockSkip"):
            BlockSkip(every=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"not a single string"):
        Ops(retain="aten::mm")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot be kept: only a functional collective"):
        Ops(retain=frozenset({"_c10d_functional::wait_tensor"}))
    gather = "_c10d_functional::all_gather_into_tensor"  # kept where it moves activations: test_context_parallel.py
    assert Ops(retain=frozenset({gather})).retain == frozenset({gather})
    with pytest.raises(ValueError, match="keeps and refuses the same collectives"):
        Ops(retain=frozenset({gather}), collectives=False)
    with pytest.raises(TypeError, match="collectives"):
        Ops(collectives=1)  # type: ignore[arg-type]
    assert Ops(retain=["aten::gelu"]).retain == frozenset({"aten::gelu"})


@pytest.mark.parametrize("policy", ["full", "ops", Full(), Ops()])
def test_n_layer_with_a_policy_that_ignores_it_names_block_skip(policy):
    model = toy_case().model
    before = structure(model)
    with pytest.raises(ValueError, match=r"block_skip|BlockSkip"):
        apply_activation_checkpointing(model, policy, 3, blocks=["layers"])
    assert structure(model) == before and checkpointed_blocks(model) == {}


def test_n_layer_one_means_every_block_and_is_accepted_with_full():
    case = toy_case(depth=3)
    apply_activation_checkpointing(case.model, "full", 1, blocks=["layers"])
    assert len(checkpointed_blocks(case.model)) == 3


def test_retain_with_a_policy_that_keeps_no_ops_is_an_error():
    with pytest.raises(ValueError, match="retain applies to 'ops' only"):
        apply_activation_checkpointing(toy_case().model, "full", blocks=["layers"], retain={"aten::gelu"})


def test_old_keyword_names_still_work_with_a_deprecation_warning():
    case = toy_case(depth=2)
    with pytest.warns(DeprecationWarning, match="retain_ops= is renamed retain="):
        apply_activation_checkpointing(case.model, "ops", blocks=["layers"], retain_ops={"aten::gelu"})
    assert set(checkpointed_blocks(case.model).values()) == {CheckpointType.OPS}
    with pytest.raises(TypeError, match="both retain_ops= and its new name retain="):
        apply_activation_checkpointing(case.model, "ops", blocks=["layers"], retain={"a::b"}, retain_ops={"a::b"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_activation_checkpointing(case.model, "ops", blocks=["layers"], retain={"aten::gelu"})


@dataclasses.dataclass(frozen=True)
class _FirstOnly(PolicyConfig):
    """A third-party policy: checkpoint only each container's first block."""

    name = "first_only"


def test_a_new_policy_is_one_config_and_one_handler():
    @register_policy(_FirstOnly)
    def _select(config: _FirstOnly, blocks: ac_core.ModelBlocks) -> list[BlockSelection]:
        return [BlockSelection(block, CheckpointType.FULL) for block in blocks if block.index == 0]

    try:
        expected = loss_and_grads(toy_case(depth=3))
        case = toy_case(depth=3)
        apply_activation_checkpointing(case.model, "first_only", blocks=["layers"])
        assert checkpointed_blocks(case.model) == {"layers.0": CheckpointType.FULL}
        assert_same_training(loss_and_grads(case), expected)
        assert "first_only" in registered_policies()
    finally:
        ac_core.policies.unregister_policy(_FirstOnly)
    assert "first_only" not in registered_policies()


def test_a_config_without_a_handler_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Unregistered(PolicyConfig):
        name = "unregistered"

    with pytest.raises(TypeError, match="no registered handler"):
        apply_activation_checkpointing(toy_case().model, Unregistered(), blocks=["layers"])


@pytest.mark.parametrize("keyword", ["retain", "retain_ops"])
def test_a_single_string_of_kept_ops_is_refused_with_the_fix(keyword):
    model = toy_case().model
    before = structure(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(TypeError, match=r"not a single string.*\{'aten::mm'\}|\{'aten::mm'\}.*not a single string"):
            apply_activation_checkpointing(model, "ops", blocks=["layers"], **{keyword: "aten::mm"})
    assert structure(model) == before and checkpointed_blocks(model) == {}
