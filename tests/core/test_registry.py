"""Adapters are found by entry point, by code registration, by name and by model class."""

from __future__ import annotations

import logging
from importlib.metadata import EntryPoint

import pytest

import ac_core
from ac_core import (
    AdapterError,
    AdapterSpec,
    ModelSpec,
    get_adapter,
    register_adapter,
    registry,
)
from ac_core.registry import unregister_adapter
from ac_core.testing import TOY_ADAPTER, ToyTransformer, toy_case


@pytest.fixture
def toy_registered():
    register_adapter(TOY_ADAPTER)
    yield TOY_ADAPTER
    unregister_adapter("toy")


def test_found_by_model_and_by_name(toy_registered):
    assert get_adapter(toy_case().model) is toy_registered
    assert get_adapter(ToyTransformer) is toy_registered
    assert get_adapter("toy") is toy_registered


def test_adapter_none_uses_the_registry(toy_registered):
    case = toy_case(depth=2)
    ac_core.apply_activation_checkpointing(case.model, "ops")
    assert set(ac_core.checkpointed_blocks(case.model)) == {"layers.0", "layers.1"}


def test_subclass_of_a_served_class_is_served(toy_registered):
    class MyToy(ToyTransformer):
        pass

    assert get_adapter(MyToy) is toy_registered


def test_duplicate_name_needs_replace(toy_registered):
    twin = AdapterSpec(name="toy", models=TOY_ADAPTER.models)
    with pytest.raises(AdapterError, match="already registered; pass replace=True"):
        register_adapter(twin)
    register_adapter(twin, replace=True)
    assert get_adapter("toy") is twin


def test_two_adapters_serving_one_class_is_an_error(toy_registered):
    register_adapter(AdapterSpec(name="toy2", models=TOY_ADAPTER.models))
    try:
        with pytest.raises(AdapterError, match=r"served by several adapters \['toy', 'toy2'\]"):
            get_adapter(ToyTransformer)
    finally:
        unregister_adapter("toy2")


def test_register_rejects_non_spec():
    with pytest.raises(TypeError, match="takes an AdapterSpec"):
        register_adapter({"name": "x"})


def _entry_points(*eps: EntryPoint):
    return lambda group: [ep for ep in eps if ep.group == group]


def test_entry_points_are_loaded(monkeypatch):
    good = EntryPoint("toy", "ac_core.testing:TOY_ADAPTER", registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry, "entry_points", _entry_points(good))
    monkeypatch.setattr(registry, "_registry", {})
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    assert registry.registered_adapters() == {"toy": TOY_ADAPTER}


def test_broken_entry_point_is_skipped_with_a_warning(monkeypatch, caplog):
    eps = (
        EntryPoint("broken", "no_such_module_xyz:SPEC", registry.ENTRY_POINT_GROUP),
        EntryPoint("wrong", "ac_core.testing:toy_case", registry.ENTRY_POINT_GROUP),
        EntryPoint("toy", "ac_core.testing:TOY_ADAPTER", registry.ENTRY_POINT_GROUP),
    )
    monkeypatch.setattr(registry, "entry_points", _entry_points(*eps))
    monkeypatch.setattr(registry, "_registry", {})
    monkeypatch.setattr(registry, "_failed", {})
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    with caplog.at_level(logging.WARNING, logger="ac_core"):
        assert list(registry.registered_adapters()) == ["toy"]
    assert "'broken'" in caplog.text and "failed to load" in caplog.text
    assert "'wrong'" in caplog.text and "not an AdapterSpec" in caplog.text
    # Asked for by name later, the adapter's own load error is said again, not "no adapter named".
    with pytest.raises(AdapterError, match=r"adapter 'broken' is installed but its entry point .* ModuleNotFoundError"):
        registry.get_adapter("broken")
    with pytest.raises(AdapterError, match=r"adapter 'wrong' is installed but .* gave a ModelCase, not an AdapterSpec"):
        registry.get_adapter("wrong")


def test_spec_matching_by_short_import_path():
    spec = ModelSpec(cls="ac_core.ToyTransformer", containers=("layers",))
    assert spec.matches(ToyTransformer)
    assert not ModelSpec(cls="other.ToyTransformer", containers=("layers",)).matches(ToyTransformer)
