"""The library route: diffusers and transformers classes no adapter serves, checkpointed from what the library
declares (its repeated-block classes, its attention backends), with no adapter and no ``blocks=``."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import ac_core
from ac_core import (
    DEFAULT_RETAINED_OPS,
    AdapterError,
    ModelCase,
    apply_activation_checkpointing,
    checkpointed_blocks,
    get_adapter,
    resolve_blocks,
)
from ac_core.libraries.diffusers import sample_loss
from ac_core.measure import OpCounter

from .cases import assert_same_training, loss_and_grads

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
from diffusers import ModelMixin  # noqa: E402 (after the skip without diffusers)

_LM = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "max_position_embeddings": 64,
}


def _lm(model_cls: str, config_cls: str, **extra: object) -> ModelCase:
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**_LM, **extra)
    ids = torch.randint(0, _LM["vocab_size"], (2, 8))
    return ModelCase(getattr(transformers, model_cls)(config), {"input_ids": ids, "labels": ids}, lambda out: out.loss)


def qwen3() -> ModelCase:
    return _lm("Qwen3ForCausalLM", "Qwen3Config")


def mistral() -> ModelCase:
    return _lm("MistralForCausalLM", "MistralConfig")


def gemma3() -> ModelCase:
    return _lm("Gemma3ForCausalLM", "Gemma3TextConfig", sliding_window=4)


def _image_inputs() -> dict[str, torch.Tensor]:
    return {"hidden_states": torch.randn(2, 4, 8, 8), "encoder_hidden_states": torch.randn(2, 3, 16)}


def sd3() -> ModelCase:
    torch.manual_seed(0)
    model = diffusers.SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        num_attention_heads=2,
        attention_head_dim=8,
        joint_attention_dim=16,
        caption_projection_dim=16,
        pooled_projection_dim=16,
        pos_embed_max_size=8,
    )
    inputs = {**_image_inputs(), "pooled_projections": torch.randn(2, 16), "timestep": torch.tensor([3, 500])}
    return ModelCase(model, inputs, sample_loss)


def sana() -> ModelCase:
    # Linear self-attention (no SDPA) and SDPA cross-attention; patch_embed and norm_out are declared one-off modules.
    torch.manual_seed(0)
    model = diffusers.SanaTransformer2DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=2,
        num_cross_attention_heads=2,
        cross_attention_head_dim=8,
        cross_attention_dim=16,
        caption_channels=16,
        mlp_ratio=2.0,
        sample_size=8,
        patch_size=1,
    )
    return ModelCase(model, {**_image_inputs(), "timestep": torch.tensor([3, 500])}, sample_loss)


def ltx_video() -> ModelCase:
    torch.manual_seed(0)
    model = diffusers.LTXVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        num_layers=2,
        caption_channels=16,
    )
    inputs = {
        "hidden_states": torch.randn(2, 2 * 4 * 4, 4),  # 2 frames of 4 x 4 latent patches
        "encoder_hidden_states": torch.randn(2, 3, 16),
        "timestep": torch.tensor([3, 500]),
        "encoder_attention_mask": torch.ones(2, 3),
        "num_frames": 2,
        "height": 4,
        "width": 4,
    }
    return ModelCase(model, inputs, sample_loss)


CASES = {
    "transformers": [qwen3, mistral, gemma3],
    "diffusers": [sd3, sana, ltx_video],
}
FACTORIES = [pytest.param(library, factory, id=factory.__name__) for library, fs in CASES.items() for factory in fs]


def _declared_blocks(model: nn.Module, library: str) -> set[str]:
    """FQNs of the items of a ModuleList that are of a class the library declares a repeated block."""
    if library == "transformers":
        from transformers.modeling_layers import GradientCheckpointingLayer

        return {fqn for fqn, m in model.named_modules() if isinstance(m, GradientCheckpointingLayer)}
    declared = {*(model._repeated_blocks or ()), *(model._no_split_modules or ())}
    return {
        fqn
        for fqn, m in model.named_modules()
        if type(m).__name__ in declared and isinstance(model.get_submodule(fqn.rpartition(".")[0]), nn.ModuleList)
    }


def _names(model: nn.Module) -> tuple[list[str], list[str], list[str]]:
    return (
        [n for n, _ in model.named_modules()],
        [n for n, _ in model.named_parameters()],
        list(model.state_dict()),
    )


@pytest.mark.parametrize(("library", "factory"), FACTORIES)
def test_blocks_are_the_declared_classes_in_module_lists(library, factory):
    model = factory().model
    resolved = resolve_blocks(model)
    assert resolved.source == f"the {library} library route"
    assert resolved.adapter is not None and resolved.adapter.name == f"{library}-route"
    assert resolved.paths == _declared_blocks(model, library) and len(resolved) == 2
    # The same spec for every model of the class, also for the class itself once a model was seen.
    assert get_adapter(factory().model) is resolved.adapter is get_adapter(type(model))


@pytest.mark.parametrize("kind", ["full", "ops"])
@pytest.mark.parametrize(("library", "factory"), FACTORIES)
def test_trains_like_the_plain_model_and_ops_reruns_no_attention(library, factory, kind, caplog):
    plain = factory()
    with OpCounter() as plain_ops:
        expected = loss_and_grads(plain)
    attention = plain_ops.count(DEFAULT_RETAINED_OPS)

    case = factory()
    names = _names(case.model)
    with caplog.at_level(logging.WARNING, logger="ac_core"):
        apply_activation_checkpointing(case.model, kind)
        with OpCounter() as counter:
            got = loss_and_grads(case)
    assert set(checkpointed_blocks(case.model)) == _declared_blocks(case.model, library)
    assert_same_training(got, expected)
    assert [r.getMessage() for r in caplog.records if r.name == "ac_core"] == []  # nothing left out or unretained
    # Every SDPA call of these models is inside a block: 'full' reruns each once, 'ops' none.
    assert attention >= 2
    assert counter.count(DEFAULT_RETAINED_OPS, "backward") == (0 if kind == "ops" else attention)
    assert _names(case.model) == names


def test_compile_full_without_adapter_or_blocks():
    torch._dynamo.reset()
    expected = loss_and_grads(mistral())
    case = mistral()
    case.model = ac_core.compile(case.model, "full", backend="aot_eager")
    try:
        got = loss_and_grads(case)
    finally:
        torch._dynamo.reset()
    assert set(checkpointed_blocks(case.model)) == set()  # the graph route, not eager checkpointing
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=1e-6)
    grads = {n.removeprefix("_orig_mod."): g for n, g in got[1].items()}
    assert grads.keys() == expected[1].keys()
    for name, grad in expected[1].items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-6, msg=f"gradient of {name}")
    # The graph route takes its blocks from the library route, as eager checkpointing does.
    assert ac_core.prepare_graph_route(mistral().model).blocks == {f"model.layers.{i}" for i in range(2)}


def test_a_wrapped_model_is_served_by_the_route_of_the_model_inside():
    model = sd3().model
    resolved = resolve_blocks(torch.compile(model))
    assert resolved.served_path == "_orig_mod" and resolved.source == "the diffusers library route"
    assert {b.path for b in resolved} == {f"_orig_mod.transformer_blocks.{i}" for i in range(2)}


def test_declared_one_off_modules_are_left_alone():
    model = sana().model
    one_offs = {"patch_embed", "norm_out"}  # PatchEmbed and SanaModulatedNorm, declared in _no_split_modules
    assert {type(model.get_submodule(fqn)).__name__ for fqn in one_offs} <= set(model._no_split_modules)
    assert resolve_blocks(model).paths.isdisjoint(one_offs)


def test_a_curated_class_keeps_its_adapter():
    pytest.importorskip("ac_core_adapters")
    from ac_core_adapters.models.llama import tiny_llama_for_causal_lm

    resolved = resolve_blocks(tiny_llama_for_causal_lm().model)
    assert resolved.adapter is not None and resolved.adapter.name == "llama"
    assert resolved.source == "adapter 'llama'"


class _Attention(nn.Module):
    """Named as diffusers' and transformers' attention modules are: what marks a block as an attention block."""

    def __init__(self) -> None:
        super().__init__()
        self.to_qkv = nn.Linear(8, 24)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attention()


class _RefinerBlock(nn.Module):
    """Of a class the models below do not declare."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attention()


