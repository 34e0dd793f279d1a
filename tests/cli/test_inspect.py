"""``ac-core inspect``: containers, block counts, retained ops per block, backends, versions, skips."""

from __future__ import annotations

import re

import pytest

from ac_core import register_adapter, registered_adapters, unregister_adapter
from ac_core.cli import main
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
