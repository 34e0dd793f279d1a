"""Our adapters register through the entry-point group, import lean, and declare every backend their library has."""

from __future__ import annotations

import inspect
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from ac_core import ENTRY_POINT_GROUP, AdapterSpec, get_adapter
from ac_core.libraries import diffusers as diffusers_lib
from ac_core.libraries import transformers as transformers_lib

from .cases import ADAPTERS, served


def test_entry_points_load_all_four_specs():
    found = {ep.name: ep.load() for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name in ADAPTERS}
    assert sorted(found) == sorted(ADAPTERS)
    for name, spec in found.items():
        assert isinstance(spec, AdapterSpec)
        assert spec.name == name
        assert get_adapter(name) is spec
        assert spec.extra == name
        assert spec.default_backend in {b.name for b in spec.backends}


def test_adapter_modules_import_no_library():
    code = (
        "import sys\n"
        "import ac_core_adapters.wan, ac_core_adapters.hunyuan, ac_core_adapters.flux, ac_core_adapters.llama\n"
        "import ac_core_adapters.models.wan, ac_core_adapters.models.hunyuan, ac_core_adapters.models.flux\n"
        "import ac_core_adapters.models.llama\n"
        "import ac_core.libraries.diffusers, ac_core.libraries.transformers, ac_core\n"
        "ac_core.registered_adapters()\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'diffusers', 'transformers'}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize(("spec", "model_spec"), list(served()))
def test_the_model_class_finds_its_adapter(spec, model_spec):
    case = model_spec.build_tiny()
    assert get_adapter(case.model) is spec
    assert spec.model_spec(case.model).containers == model_spec.containers


def test_every_diffusers_dispatcher_backend_is_declared_or_explained():
    dispatch = pytest.importorskip("diffusers.models.attention_dispatch")
    upstream = {b.value for b in dispatch.AttentionBackendName}
    declared = {b.name for b in diffusers_lib.BACKENDS}
    assert not declared & set(diffusers_lib.INFERENCE_ONLY)
    assert declared | set(diffusers_lib.INFERENCE_ONLY) == upstream


def test_every_transformers_attention_implementation_is_declared():
    utils = pytest.importorskip("transformers.modeling_utils")
    upstream = {"eager", *utils.ALL_ATTENTION_FUNCTIONS.valid_keys()} - {"paged|eager"}  # paged: serving only
    assert {b.name for b in transformers_lib.BACKENDS} == upstream


def test_hunyuan_declares_the_trainable_backends_whose_dispatcher_accepts_a_mask():
    dispatch = pytest.importorskip("diffusers.models.attention_dispatch")
    rejects = {
        name.value
        for name, function in dispatch._AttentionBackendRegistry._backends.items()
        if "`attn_mask` is not supported" in inspect.getsource(function)
    }
    assert "_native_flash" in rejects and "native" not in rejects
    trainable = {b.name for b in diffusers_lib.BACKENDS}
    assert {b.name for b in get_adapter("hunyuan").backends} == trainable - rejects
    assert {b.name for b in get_adapter("wan").backends} == trainable == {b.name for b in get_adapter("flux").backends}
