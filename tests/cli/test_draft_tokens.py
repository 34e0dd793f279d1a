"""The drafted ``token_count`` is derived from the model's patch embedding and the input shapes: on the probe
inputs and on inputs of another size it gives the tokens the first block's attention processes, measured here
with hooks of the test's own."""

from __future__ import annotations

import sys
import types
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from torch import nn

from ac_core import resolve_blocks
from ac_core.cli import main
from ac_core.cli.draft import draft_source, inspect_class
from ac_core.cli.draft.tokens import PatchEmbedding
from ac_core.testing import ToyBlock

pytest.importorskip("diffusers")


def _drafted(capsys, target: str, name: str) -> types.ModuleType:
    assert main(["inspect", target, "--draft"]) == 0
    module = types.ModuleType(name)
    sys.modules[name] = module
    exec(compile(capsys.readouterr().out, f"<draft {name}>", "exec"), module.__dict__)
    return module


def _attention_tokens(model: nn.Module, first: nn.Module, inputs: Mapping[str, Any], monkeypatch) -> int:
    """Batch x query length of the first SDPA call inside ``first`` in one forward (queries are (B, H, L, E))."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    inside: list[bool] = []
    seen: list[int] = []

    def recording(*args: Any, **kwargs: Any) -> torch.Tensor:
        query = args[0] if args else kwargs["query"]
        if inside and not seen:
            seen.append(query.shape[0] * query.shape[-2])
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    pre = first.register_forward_pre_hook(lambda *_: inside.append(True))
    post = first.register_forward_hook(lambda *_: inside.clear())
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        pre.remove()
        post.remove()
        monkeypatch.undo()
    assert seen, "no SDPA call in the first block"
    return seen[0]


def _larger(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The inputs at twice the latent height and width (packed latents: twice the sequence, with their ids)."""
    bigger = dict(inputs)
    hidden = inputs["hidden_states"]
    if hidden.ndim >= 4:
        bigger["hidden_states"] = torch.randn(*hidden.shape[:-2], 2 * hidden.shape[-2], 2 * hidden.shape[-1])
    else:
        bigger["hidden_states"] = torch.randn(hidden.shape[0], 2 * hidden.shape[1], hidden.shape[2])
        bigger["img_ids"] = torch.zeros(2 * hidden.shape[1], 3)
    return bigger


@pytest.mark.parametrize(
    ("target", "tokens"),
    [
        # 2 samples of 8x8 latents in 2x2 patches (16 each), plus 4 text tokens each: the joint attention.
        ("diffusers:SD3Transformer2DModel", 2 * (16 + 4)),
        # 2 samples of 2 frames of 8x8 latents in (1, 2, 2) patches; the text is cross-attended, not counted.
        ("diffusers:WanTransformer3DModel", 2 * 2 * 16),
        # 2 samples of 16 packed latent tokens, plus 4 text tokens each.
        ("diffusers:FluxTransformer2DModel", 2 * (16 + 4)),
    ],
    ids=["sd3-conv2d", "wan-conv3d", "flux-packed-linear"],
)
def test_token_count_is_what_the_first_block_attends_over(capsys, monkeypatch, target, tokens):
    name = target.partition(":")[2]
    module = _drafted(capsys, target, f"drafted_tokens_{name.lower()}")
    adapter = next(value for key, value in vars(module).items() if key.endswith("_ADAPTER"))
    case = adapter.models[0].build_tiny()
    first = resolve_blocks(case.model, adapter).blocks[0].module
    assert module.token_count(case.model, case.inputs) == tokens
    assert _attention_tokens(case.model, first, case.inputs, monkeypatch) == tokens
    larger = _larger(case.inputs)
    assert module.token_count(case.model, larger) == _attention_tokens(case.model, first, larger, monkeypatch)