class _Refiner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.refiner_blocks = nn.ModuleList(_RefinerBlock() for _ in range(2))


class _Undeclared(ModelMixin):
    """A diffusers model whose second list of attention blocks holds a class it does not declare."""

    _no_split_modules = ("_Block",)

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.refiners = nn.ModuleList(_RefinerBlock() for _ in range(2))


def test_contradictory_declarations_get_the_ready_blocks_argument():
    model = _Undeclared()
    with pytest.raises(AdapterError) as info:
        apply_activation_checkpointing(model, "full")
    message = str(info.value)
    assert "'refiners' (2 x _RefinerBlock) holds attention blocks of a class it does not declare" in message
    assert "blocks=['blocks', 'refiners']" in message
    assert checkpointed_blocks(model) == {}


def test_a_class_declaring_no_block_gets_the_ready_blocks_argument():
    model = diffusers.DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=2, sample_size=8, patch_size=2
    )
    with pytest.raises(AdapterError, match=r"declares no block class .*blocks=\['transformer_blocks'\]"):
        resolve_blocks(model)
    with pytest.raises(AdapterError, match="derives a model's blocks from the model itself: pass the model"):
        get_adapter(diffusers.DiTTransformer2DModel)


class _WithRefiner(ModelMixin):
    """A declared one-off module (the refiner) holding a list of attention blocks it does not declare."""

    _no_split_modules = ("_Block", "_Refiner")

    def __init__(self) -> None:
        super().__init__()
        self.refiner = _Refiner()
        self.blocks = nn.ModuleList(_Block() for _ in range(2))


def test_an_undeclared_list_inside_a_declared_one_off_module_is_excluded_with_the_reason():
    resolved = resolve_blocks(_WithRefiner())
    assert [c.path for c in resolved.containers] == ["blocks"]
    assert [(e.path, e.found) for e in resolved.excluded] == [("refiner.refiner_blocks", True)]
    assert "inside _Refiner at 'refiner', which diffusers declares as one module" in resolved.excluded[0].reason
