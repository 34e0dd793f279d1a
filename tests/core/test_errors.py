"""Bad input gets a clear error naming the thing and the fix, and leaves the model as it was."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import ac_core
from ac_core import (
    AdapterError,
    AdapterSpec,
    ConflictingCheckpointError,
    ModelSpec,
    UnsupportedVersionError,
    apply_activation_checkpointing,
    checkpointed_blocks,
)
from ac_core.testing import TOY_ADAPTER, ToyBlock, ToyTransformer, toy_case

from .helpers import structure


def _toy_spec(**model_fields) -> AdapterSpec:
    fields = {"cls": f"{ToyTransformer.__module__}.ToyTransformer", "containers": ("layers",)} | model_fields
    return AdapterSpec(name="toy_variant", models=(ModelSpec(**fields),))


def _raises_and_unchanged(model: nn.Module, exc: type[Exception], match: str, **kwargs) -> pytest.ExceptionInfo:
    before = structure(model)
    with pytest.raises(exc, match=match) as info:
        apply_activation_checkpointing(model, **kwargs)
    assert structure(model) == before
    assert checkpointed_blocks(model) == {}
    return info


def test_unknown_type_lists_the_valid_ones():
    info = _raises_and_unchanged(
        toy_case().model,
        ValueError,
        "unknown checkpointing type 'selective'",
        checkpointing_type="selective",
        blocks=["layers"],
    )
    for valid in ("'full'", "'ops'", "'block_skip'"):
        assert valid in str(info.value)


@pytest.mark.parametrize("n_layer", [0, -1, 1.5, True])
def test_bad_n_layer(n_layer):
    _raises_and_unchanged(
        toy_case().model,
        ValueError,
        "n_layer must be an int >= 1",
        checkpointing_type="block_skip",
        n_layer=n_layer,
        blocks=["layers"],
    )


def test_missing_container_names_adapter_path_and_the_models_module_lists():
    info = _raises_and_unchanged(
        toy_case().model,
        AdapterError,
        "'toy_variant' names block container 'blocks'",
        adapter=_toy_spec(containers=("layers", "blocks")),
    )
    assert "'layers'" in str(info.value)


def test_missing_container_with_blocks_argument():
    _raises_and_unchanged(
        toy_case().model,
        AdapterError,
        r"blocks= names block container 'model.layers'.*\['layers'",
        blocks=["model.layers"],
    )


def test_container_that_is_not_a_module_list():
    _raises_and_unchanged(toy_case().model, AdapterError, "'embed' .* is a Linear, not a ModuleList", blocks=["embed"])


class _BlocksModel(nn.Module):
    """Its one list of repeated blocks is ``blocks``; ``head`` is a small Sequential, not one."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ToyBlock(8, 2) for _ in range(2))
        self.head = nn.Sequential(nn.Linear(8, 8), nn.ReLU())


def test_model_no_adapter_serves_lists_adapters_and_its_lists_of_repeated_blocks():
    info = _raises_and_unchanged(_BlocksModel(), AdapterError, "no registered adapter serves")
    message = str(info.value)
    assert "its ModuleLists of repeated blocks are ['blocks']" in message
    assert "apply_activation_checkpointing(model, 'full', blocks=['blocks'])" in message
    assert "registered adapters" in message and "'layers'" not in message
    info = _raises_and_unchanged(nn.Sequential(nn.Linear(2, 2)), AdapterError, "no registered adapter serves")
    assert "Sequential has no ModuleList, ModuleDict or Sequential of repeated blocks" in str(info.value)


def test_unknown_adapter_name():
    _raises_and_unchanged(toy_case().model, AdapterError, "no adapter named 'nope'", adapter="nope")


def test_adapter_that_does_not_serve_the_model():
    other = AdapterSpec(name="other", models=(ModelSpec(cls="pkg.Other", containers=("layers",)),))
    _raises_and_unchanged(toy_case().model, AdapterError, "'other' does not serve ToyTransformer", adapter=other)


