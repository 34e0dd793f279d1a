"""Declared class builds: an entry's settings go over the derived config, its inputs are tried first and a probe
falls back to derived inputs when they do not run; every entry names a class, settings and inputs that exist."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
from torch import nn

from ac_core.libraries import class_builds
from ac_core.libraries.class_builds import CLASS_BUILDS, ClassBuild, qualified_name
from ac_core.libraries.configs import derived_config, library_of
from ac_core.libraries.input_spec import TensorInput
from ac_core.libraries.inputs import InputsError, probe_inputs

diffusers = pytest.importorskip("diffusers")


class _TakesWidth(diffusers.ModelMixin, diffusers.ConfigMixin):
    @diffusers.configuration_utils.register_to_config
    def __init__(self, in_channels: int = 4, num_layers: int = 28, scale: float = 1.0):
        super().__init__()
        self.proj_in = nn.Linear(in_channels, 8)

    def forward(self, hidden_states: torch.Tensor, step_count: int):
        if hidden_states.shape[1] != 6 or step_count != 3:
            raise ValueError("needs 6 tokens and step_count=3")
        return self.proj_in(hidden_states)


class Plain(diffusers.ModelMixin, diffusers.ConfigMixin):
    @diffusers.configuration_utils.register_to_config
    def __init__(self, in_channels: int = 4):
        super().__init__()
        self.proj_in = nn.Linear(in_channels, 8)

    def forward(self, hidden_states: torch.Tensor):
        return self.proj_in(hidden_states)


_DECLARED = ClassBuild(
    why="test",
    config={"scale": 0.5},
    inputs={"hidden_states": TensorInput("randn", (2, 6, 4)), "step_count": 3},
)


@pytest.fixture
def declared(monkeypatch: pytest.MonkeyPatch) -> ClassBuild:
    monkeypatch.setitem(class_builds.CLASS_BUILDS, qualified_name(_TakesWidth), _DECLARED)
    return _DECLARED


def test_declared_settings_go_over_the_derived_ones(declared: ClassBuild):
    assert derived_config(_TakesWidth) == {"num_layers": 2, "scale": 0.5}


def test_declared_inputs_run_where_probed_ones_do_not(declared: ClassBuild, monkeypatch: pytest.MonkeyPatch):
    model = _TakesWidth()
    assert probe_inputs(model) == declared.inputs
    monkeypatch.delitem(class_builds.CLASS_BUILDS, qualified_name(_TakesWidth))
    with pytest.raises(InputsError, match=r"_TakesWidth\.forward"):
        probe_inputs(model)


def test_declared_inputs_that_do_not_run_fall_back_to_probed_ones(monkeypatch: pytest.MonkeyPatch):
    stale = ClassBuild(why="test", inputs={"hidden_states": TensorInput("randn", (2, 6, 5))})
    monkeypatch.setitem(class_builds.CLASS_BUILDS, qualified_name(Plain), stale)
    spec = probe_inputs(Plain())
    assert spec != stale.inputs and spec["hidden_states"].shape[-1] == 4


def _entries() -> list[str]:
    return sorted(CLASS_BUILDS)


@pytest.mark.parametrize("name", _entries())
def test_every_entry_names_a_class_its_settings_and_its_inputs(name: str):
    module, _, class_name = name.rpartition(".")
    cls = getattr(importlib.import_module(module), class_name)
    build = CLASS_BUILDS[name]
    assert build.why
    settings = set(inspect.signature(cls.__init__).parameters)
    if library_of(cls) == "transformers":
        settings = set(cls.config_class().to_dict())
    assert set(build.config) <= settings, f"{name}: settings it does not take: {set(build.config) - settings}"
    if build.inputs is not None:
        params = set(inspect.signature(cls.forward).parameters)
        assert set(build.inputs) <= params, f"{name}: inputs its forward does not take: {set(build.inputs) - params}"
