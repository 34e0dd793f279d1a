"""The draft's ``token_count`` as Python source: tokens from the input shapes by the patch embedding the tiny
forward found (:mod:`.tokens`), its patch sizes read from the model when it runs; a guess to review where none
was found."""

from __future__ import annotations

import keyword

from ...libraries.inputs import TensorInput
from .findings import Findings
from .tokens import TokenDerivation

_HEAD = "def token_count(model: nn.Module, inputs: Mapping[str, Any]) -> int:"


def _module(path: str) -> str:
    """Source of the submodule at ``path`` (``model.pos_embed.proj``; ``get_submodule`` for a numbered one)."""
    if all(part.isidentifier() and not keyword.iskeyword(part) for part in path.split(".")):
        return f"model.{path}"
    return f'model.get_submodule("{path}")'


def _derived(tokens: TokenDerivation) -> list[str]:
    embedding = tokens.embedding
    assert embedding is not None and tokens.input is not None
    value = f'inputs["{tokens.input}"]'
    seen = "attention" if tokens.attention_tokens is not None else "input"
    lines = [
        '    """Tokens one forward\'s main attention processes, over the whole batch, from the input shapes:',
        f"    {embedding.path}, the patch embedding, makes tokens of {tokens.input}.",
        f"    For the tiny inputs: {tokens.tokens}; the first block's {seen} saw "
        f'{tokens.attention_tokens or tokens.block_tokens}."""',
    ]
    if embedding.kind == "ids":
        lines.append(f"    tokens = {value}.numel()  # {embedding.path}, an {embedding.module_type}: one token per id")
    elif embedding.kind == "linear":
        lines += [
            f"    embed = {_module(embedding.path)}  # a {embedding.module_type}: one token per row of in_features",
            f"    tokens = {value}.numel() // embed.in_features",
        ]
    else:
        axes = len(embedding.patch)
        lines += [
            f"    value = {value}",
            f"    embed = {_module(embedding.path)}  # a {embedding.module_type} whose stride is its kernel: one "
            "token per patch",
            f"    patched = value.shape[-{axes}:]  # the axes it patches",
            "    rows = value.numel() // (embed.in_channels * math.prod(patched))  # batch, and any axis left whole",
            "    grid = zip(patched, embed.kernel_size, strict=True)",
            "    tokens = rows * math.prod(size // patch for size, patch in grid)",
        ]
    if tokens.text is not None:
        lines.append(
            f'    tokens += inputs["{tokens.text}"].shape[:-1].numel()  # the blocks\' attention joins these tokens'
        )
    if tokens.note is not None:
        lines.append(f"    # Review it: {tokens.note} on the tiny inputs.")
    return [*lines, "    return tokens"]


def _guessed(findings: Findings) -> list[str]:
    """No patch embedding found: batch x sequence of 3D hidden_states; for 4D/5D latents, patches of
    ``model.config.patch_size`` over height and width (and every frame), plus the text tokens."""
    inputs = findings.inputs or {}
    hidden = inputs.get("hidden_states")
    lines = [
        '    """Tokens one forward\'s main attention processes, over the whole batch (review it)."""',
        "    # Review it: no patch embedding was found, so this guesses from the shape of the inputs.",
    ]
    if "input_ids" in inputs:
        return [*lines, '    return inputs["input_ids"].numel()']
    text = '    text = inputs["encoder_hidden_states"].shape[:2].numel() if "encoder_hidden_states" in inputs else 0'
    if isinstance(hidden, TensorInput) and len(hidden.shape) in (4, 5):
        return [
            *lines,
            '    shape = inputs["hidden_states"].shape',
            '    patch = getattr(getattr(model, "config", None), "patch_size", 1) or 1',
            "    frames = shape[2] if len(shape) == 5 else 1  # check which axis holds the frames of your model",
            text,
            "    return shape[0] * frames * (shape[-2] // patch) * (shape[-1] // patch) + text",
        ]
    # The latents by name, else the first input of batch x sequence (a protein's residues, a song's frames).
    sequence = next(
        (n for n, v in inputs.items() if isinstance(v, TensorInput) and len(v.shape) >= 2),
        "hidden_states",
    )
    main = "hidden_states" if isinstance(hidden, TensorInput) else sequence
    return [*lines, text, f'    return inputs["{main}"].shape[:2].numel() + text']


def token_count_source(findings: Findings) -> list[str]:
    """The ``token_count`` function's lines (they use ``math`` where :func:`needs_math`)."""
    tokens = findings.tokens
    if tokens is None or tokens.embedding is None:
        return [_HEAD, *_guessed(findings)]
    return [_HEAD, *_derived(tokens)]


def needs_math(findings: Findings) -> bool:
    """Whether the ``token_count`` source calls ``math.prod`` (a conv patch embedding)."""
    tokens = findings.tokens
    return tokens is not None and tokens.embedding is not None and tokens.embedding.kind == "conv"
