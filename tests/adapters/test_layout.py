"""Every declared container resolves on the tiny models, and no block-holding ModuleList is left undeclared."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ac_core import modules_at, resolve_blocks

from .cases import blocks, case_id, served

_HV = {"transformer_blocks": 3, "single_transformer_blocks": 3}
EXPECTED_BLOCKS = {
    "wan-wan": {"blocks": 3},
    "wan-vace": {"blocks": 3, "vace_blocks": 3},
    "wan-animate": {"blocks": 3, "face_adapter": 3, "motion_encoder.res_blocks": 3},
    "wan-animate_2": {"blocks": 2},
    "hunyuan-hunyuan_video": _HV,
    "hunyuan-hunyuan_video_token_replace": _HV,
    "hunyuan-hunyuan_video_15": {"transformer_blocks": 3},
    "hunyuan-framepack": _HV,
    "flux-flux": {"transformer_blocks": 3, "single_transformer_blocks": 3},
    "flux-flux2": {"transformer_blocks": 3, "single_transformer_blocks": 3},
    "flux-flux3": {
        "mode_blocks.image": 3,
        "mode_blocks.image_cond": 3,
        "txt_mode_blocks": 3,
        "single_transformer_blocks": 3,
    },
    "llama-llama_model": {"layers": 3},
    "llama-llama_for_causal_lm": {"model.layers": 3},
}
# Block classes per variant: the token-replace variant must really build its own blocks.
EXPECTED_CLASSES = {
    "hunyuan-hunyuan_video": {"HunyuanVideoTransformerBlock", "HunyuanVideoSingleTransformerBlock"},
    "hunyuan-hunyuan_video_token_replace": {
        "HunyuanVideoTokenReplaceTransformerBlock",
        "HunyuanVideoTokenReplaceSingleTransformerBlock",
    },
}


def _block_classes(model: nn.Module) -> set[str]:
    """The model's own names for its repeated blocks: diffusers' lists, or transformers' decoder layer."""
    return {*(getattr(model, "_no_split_modules", None) or ()), *(getattr(model, "_repeated_blocks", None) or ())}


@pytest.mark.parametrize(("spec", "model_spec"), list(served()))
def test_containers_resolve_with_the_expected_blocks(spec, model_spec):
    case = model_spec.build_tiny()
    resolved = resolve_blocks(case.model, blocks=model_spec.containers)
    assert {c.path: len(c.blocks) for c in resolved.containers} == EXPECTED_BLOCKS[case_id(spec, model_spec)]
    classes = {block.class_name for block in resolved}
    assert classes <= set(model_spec.attention_calls), "every block class declares its attention calls"
    if case_id(spec, model_spec) in EXPECTED_CLASSES:
        assert classes == EXPECTED_CLASSES[case_id(spec, model_spec)]
    assert case.model.training


@pytest.mark.parametrize(("spec", "model_spec"), list(served()))
def test_every_block_module_list_is_covered_or_excluded(spec, model_spec):
    case = model_spec.build_tiny()
    model = case.model
    covered = {container.path for container in resolve_blocks(model, blocks=model_spec.containers).containers}
    excluded = set()
    for exclusion in model_spec.excluded:
        found = modules_at(model, exclusion.path)
        assert found, f"excluded container {exclusion.path!r} does not exist: a stale exclusion"
        excluded |= {fqn for fqn, _ in found}
    block_classes = _block_classes(model)
    assert block_classes, "the model names its block classes"
    holding = {
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and any(type(child).__name__ in block_classes for child in module)
    }
    assert holding, "the model has block-holding ModuleLists"
    assert holding <= covered | excluded


@pytest.mark.parametrize(("spec", "model_spec"), list(served()))
def test_every_block_runs_and_reaches_the_loss(spec, model_spec):
    case = model_spec.build_tiny()
    ran: set[str] = set()
    named = blocks(case, model_spec)
    handles = [block.register_forward_hook(lambda *_, fqn=fqn: ran.add(fqn)) for fqn, block in named]
    case.run().backward()
    for handle in handles:
        handle.remove()
    assert ran == {fqn for fqn, _ in named}
    for fqn, block in named:
        grads = [p.grad for p in block.parameters() if p.grad is not None]
        assert any(bool(torch.any(g != 0)) for g in grads), f"the loss does not depend on {fqn}"