@pytest.mark.parametrize(
    ("target", "embedding", "text"),
    [
        ("diffusers:SD3Transformer2DModel", PatchEmbedding("pos_embed.proj", "Conv2d", "conv", (2, 2)), True),
        ("diffusers:WanTransformer3DModel", PatchEmbedding("patch_embedding", "Conv3d", "conv", (1, 2, 2)), False),
        ("diffusers:FluxTransformer2DModel", PatchEmbedding("x_embedder", "Linear", "linear"), True),
    ],
    ids=["sd3", "wan", "flux"],
)
def test_findings_record_the_patch_embedding_and_whether_text_joins(target, embedding, text):
    findings, _ = inspect_class(target)
    tokens = findings.tokens
    assert tokens is not None
    assert tokens.embedding == embedding
    assert tokens.input == "hidden_states"
    assert tokens.note is None
    assert tokens.text == ("encoder_hidden_states" if text else None)
    assert tokens.tokens == tokens.attention_tokens
    assert tokens.block_tokens == tokens.input_tokens  # the blocks take the image tokens; text comes alongside
    source = draft_source(findings)
    assert f"embed = model.{embedding.path}" in source
    assert ('tokens += inputs["encoder_hidden_states"]' in source) is text


def test_the_adapters_token_counts_agree_with_the_drafts(capsys):
    pytest.importorskip("ac_core_adapters")
    from ac_core_adapters.models import flux, wan

    for target, ours in (("diffusers:WanTransformer3DModel", wan), ("diffusers:FluxTransformer2DModel", flux)):
        name = target.partition(":")[2]
        module = _drafted(capsys, target, f"drafted_agree_{name.lower()}")
        case = next(v for k, v in vars(module).items() if k.endswith("_ADAPTER")).models[0].build_tiny()
        assert module.token_count(case.model, case.inputs) == ours.token_count(case.model, case.inputs)


def test_tokens_a_model_adds_are_flagged_for_review(capsys):
    # AuraFlow's attention joins register tokens no input holds: the draft counts the image and says so.
    findings, _ = inspect_class("diffusers:AuraFlowTransformer2DModel")
    tokens = findings.tokens
    assert tokens is not None and tokens.embedding is not None
    assert (tokens.embedding.path, tokens.embedding.kind) == ("pos_embed.proj", "linear")
    assert tokens.tokens == 2 * 16
    assert tokens.attention_tokens is not None and tokens.attention_tokens > 2 * (16 + 4)
    assert (
        tokens.note == f"the first block's attention saw {tokens.attention_tokens} tokens, the patch embedding gives 32"
    )
    assert f"    # Review it: {tokens.note} on the tiny inputs.\n" in draft_source(findings)


class UnshuffledModel(nn.Module):
    """Patches by pixel_unshuffle and a bare weight: no module embeds the patches."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 32) / 4)
        self.blocks = nn.ModuleList(ToyBlock(32, 2) for _ in range(2))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.pixel_unshuffle(hidden_states, 2).flatten(2).transpose(1, 2) @ self.weight
        for block in self.blocks:
            x = block(x)
        return x


def test_without_a_patch_embedding_the_draft_guesses_and_says_review_it():
    findings, case = inspect_class("tests.cli.test_draft_tokens:UnshuffledModel")
    tokens = findings.tokens
    assert tokens is not None
    assert (tokens.embedding, tokens.note) == (None, "no patch embedding found")
    assert (tokens.block_tokens, tokens.attention_tokens) == (2 * 16, 2 * 16)  # measured all the same
    source = draft_source(findings)
    assert "    # Review it: no patch embedding was found, so this guesses from the shape of the inputs.\n" in source
    module = types.ModuleType("drafted_unshuffled")
    exec(compile(source, "<draft unshuffled>", "exec"), module.__dict__)
    assert module.token_count(case.model, case.inputs) == 2 * 8 * 8  # the guess: a patch of 1 where none is known


class ResidueModel(nn.Module):
    """Takes a sequence under another name than hidden_states, with no patch embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ToyBlock(16, 2) for _ in range(2))

    def forward(self, residues: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            residues = block(residues)
        return residues


def test_without_hidden_states_the_guess_counts_the_first_sequence_input():
    findings, case = inspect_class("tests.cli.test_draft_tokens:ResidueModel")
    source = draft_source(findings)
    assert '    return inputs["residues"].shape[:2].numel() + text\n' in source
    module = types.ModuleType("drafted_residues")
    exec(compile(source, "<draft residues>", "exec"), module.__dict__)
    assert module.token_count(case.model, case.inputs) == case.inputs["residues"].shape[:2].numel()
