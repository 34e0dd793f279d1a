"""``ac-core inspect module:Class --draft --factory module:function``: a class whose constructor takes a config
object is built by the user's function, in the inspection and in the drafted tiny factory."""

from __future__ import annotations

import ast
import sys
import types

import pytest
import torch

from ac_core import resolve_blocks
from ac_core.cli import main
from tests.cli.fakes import ConfiguredPatchModel

CLASS = "tests.cli.fakes:ConfiguredPatchModel"
FACTORY = "tests.cli.fakes:tiny_configured_patch_model"


def _load(source: str, name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    sys.modules[name] = module
    exec(compile(source, f"<draft {name}>", "exec"), module.__dict__)
    return module


def test_a_config_object_constructor_fails_without_a_factory(capsys):
    assert main(["inspect", CLASS]) == 2
    err = capsys.readouterr().err
    assert "could not build ConfiguredPatchModel from the derived tiny config {}" in err
    assert "missing 1 required positional argument: 'config'" in err
    assert "--factory module:function returning the built tiny model" in err


def test_the_draft_builds_the_model_by_the_factory_and_resolves_its_blocks(capsys):
    assert main(["inspect", CLASS, "--draft", "--factory", FACTORY]) == 0
    source = capsys.readouterr().out
    ast.parse(source)
    assert "    from tests.cli.fakes import tiny_configured_patch_model\n" in source
    assert "    model = tiny_configured_patch_model()\n" in source
    assert "ConfiguredPatchModel(" not in source  # built by the factory, not from a config
    assert f"`ac-core inspect {CLASS} --draft --factory {FACTORY}`" in source
    module = _load(source, "drafted_configured_patch")
    adapter = module.CONFIGURED_PATCH_ADAPTER
    assert adapter.models[0].cls == "tests.cli.fakes.ConfiguredPatchModel"
    case = adapter.models[0].build_tiny()
    assert type(case.model) is ConfiguredPatchModel
    assert case.model.config.layers == 3  # the factory's, not the class's default of 2
    blocks = resolve_blocks(case.model, adapter)
    assert [block.path for block in blocks] == ["blocks.0", "blocks.1", "blocks.2"]
    assert case.run().ndim == 0
    # 2 samples of 8x8 latents in patches of 2x2.
    assert tuple(case.inputs["hidden_states"].shape) == (2, 4, 8, 8)
    assert module.token_count(case.model, case.inputs) == 2 * 4 * 4


def test_the_report_names_the_factory(capsys):
    assert main(["inspect", CLASS, "--factory", FACTORY]) == 0
    out = capsys.readouterr().out
    assert f"tiny model: built by {FACTORY}" in out
    assert "blocks: 3 x ToyBlock" in out
    tokens = "tokens per forward: 32 on the tiny inputs: hidden_states by patch_embed (Conv2d, one per patch (2, 2))"
    assert tokens in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            [CLASS, "--factory", FACTORY, "--config", "{}"],
            "pass --config or --factory, not both: the factory builds the model, no config reaches it",
        ),
        (
            [CLASS, "--factory", "tests.cli.fakes:NOT_A_FUNCTION"],
            "--factory 'tests.cli.fakes:NOT_A_FUNCTION' is a int, not a function",
        ),
        (
            [CLASS, "--factory", "tests.cli.fakes:not_the_class"],
            "--factory 'tests.cli.fakes:not_the_class' returned a Linear, not a ConfiguredPatchModel",
        ),
        ([CLASS, "--factory", "tests.cli.fakes:missing"], "'tests.cli.fakes' has no attribute 'missing'"),
        (["toy", "--factory", FACTORY], "--factory only work with a model class"),
    ],
    ids=["with-config", "not-callable", "wrong-class", "missing", "adapter-target"],
)
def test_bad_factory(args, message, capsys):
    assert main(["inspect", *args]) == 2
    assert message in capsys.readouterr().err


BUILT: list[torch.nn.Module] = []


def tiny_sd3():
    """An SD3 of 3 blocks, built by a function; records each model it builds."""
    from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel

    from ac_core.libraries.configs import derived_config

    BUILT.append(SD3Transformer2DModel(**{**derived_config(SD3Transformer2DModel), "num_layers": 3}))
    return BUILT[-1]


def test_backends_are_probed_on_models_the_factory_builds(capsys):
    pytest.importorskip("diffusers")
    BUILT.clear()
    factory = "tests.cli.test_draft_factory:tiny_sd3"
    assert main(["inspect", "diffusers:SD3Transformer2DModel", "--factory", factory]) == 0
    out = capsys.readouterr().out
    assert "transformer_blocks: 3 x JointTransformerBlock" in out
    tried = out.count("(tried on CPU)")
    assert tried >= 2  # native and _native_math at least
    assert len(BUILT) == 1 + tried  # one to inspect, one per backend tried
