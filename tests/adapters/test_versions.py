"""A library version outside what an adapter verified gets UnsupportedVersionError, and the model is left alone."""

from __future__ import annotations

import pytest

from ac_core import UnsupportedVersionError, apply_activation_checkpointing, checkpointed_blocks, get_adapter
from ac_core import versions as ac_versions

from .cases import served

_OUTSIDE = {"diffusers": "0.40.0", "transformers": "4.57.6"}
_INSIDE = {"diffusers": "0.42.1", "transformers": "5.24.0"}


def _installed(versions):
    def version(distribution: str) -> str:
        return versions[distribution]

    return version


@pytest.mark.parametrize(("spec", "model_spec"), list(served()))
def test_an_unverified_version_is_refused_clearly(spec, model_spec, monkeypatch):
    case = model_spec.build_tiny()
    names = [n for n, _ in case.model.named_parameters()]
    monkeypatch.setattr(ac_versions, "version", _installed(_OUTSIDE))
    with pytest.raises(UnsupportedVersionError) as error:
        apply_activation_checkpointing(case.model, "ops")
    message = str(error.value)
    assert model_spec.class_name in message and _OUTSIDE[spec.library] in message
    assert f"ac-core[{spec.extra}]" in message and "blocks=" in message
    assert checkpointed_blocks(case.model) == {}
    assert [n for n, _ in case.model.named_parameters()] == names

    monkeypatch.setattr(ac_versions, "version", _installed(_INSIDE))
    apply_activation_checkpointing(case.model, "ops")
    assert checkpointed_blocks(case.model)


def test_versions_name_the_right_library():
    for param in served():
        spec, model_spec = param.values
        assert model_spec.versions.startswith(spec.library)


def test_a_class_new_in_a_version_is_refused_below_it_and_only_it(monkeypatch):
    monkeypatch.setattr(ac_versions, "version", _installed({"diffusers": "0.41.0"}))
    supported = {m.class_name: ac_versions.version_supported(m.versions)[0] for m in get_adapter("wan").models}
    assert supported == {
        "WanTransformer3DModel": True,
        "WanVACETransformer3DModel": True,
        "WanAnimateTransformer3DModel": True,
        "WanAnimate2Transformer3DModel": False,
    }


def test_each_extra_installs_only_versions_its_adapter_verified():
    """``pip install 'ac-core[llama]'`` (the fix the refusal names) must not install a release the adapter refuses."""
    tomllib = pytest.importorskip("tomllib")
    from pathlib import Path

    from packaging.requirements import Requirement

    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    extras = extras["optional-dependencies"]
    for param in served():
        spec, model_spec = param.values
        required = [Requirement(r) for r in extras[spec.extra] if Requirement(r).name == spec.library]
        assert required, f"extra {spec.extra!r} does not install {spec.library}"
        declared = Requirement(model_spec.versions)
        ceiling = {s.version for s in required[0].specifier if s.operator == "<"}
        assert ceiling == {s.version for s in declared.specifier if s.operator == "<"}, (spec.extra, model_spec.cls)
