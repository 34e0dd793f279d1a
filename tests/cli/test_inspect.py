"""``ac-core inspect``: containers, block counts, retained ops per block, backends, versions, skips."""

from __future__ import annotations

import dataclasses
import re

import pytest

from ac_core import register_adapter, registered_adapters
from ac_core.cli import main
from ac_core.registry import unregister_adapter
from ac_core.testing import TOY_ADAPTER
from tests.cli.fakes import GHOST


def _inspect(capsys, *args: str) -> str:
    assert main(["inspect", *args]) == 0
    return capsys.readouterr().out


def test_toy(capsys):
    out = _inspect(capsys, "toy")
    assert "block containers (tiny config, on CPU):\n    layers: 4 x ToyBlock" in out
    assert "library version: any" in out
    assert "excluded containers:\n    none" in out
    assert "ToyBlock: 1 attention call(s) declared; keeps aten::_scaled_dot_product_flash_attention_for_cpu x1" in out
    assert re.search(r"sdpa \(default\): retainable, runs here on cpu.*; ops: .*_for_cpu", out)
    assert "math: not retainable, runs here on cpu: matmul and softmax in Python" in out


def test_by_model_class_and_preset_on_meta(capsys):
    out = _inspect(capsys, "ToyTransformer", "--preset", "toy-wide")
    assert "block containers (preset toy-wide, built on the meta device):\n    layers: 4 x ToyBlock" in out


def test_missing_library_is_skipped_with_the_install_command(capsys):
    register_adapter(GHOST)
    try:
        out = _inspect(capsys, "ghost")
    finally:
        unregister_adapter(GHOST.name)
    assert "skipped: ac-core-ghost-library is not installed: pip install 'ac-core[ghost]'" in out
    assert "GhostTransformer: block containers (declared) blocks" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["nothing"], "unknown adapter or model class 'nothing'; adapters: all, "),
        (["toy", "--preset", "huge"], "unknown preset 'huge'; valid values: tiny, toy-wide"),
    ],
)
def test_bad_input(args, message, capsys):
    assert main(["inspect", *args]) == 2
    assert message in capsys.readouterr().err


def test_flux_lists_single_transformer_blocks(capsys):
    pytest.importorskip("diffusers")
    if "flux" not in registered_adapters():
        pytest.skip("the flux adapter is not installed")
    out = _inspect(capsys, "flux")
    assert re.search(r"single_transformer_blocks: [1-9]\d* x FluxSingleTransformerBlock", out)
    assert "FluxSingleTransformerBlock: 1 attention call(s) declared; keeps aten::" in out


def _toy_two_blocks():
    from ac_core.testing import toy_case

    return toy_case(depth=2)


TWICE = dataclasses.replace(
    TOY_ADAPTER,
    name="twice",
    models=(
        TOY_ADAPTER.models[0],
        dataclasses.replace(TOY_ADAPTER.models[0], tiny=_toy_two_blocks, attention_calls={"ToyBlock": {0: 1, 1: 1}}),
    ),
)
"""The toy class declared twice (two tiny variants), the second with per-index attention calls."""


def test_a_class_declared_twice_gets_two_headings_and_per_index_calls(capsys):
    out = _inspect(capsys, "tests.cli.test_inspect:TWICE")
    assert "ToyTransformer-toy_case  (" in out
    assert "ToyTransformer-_toy_two_blocks  (" in out
    assert "layers: 2 x ToyBlock" in out
    assert "ToyBlock: by block index 0: 1, 1: 1, attention call(s) declared; keeps " in out


def toy_inputs(model):
    import torch

    return {"x": torch.randn(2, 8, 64)}


def test_module_class_where_probing_fails_asks_for_an_inputs_function(capsys):
    assert main(["inspect", "ac_core.testing:ToyTransformer"]) == 2
    err = capsys.readouterr().err
    assert "no input derived from the signature of ToyTransformer.forward ran it" in err
    assert "it takes x)" in err
    assert "pass --inputs module:function, a function(model) returning forward's keyword arguments" in err


def test_module_class_of_a_served_class_names_its_adapter(capsys):
    out = _inspect(capsys, "ac_core.testing:ToyTransformer", "--inputs", "tests.cli.test_inspect:toy_inputs")
    assert "inputs: from tests.cli.test_inspect:toy_inputs" in out
    assert "served by adapter(s) toy: ac-core inspect toy" in out
    assert "layers: 4 x ToyBlock" in out
    assert "ToyBlock: 1 call(s); ran aten::_scaled_dot_product_flash_attention_for_cpu x1 per block" in out
    assert "no backend switch found" in out


def test_module_class_served_by_the_library_route_or_refused_by_it(capsys):
    pytest.importorskip("transformers")
    out = _inspect(capsys, "transformers:Qwen3ForCausalLM")
    assert "served by the transformers library route: derived from what the class declares" in out
    assert (
        "block containers (tiny config):\n  model.layers: 2 x Qwen3DecoderLayer\n  excluded containers:\n    none"
        in out
    )
    assert "no adapter serves it" not in out
    out = _inspect(capsys, "transformers:OpenAIGPTLMHeadModel")
    assert "the transformers library route does not serve it: it declares no block class" in out
    assert "no adapter serves it: this is what one must declare" in out
