"""The adapter contract validates itself when built."""

from __future__ import annotations

import pytest
import torch

from ac_core import AdapterError, AdapterSpec, AttentionBackend, ContextParallel, ExcludedContainer, ModelSpec

MODEL = ModelSpec(cls="pkg.Model", containers=["layers"])


def test_lists_become_tuples_and_mappings_are_read_only():
    spec = ModelSpec(cls="pkg.Model", containers=["layers"], attention_calls={"Block": 2})
    assert spec.containers == ("layers",)
    with pytest.raises(TypeError):
        spec.attention_calls["Block"] = 3  # type: ignore[index]
    with pytest.raises(AttributeError):
        spec.cls = "x"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": "sdpa"}, "either ops .* or not_retainable"),
        ({"name": "sdpa", "ops": ("aten::x",), "not_retainable": "why"}, "not both"),
        ({"name": "x", "ops": ("_c10d_functional::all_gather_into_tensor",)}, "collective"),
        ({"name": "", "ops": ("aten::x",)}, "non-empty"),
        ({"name": "x", "ops": ("",)}, "non-empty strings"),
    ],
)
def test_backend_validation(kwargs, match):
    with pytest.raises(AdapterError, match=match):
        AttentionBackend(**kwargs)


def test_backend_availability():
    cpu_only = AttentionBackend("a", ops=("aten::x",), devices=("cpu",))
    assert cpu_only.is_available("cpu") and not cpu_only.is_available(torch.device("cuda"))
    missing = AttentionBackend("b", ops=("x::y",), requires=("no_such_module_xyz",))
    assert not missing.is_available("cpu")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cls": "Model", "containers": ["layers"]}, "import string"),
        ({"cls": "pkg.Model", "containers": []}, "no block containers"),
        ({"cls": "pkg.Model", "containers": ["a"], "excluded": [ExcludedContainer("a", "why")]}, "both"),
        ({"cls": "pkg.Model", "containers": ["a"], "attention_calls": {"B": -1}}, "int >= 0"),
    ],
)
def test_model_spec_validation(kwargs, match):
    with pytest.raises(AdapterError, match=match):
        ModelSpec(**kwargs)


def test_excluded_needs_reason():
    with pytest.raises(AdapterError, match="reason"):
        ExcludedContainer("refiner", "")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": "x y", "models": [MODEL]}, "non-empty word"),
        ({"name": "x", "models": []}, "serves no model"),
        ({"name": "x", "models": [MODEL], "backends": [AttentionBackend("a", ops=("n::o",))] * 2}, "twice"),
        ({"name": "x", "models": [MODEL], "default_backend": "flash"}, "not among its backends"),
        ({"name": "x", "models": [MODEL], "activation_collectives": ["_c10d_functional::wait_tensor"]}, "the wait"),
        ({"name": "x", "models": [MODEL], "activation_collectives": ["c10d::allgather_"]}, "not functional"),
        ({"name": "x", "models": [MODEL], "context_parallel": ("ulysses",)}, "must be a ContextParallel"),
    ],
)
def test_adapter_spec_validation(kwargs, match):
    with pytest.raises(AdapterError, match=match):
        AdapterSpec(**kwargs)


def test_retained_ops_and_backend_lookup():
    spec = AdapterSpec(
        name="x",
        models=[MODEL],
        backends=[AttentionBackend("a", ops=("n::o", "n::p")), AttentionBackend("m", not_retainable="math")],
        default_backend="a",
        extra="x",
    )
    assert spec.retained_ops() == {"n::o", "n::p"}
    assert not spec.backend("m").retainable
    assert spec.install_hint == "pip install 'ac-core[x]'"
    with pytest.raises(AdapterError, match="no attention backend 'zzz'"):
        spec.backend("zzz")


def test_activation_collectives_default_to_the_all_to_all_and_context_parallel_is_validated():
    spec = AdapterSpec(name="x", models=[MODEL])
    assert spec.activation_collectives == ("_c10d_functional::all_to_all_single",)
    assert spec.context_parallel is None
    with pytest.raises(AdapterError, match="at least one mode"):
        ContextParallel((), enable=lambda model, mode: None, shard=dict)
    with pytest.raises(AdapterError, match="callables"):
        ContextParallel(("ring",), enable="x", shard=dict)  # type: ignore[arg-type]
    assert ContextParallel(["ring"], enable=lambda model, mode: None, shard=dict).modes == ("ring",)  # type: ignore[arg-type]  # a list becomes a tuple


def variant() -> None:
    """A tiny factory's name labels a class declared twice."""


def test_model_label_tells_a_class_declared_twice_apart():
    twin = ModelSpec(cls="pkg.Model", containers=["blocks"], tiny=variant)
    other = ModelSpec(cls="pkg.Other", containers=["layers"])
    spec = AdapterSpec(name="x", models=[MODEL, twin, other])
    assert [spec.model_label(m) for m in spec.models] == ["Model", "Model-variant", "Other"]
