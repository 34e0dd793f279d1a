"""A third party's policy takes the attention and gradient checks as a built-in one does: judged block by block,
by what ac-core's policy registry says it selects, never by its class."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import pytest

from ac_core import (
    DEFAULT_RETAINED_OPS,
    BlockMode,
    BlockSelection,
    ModelBlocks,
    PolicyConfig,
    register_policy,
)
from ac_core.policies import unregister_policy
from ac_core.testing import TOY_ADAPTER
from ac_core_conformance import (
    AttentionTests,
    GradientTests,
    attention_recomputes,
    check_attention_recomputed,
    check_memory,
)
from ac_core_conformance.checks import attention

from .broken import subject

TOY_BLOCKS = [f"layers.{i}" for i in range(4)]
"""The toy's four blocks, one attention call each."""


@dataclass(frozen=True)
class Alternate(PolicyConfig):
    """Keeps attention (``ops``) in the even-index blocks; recomputes the odd ones whole."""

    name: ClassVar[str] = "alternate"


def _alternate(config: Alternate, blocks: ModelBlocks) -> list[BlockSelection]:
    adapter_ops = blocks.adapter.retained_ops() if blocks.adapter is not None else frozenset()
    kept = DEFAULT_RETAINED_OPS | adapter_ops
    return [
        BlockSelection(block, BlockMode.OPS, kept) if block.index % 2 == 0 else BlockSelection(block, BlockMode.FULL)
        for block in blocks
    ]


@pytest.fixture(autouse=True)
def alternate_registered() -> Iterator[None]:
    """``alternate`` is registered for each test here only: other modules' default policies stay the built-in ones."""
    register_policy(Alternate)(_alternate)
    yield
    unregister_policy(Alternate)


class TestAlternateOnTheToy(AttentionTests, GradientTests):
    adapter = TOY_ADAPTER
    policies = (Alternate(),)


def test_recomputes_are_expected_per_block():
    toy = subject(TOY_ADAPTER)
    assert attention_recomputes(toy, Alternate()) == {"layers.0": 0, "layers.1": 1, "layers.2": 0, "layers.3": 1}
    assert check_attention_recomputed(toy, Alternate()) == 2  # layers.1 and layers.3; a class test would say 4


def test_a_wrong_expectation_fails_the_check(monkeypatch):
    # Expecting every checkpointed block to rerun attention, as a test by the policy's class would, is caught.
    monkeypatch.setattr(attention, "reruns", lambda selection, op: True)
    assert attention_recomputes(subject(TOY_ADAPTER), Alternate()) == dict.fromkeys(TOY_BLOCKS, 1)
    with pytest.raises(AssertionError, match=r"recomputed the attention kernel 2 times; .* rerun 4 calls"):
        check_attention_recomputed(subject(TOY_ADAPTER), Alternate())


def test_memory_measures_the_policy_as_any_other():
    held = check_memory(subject(TOY_ADAPTER), policies=(Alternate(),))
    assert list(held) == ["none", "full", "ops", "alternate"]
    assert held["full"] < held["alternate"] < held["none"]  # keeps attention outputs in two blocks of four
