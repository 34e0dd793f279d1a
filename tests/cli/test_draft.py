"""``ac-core inspect module:Class --draft``: a drafted adapter for a class no shipped adapter serves passes the
conformance coverage and attention checks as printed."""

from __future__ import annotations

import sys
import types

import pytest

from ac_core import Ops
from ac_core.cli import main
from ac_core.errors import AdapterError

pytest.importorskip("diffusers")
pytest.importorskip("ac_core_conformance")
from ac_core_conformance import Subject, check_attention_retained, check_coverage

SD35 = '{"dual_attention_layers": [0]}'  # SD3.5: block 0 makes two attention calls, block 1 one


def _draft(capsys, target: str, *args: str) -> str:
    assert main(["inspect", target, "--draft", *args]) == 0
    return capsys.readouterr().out


def _load(source: str, name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    sys.modules[name] = module  # the conformance suite may resolve the tiny factory again
    exec(compile(source, f"<draft {name}>", "exec"), module.__dict__)
    return module


@pytest.mark.parametrize(
    ("target", "config", "spec_name", "calls"),
    [
        ("diffusers:SD3Transformer2DModel", SD35, "SD3_ADAPTER", {"JointTransformerBlock": {0: 2, 1: 1}}),
        (
            "diffusers:ChromaTransformer2DModel",
            None,
            "CHROMA_ADAPTER",
            {"ChromaTransformerBlock": 1, "ChromaSingleTransformerBlock": 1},
        ),
    ],
    ids=["sd3.5", "chroma"],
)
def test_draft_passes_coverage_and_attention_checks(capsys, target, config, spec_name, calls):
    source = _draft(capsys, target, *(["--config", config] if config else []))
    module = _load(source, f"drafted_{spec_name.lower()}")
    adapter = getattr(module, spec_name)
    model = adapter.models[0]
    assert dict(model.attention_calls) == calls
    subject = Subject(adapter, model, adapter)
    report = check_coverage(subject, Ops())
    assert len(report.checkpointed) == 2 * len(model.containers)  # the tiny model has 2 blocks per container
    counts = check_attention_retained(subject, adapter.default_backend)
    assert counts.backward == 0
    assert counts.forward == sum(counts.per_block.values()) + counts.outside_blocks > 0


def test_sd3_draft_declares_the_sdpa_kernels_and_chroma_the_dispatcher(capsys):
    sd3 = _draft(capsys, "diffusers:SD3Transformer2DModel")
    assert 'cls="diffusers.SD3Transformer2DModel"' in sd3
    assert 'containers=("transformer_blocks",)' in sd3
    assert '"JointTransformerBlock": 1,' in sd3
    assert "call torch's SDPA themselves" in sd3
    assert 'AttentionBackend("sdpa", ops=tuple(sorted(DEFAULT_RETAINED_OPS)))' in sd3
    assert "set_backend=" not in sd3.split("AdapterSpec(")[1]
    assert "token_count=token_count" in sd3
    chroma = _draft(capsys, "diffusers:ChromaTransformer2DModel")
    assert 'containers=("transformer_blocks", "single_transformer_blocks")' in chroma
    assert "backends=attention_backends()" in chroma
    assert "set_backend=set_attention_backend" in chroma


def test_report_shows_per_index_calls_and_backend_reach(capsys):
    assert main(["inspect", "diffusers:SD3Transformer2DModel", "--config", SD35]) == 0
    out = capsys.readouterr().out
    assert "served by the diffusers library route: derived from what the class declares" in out
    assert "transformer_blocks: 2 x JointTransformerBlock" in out
    assert "JointTransformerBlock: differs by block, index -> calls 0: 2, 1: 1" in out
    assert "its processors call SDPA themselves" in out
    assert "_native_math (tried on CPU): aten::_scaled_dot_product_flash_attention_for_cpu" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["diffusers:SD3Transformer2DModel", "--config", '{"num_layers": "x"}'], "could not build"),
        (["diffusers:SD3Transformer2DModel", "--config", "[1]"], "--config must be a JSON object"),
        (["toy", "--draft"], "--draft only work with a model class"),
        (["SD3Transformer2DModel"], "ac-core inspect module:Class (e.g. diffusers:SD3Transformer2DModel)"),
    ],
)
def test_bad_input(args, message, capsys):
    assert main(["inspect", *args]) == 2
    assert message in capsys.readouterr().err


def test_inputs_function_when_probing_fails(capsys):
    out = _draft(capsys, "diffusers:SD3Transformer2DModel", "--inputs", "tests.cli.test_draft:sd3_inputs")
    assert "from tests.cli.test_draft import sd3_inputs as make_inputs" in out
    module = _load(out, "drafted_sd3_inputs")
    case = module.SD3_ADAPTER.models[0].build_tiny()
    assert case.run().ndim == 0


def sd3_inputs(model):
    import torch

    return {
        "hidden_states": torch.randn(1, model.config.in_channels, 8, 8),
        "encoder_hidden_states": torch.randn(1, 3, model.config.joint_attention_dim),
        "pooled_projections": torch.randn(1, model.config.pooled_projection_dim),
        "timestep": torch.tensor([3]),
        "return_dict": False,
    }


def test_per_index_attention_calls_are_validated():
    from ac_core import ModelSpec

    spec = ModelSpec(cls="pkg.Model", containers=("blocks",), attention_calls={"Block": {0: 2, 1: 1}})
    assert spec.calls_of("Block", 0) == 2
    assert spec.calls_of("Block", 1) == 1
    assert spec.calls_of("Block", 2) is None
    # By path where one class sits in several containers: the path wins over the index.
    by_path = ModelSpec(cls="pkg.Model", containers=("a", "b"), attention_calls={"Block": {"a.0": 1, "b.0": 2}})
    assert (by_path.calls_of("Block", 0, "a.0"), by_path.calls_of("Block", 0, "b.0")) == (1, 2)
    assert by_path.calls_of("Block", 0) is None
    for bad in ({-1: 2}, {"": 2}, {0: -1}, {1.5: 2}):
        with pytest.raises(AdapterError, match="mapping of block index"):
            ModelSpec(cls="pkg.Model", containers=("blocks",), attention_calls={"Block": bad})  # pyright: ignore[reportArgumentType]


def test_the_tiny_model_must_run_the_default_backend_as_built():
    # 14.5: a draft's tiny factory is checked on its default backend without set_backend switching it there.
    import dataclasses

    from ac_core.testing import TOY_ADAPTER, toy_case

    model = dataclasses.replace(TOY_ADAPTER.models[0], tiny=lambda: toy_case(attention="math"))
    adapter = dataclasses.replace(TOY_ADAPTER, name="built-on-math", models=(model,))
    with pytest.raises(AssertionError, match="check that the tiny factory builds the model on its default backend"):
        check_attention_retained(Subject(adapter, model, adapter), "sdpa")
