"""The policy registry serves every route: a third party's policy runs eagerly and on ac_core.compile's graph pass."""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import ClassVar

import pytest

import ac_core
from ac_core import BlockMode, BlockSelection, CheckpointType, ModelBlocks, PolicyConfig, PolicyTraits
from ac_core.measure import CompiledOpCounter, OpCounter
from ac_core.policies import unregister_policy
from ac_core.testing import toy_case

from .helpers import assert_same_training, loss_and_grads

CPU_ATTENTION = ["aten::_scaled_dot_product_flash_attention_for_cpu"]
DEPTH = 4


@dataclasses.dataclass(frozen=True)
class Alternate(PolicyConfig):
    """Keeps attention in even blocks (OPS), recomputes odd blocks whole."""

    name: ClassVar[str] = "alternate"


def _alternate(config: Alternate, blocks: ModelBlocks) -> list[BlockSelection]:
    return [
        BlockSelection(b, BlockMode.OPS, ac_core.DEFAULT_RETAINED_OPS)
        if b.index % 2 == 0
        else BlockSelection(b, CheckpointType.FULL)  # the old spelling of a kind is taken too
        for b in blocks
    ]


@pytest.fixture
def alternate():
    ac_core.register_policy(Alternate, traits=PolicyTraits(keeps_attention=False))(_alternate)
    yield Alternate()
    unregister_policy(Alternate)


def _attention_in_backward(case, counter) -> int:
    with counter() as ops:
        case.run().backward()
    return ops.count(CPU_ATTENTION, "backward")


def test_a_third_party_policy_runs_eagerly(alternate):
    expected = loss_and_grads(toy_case(depth=DEPTH))
    case = toy_case(depth=DEPTH)
    ac_core.apply_activation_checkpointing(case.model, alternate, blocks=["layers"])
    assert ac_core.checkpointed_blocks(case.model) == {
        f"layers.{i}": BlockMode.OPS if i % 2 == 0 else BlockMode.FULL for i in range(DEPTH)
    }
    assert_same_training(loss_and_grads(case), expected)
    assert _attention_in_backward(case, OpCounter) == DEPTH // 2  # the odd blocks' attention only


def test_a_third_party_policy_takes_the_graph_route(alternate, caplog):
    expected = loss_and_grads(toy_case(depth=DEPTH))
    case = toy_case(depth=DEPTH)
    with caplog.at_level(logging.INFO, logger="ac_core"):
        case.model = ac_core.compile(case.model, alternate, blocks=["layers"], backend="aot_eager")
        assert_same_training(loss_and_grads(case), expected)
    assert sum("graph SAC pass" in r.getMessage() for r in caplog.records) == 1
    assert ac_core.checkpointed_blocks(case.model) == {}  # decided on the graph, not checkpointed eagerly
    assert _attention_in_backward(case, CompiledOpCounter) == DEPTH // 2


def test_its_selections_become_the_pass_decisions(alternate):
    case = toy_case(depth=2)
    decisions = ac_core.graph_decisions(alternate, ac_core.GraphRequest(case.model, containers=["layers"]))
    assert decisions.blocks == (
        ac_core.BlockDecision("layers.0", BlockMode.OPS, retain=ac_core.DEFAULT_RETAINED_OPS),
        ac_core.BlockDecision("layers.1", BlockMode.FULL),
    )


def test_traits_are_what_callers_choose_by():
    assert (
        ac_core.policy_traits(ac_core.Ops).keeps_attention and not ac_core.policy_traits(ac_core.Full).keeps_attention
    )
    assert (
        ac_core.policy_traits(ac_core.Full()).recomputes_all and ac_core.policy_traits(ac_core.BlockSkip).recomputes_all
    )
    budget = ac_core.policy_traits(ac_core.Budget)
    assert budget.budgeted and not budget.from_name
    assert list(ac_core.registered_policies())[:3] == ["full", "ops", "block_skip"]
    assert "budget" not in ac_core.registered_policies() and "plan" not in ac_core.registered_policies()
    # The seed's knobs go where the traits say, not by policy name.
    assert ac_core.policy_config("block_skip") == ac_core.BlockSkip(every=1)
    assert ac_core.policy_config("block_skip", 3) == ac_core.BlockSkip(every=3)
    assert ac_core.policy_config("ops", retain=["mylib::attn"]) == ac_core.Ops(retain=frozenset({"mylib::attn"}))
    with pytest.raises(ValueError, match="retain applies to 'ops' only"):
        ac_core.policy_config("full", retain=["mylib::attn"])
    with pytest.raises(ValueError, match=r"n_layer=3 is used by 'block_skip'"):
        ac_core.policy_config("ops", 3)


def test_a_policy_without_graph_decisions_says_why():
    @dataclasses.dataclass(frozen=True)
    class Custom(PolicyConfig):
        name: ClassVar[str] = "custom"

    def layer(*args, **kwargs):
        raise AssertionError("not installed in this test")

    ac_core.register_policy(Custom)(
        lambda config, blocks: [BlockSelection(b, BlockMode.FULL, layer=layer) for b in blocks]
    )
    try:
        request = ac_core.GraphRequest(toy_case(depth=1).model, containers=["layers"])
        with pytest.raises(ValueError, match=r"layer of its own on block 'layers.0'.*register_policy\(Custom, graph="):
            ac_core.graph_decisions(Custom(), request)
        ac_core.register_policy(Custom, graph="it installs layers of its own")(lambda config, blocks: [])
        assert ac_core.graph_route_refusal(Custom()) == "it installs layers of its own"
        with pytest.raises(ValueError, match="policy 'custom' has no graph route: it installs layers of its own"):
            ac_core.graph_decisions(Custom(), request)
    finally:
        unregister_policy(Custom)
    with pytest.raises(TypeError, match="no registered handler"):
        ac_core.select(Custom(), ac_core.resolve_blocks(toy_case(depth=1).model, blocks=["layers"]))


def test_selections_and_decisions_are_checked():
    block = next(iter(ac_core.resolve_blocks(toy_case(depth=1).model, blocks=["layers"])))
    assert BlockSelection(block, "ops", {"aten::mm"}).kind is BlockMode.OPS
    with pytest.raises(ValueError, match="leaves a block unchecked by not selecting it"):
        BlockSelection(block, BlockMode.NONE)
    with pytest.raises(ValueError, match="'block_skip' is not a block mode"):
        BlockSelection(block, CheckpointType.BLOCK_SKIP)
    with pytest.raises(ValueError, match="is no decision"):
        ac_core.BlockDecision("layers.0", BlockMode.OPS)
    with pytest.raises(ValueError, match="is no decision"):
        ac_core.BlockDecision("layers.0", BlockMode.FULL, keep=(("aten::mm", 0),))
    with pytest.raises(ValueError, match="not both"):
        ac_core.GraphDecisions(blocks=(), torch_budget=0.5)


def test_old_names_still_work_with_a_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ac_core.BlockPlan is ModelBlocks
        assert callable(ac_core.sac_aot_eager)
    assert [str(w.message) for w in caught] == [
        "ac_core.BlockPlan is deprecated; use ac_core.ModelBlocks",
        "ac_core.sac_aot_eager is deprecated; use ac_core.GraphRoute(retain, blocks, outside_modules).aot_eager()",
    ]
    assert all(w.category is DeprecationWarning for w in caught)
