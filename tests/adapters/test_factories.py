"""Adapters as data: each adapter module is its AdapterSpec, naming its tiny models and presets by ``"module:attr"``
in ``ac_core_adapters.models.<adapter>``, with the same names across adapters."""

from __future__ import annotations

import ast
import importlib
import inspect

import pytest

from ac_core import AdapterError, AdapterSpec, ModelSpec, get_adapter
from ac_core.testing import TOY_ADAPTER, toy_case

from .cases import ADAPTERS


@pytest.mark.parametrize("name", ADAPTERS)
def test_an_adapter_module_defines_no_code(name):
    module = importlib.import_module(f"ac_core_adapters.{name}")
    tree = ast.parse(inspect.getsource(module))
    code = [node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
    assert code == [], f"ac_core_adapters.{name} defines {code}; they belong in ac_core_adapters.models.{name}"


@pytest.mark.parametrize("name", ADAPTERS)
def test_factories_are_references_into_the_models_module(name):
    spec = get_adapter(name)
    models = f"ac_core_adapters.models.{name}"
    assert spec.token_count is importlib.import_module(models).token_count
    for model_spec in spec.models:
        references = {model_spec.tiny: "tiny_", **{ref: "preset_" for ref in model_spec.presets.values()}}
        for ref, prefix in references.items():
            assert isinstance(ref, str), ref
            module, _, attr = ref.partition(":")
            assert module == models and attr.startswith(prefix), ref
    assert {m.tiny_name for m in spec.models} == {m.tiny.rpartition(":")[2] for m in spec.models}


def _toy_model(**fields) -> ModelSpec:
    return ModelSpec(cls=TOY_ADAPTER.models[0].cls, containers=("layers",), **fields)


def test_a_reference_is_loaded_only_when_used():
    model = _toy_model(tiny="ac_core.testing:toy_case", presets={"wide": "ac_core.testing:toy_wide"})
    assert model.tiny_name == "toy_case"
    assert type(model.build_tiny().model).__name__ == "ToyTransformer"
    assert model.preset("wide").__name__ == "toy_wide"


def test_callables_keep_working():
    model = _toy_model(tiny=toy_case, presets={"wide": toy_case})
    assert model.tiny_name == "toy_case"
    assert model.build_tiny().model is not None
    assert model.preset("wide") is toy_case


@pytest.mark.parametrize("tiny", ["toy_case", "ac_core.testing", 3])
def test_a_malformed_factory_is_refused_when_declared(tiny):
    with pytest.raises(AdapterError, match=r"tiny must be a callable or a 'package.module:attribute' string"):
        _toy_model(tiny=tiny)
    with pytest.raises(AdapterError, match=r"presets\['x'\] must be a callable"):
        _toy_model(presets={"x": tiny})


def test_a_reference_that_does_not_resolve_names_itself_when_used():
    model = _toy_model(tiny="ac_core.testing:no_such_factory", presets={"x": "ac_core.testing:DEFAULT_RETAINED_OPS"})
    with pytest.raises(AdapterError, match=r"tiny factory of ToyTransformer .* has no attribute 'no_such_factory'"):
        model.build_tiny()
    with pytest.raises(AdapterError, match=r"preset 'x' of ToyTransformer .* is a frozenset, not a callable"):
        model.preset("x")
    with pytest.raises(AdapterError, match=r"has no preset 'y'; its presets are \['x'\]"):
        model.preset("y")
    with pytest.raises(AdapterError, match="declares no tiny factory"):
        _toy_model().build_tiny()


def test_model_label_tells_variants_apart_by_the_referenced_name():
    first = _toy_model(tiny="ac_core.testing:toy_case")
    second = _toy_model(tiny="ac_core.testing:toy_wide")
    adapter = AdapterSpec(name="twice", models=(first, second))
    assert [adapter.model_label(m) for m in adapter.models] == ["ToyTransformer-toy_case", "ToyTransformer-toy_wide"]