class _OwnToy(nn.Module):
    """Another framework's class named like a served one: same name as ac_core.testing.ToyTransformer, own module."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ToyBlock(8, 2) for _ in range(2))


_OwnToy.__name__ = _OwnToy.__qualname__ = "ToyTransformer"


def test_same_named_class_of_another_module_names_both_paths():
    info = _raises_and_unchanged(_OwnToy(), AdapterError, "'toy' does not serve ToyTransformer: ", adapter=TOY_ADAPTER)
    message = str(info.value)
    assert (
        f"this model is {__name__}.ToyTransformer; adapter 'toy' serves ac_core.testing.ToyTransformer, a " in message
    )
    assert "different class of the same name; pass the right adapter, or name the containers with blocks=[" in message
    assert "block containers are ['blocks']" in message
    assert "(it serves" not in message


class WanTransformer3DModel(nn.Module):
    """As FastVideo's own Wan class: the name of the class the wan adapter serves, in another module."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ToyBlock(8, 2) for _ in range(2))


def test_same_named_wan_class_of_another_framework_names_both_paths():
    pytest.importorskip("diffusers")
    pytest.importorskip("ac_core_adapters")
    theirs = f"{__name__}.WanTransformer3DModel"
    ours = "diffusers.models.transformers.transformer_wan.WanTransformer3DModel"
    for call in (ac_core.resolve_blocks, apply_activation_checkpointing):
        with pytest.raises(AdapterError, match="'wan' does not serve WanTransformer3DModel: ") as info:
            call(WanTransformer3DModel(), adapter="wan")
        assert f"this model is {theirs}; adapter 'wan' serves {ours}, a different class of the same name" in str(
            info.value
        )
    wrapped = nn.Module()
    wrapped.module = WanTransformer3DModel()  # a wrapper whose one child is `module`, as DDP's
    with pytest.raises(AdapterError, match=f"the model it wraps at 'module' is {theirs}; adapter 'wan' serves {ours}"):
        ac_core.resolve_blocks(wrapped, adapter="wan")


def test_nothing_matched():
    model = toy_case().model
    model.extra = nn.ModuleList()
    _raises_and_unchanged(model, AdapterError, "matched no block", blocks=["extra"])


def test_blocks_must_be_a_list():
    _raises_and_unchanged(toy_case().model, TypeError, r"blocks=\['layers'\]", blocks="layers")


def test_a_wait_or_an_in_place_collective_cannot_be_retained():
    for op in ("_c10d_functional::wait_tensor", "c10d::allgather_"):
        _raises_and_unchanged(
            toy_case().model,
            ValueError,
            "cannot be kept: only a functional collective",
            checkpointing_type="ops",
            blocks=["layers"],
            retain={op},
        )


def test_unsupported_library_version():
    spec = _toy_spec(versions="torch<2.0")
    info = _raises_and_unchanged(toy_case().model, UnsupportedVersionError, "torch<2.0", adapter=spec)
    assert torch.__version__.split("+")[0] in str(info.value) and "blocks=" in str(info.value)


def test_torch_checkpoint_wrapper_is_refused():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = toy_case().model
    model.layers[1] = checkpoint_wrapper(model.layers[1])
    _raises_and_unchanged(
        model,
        ConflictingCheckpointError,
        "layers.1 is wrapped by torch's checkpoint_wrapper",
        blocks=["layers"],
    )


def test_composable_checkpoint_is_refused():
    from torch.distributed._composable import checkpoint

    model = toy_case().model
    checkpoint(model.layers[0])
    _raises_and_unchanged(
        model,
        ConflictingCheckpointError,
        "layers.0 is checkpointed by torch.distributed._composable",
        blocks=["layers"],
    )


class _LibraryStyleModel(ToyTransformer):
    """Mimics diffusers' ModelMixin: a gradient_checkpointing flag per block and a disable method."""

    def __init__(self) -> None:
        super().__init__(depth=2)
        for block in self.layers:
            block.gradient_checkpointing = True
        self.disabled = 0

    def disable_gradient_checkpointing(self) -> None:
        self.disabled += 1
        for block in self.layers:
            block.gradient_checkpointing = False


def test_library_checkpointing_is_turned_off_and_said(caplog):
    model = _LibraryStyleModel()
    with caplog.at_level(logging.WARNING, logger="ac_core"):
        apply_activation_checkpointing(model, "full", blocks=["layers"])
    assert model.disabled == 1
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    assert "model.disable_gradient_checkpointing()" in caplog.text
    assert len(checkpointed_blocks(model)) == 2


def test_errors_are_value_errors():
    for exc in (AdapterError, ConflictingCheckpointError, UnsupportedVersionError):
        assert issubclass(exc, ValueError)
    assert ac_core.get_adapter(TOY_ADAPTER) is TOY_ADAPTER
