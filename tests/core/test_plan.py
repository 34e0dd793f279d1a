"""resolve_blocks: one ModelBlocks with every block, its container, index and class, and the excluded containers."""

from __future__ import annotations

import pytest
from torch import nn

from ac_core import AdapterError, AdapterSpec, ExcludedContainer, ModelSpec, model_blocks, resolve_blocks
from ac_core.testing import TOY_ADAPTER, ToyBlock, ToyTransformer, toy_case


class _TwoStacks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.ModuleList(ToyBlock(8, 2) for _ in range(3))
        self.second = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.refiner = nn.ModuleList(ToyBlock(8, 2) for _ in range(1))


_SPEC = AdapterSpec(
    name="two_stacks",
    models=(
        ModelSpec(
            cls=f"{__name__}._TwoStacks",
            containers=("first", "second"),
            excluded=(ExcludedContainer("refiner", "one block over few tokens"), ExcludedContainer("gone", "absent")),
            attention_calls={"ToyBlock": 1, "Linear": 0},
        ),
    ),
)


def test_plan_holds_every_block_with_its_container_index_class_and_attention():
    model = _TwoStacks()
    resolved = resolve_blocks(model, _SPEC)
    assert resolved.adapter is _SPEC and resolved.model_spec is _SPEC.models[0] and resolved.model is model
    assert [c.path for c in resolved.containers] == ["first", "second"]
    assert [(b.path, b.index, b.container, b.class_name, b.expects_attention) for b in resolved] == [
        ("first.0", 0, "first", "ToyBlock", True),
        ("first.1", 1, "first", "ToyBlock", True),
        ("first.2", 2, "first", "ToyBlock", True),
        ("second.0", 0, "second", "Linear", False),
        ("second.1", 1, "second", "Linear", False),
    ]
    assert resolved.blocks[3].module is model.second[0]
    assert len(resolved) == 5 and resolved.paths == {b.path for b in resolved}
    assert [(e.path, e.found, [n for n, _ in e.modules]) for e in resolved.excluded] == [
        ("refiner", True, ["refiner"]),
        ("gone", False, []),
    ]
    assert resolved.source == "adapter 'two_stacks'"


def test_blocks_argument_needs_no_adapter():
    resolved = resolve_blocks(_TwoStacks(), blocks=["first"])
    assert resolved.adapter is None and resolved.model_spec is None and resolved.source == "blocks="
    assert [b.path for b in resolved] == ["first.0", "first.1", "first.2"]


def test_adapter_by_name_by_ref_and_by_spec_resolve_alike():
    model = ToyTransformer(depth=2)
    by_spec = resolve_blocks(model, TOY_ADAPTER)
    by_ref = resolve_blocks(model, "ac_core.testing:TOY_ADAPTER")
    assert by_spec.adapter is by_ref.adapter is TOY_ADAPTER
    assert [b.path for b in by_spec] == [b.path for b in by_ref] == ["layers.0", "layers.1"]
    assert model_blocks(model, adapter=TOY_ADAPTER) == [(b.path, b.module) for b in by_spec]


def test_the_serves_check_and_bad_adapter_arguments_are_said_once_here():
    with pytest.raises(AdapterError, match=r"adapter 'two_stacks' does not serve ToyTransformer .*blocks=\["):
        resolve_blocks(toy_case().model, _SPEC)
    with pytest.raises(TypeError, match=r"adapter takes a registered adapter name .* got 123"):
        resolve_blocks(toy_case().model, 123)  # type: ignore[arg-type]
    with pytest.raises(AdapterError, match="cannot import module 'no_such_module'"):
        resolve_blocks(toy_case().model, "no_such_module:SPEC")
    with pytest.raises(TypeError, match=r"blocks=\['layers'\]"):
        resolve_blocks(toy_case().model, blocks="layers")  # type: ignore[arg-type]


def test_a_missing_container_lists_block_lists_first_and_suggests_the_near_name():
    model = toy_case().model  # layers.i.mlp is a Sequential inside each block
    with pytest.raises(AdapterError) as info:
        resolve_blocks(model, blocks=["layer"])
    message = str(info.value)
    assert "ToyTransformer's block containers are ['layers']." in message  # not padded with layers.0.mlp ...
    assert message.endswith("Did you mean 'layers'?")


def test_apply_warns_about_block_containers_left_out(caplog):
    import logging

    from ac_core import apply_activation_checkpointing, checkpointed_blocks

    model = _TwoStacks()
    with caplog.at_level(logging.WARNING, logger="ac_core"):
        apply_activation_checkpointing(model, "full", blocks=["first"])
    assert "'refiner' (ToyBlock at refiner.0)" in caplog.text and "left unchecked" in caplog.text
    assert len(checkpointed_blocks(model)) == 3
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ac_core"):
        apply_activation_checkpointing(model, "full", adapter=_SPEC)  # refiner declared excluded: nothing to say
    assert "left unchecked" not in caplog.text
