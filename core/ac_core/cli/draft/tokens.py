"""The tokens one forward's blocks process, measured on the tiny model and derived from its patch embedding: what
the draft's ``token_count`` computes from the input shapes.

One forward with hooks finds the patch embedding (the first Conv, Linear or Embedding that consumes a forward
input, or a copy of it the size of one, before any block runs), the rows of the first block's first tensor input,
and the query rows of the first block's first fused attention call. The tokens the embedding gives, plus those of
a text input where the attention joins it, are checked against what the attention saw.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.hooks import RemovableHandle

from ...measure import op_matches
from ...ops import DEFAULT_RETAINED_OPS

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_EMBEDDINGS = (*_CONVS, nn.Linear, nn.Embedding)


@dataclass(frozen=True)
class PatchEmbedding:
    """The module that turns a forward input into tokens.

    ``kind``: ``"conv"`` (stride == kernel_size, no padding: one token per patch of the input's last
    ``len(patch)`` axes), ``"linear"`` (one token per row of ``in_features`` values, patchified or not) or
    ``"ids"`` (an Embedding: one token per id).
    """

    path: str
    module_type: str
    kind: str
    patch: tuple[int, ...] = ()


@dataclass(frozen=True)
class TokenDerivation:
    """How the draft's ``token_count`` counts: tokens of ``input`` by ``embedding``, plus those of ``text`` where
    the first block's attention joins them; the figures measured on the tiny model; ``note`` says why the draft's
    count needs review (None: it matched what the first block's attention saw)."""

    input: str | None
    embedding: PatchEmbedding | None
    input_tokens: int | None  # what the embedding makes of the tiny input
    block_tokens: int | None  # rows of the first block's first tensor input
    attention_tokens: int | None  # query rows (batch x sequence) of the first block's first fused attention call
    text: str | None = None
    text_tokens: int = 0
    note: str | None = None

    @property
    def tokens(self) -> int | None:
        """The count the draft's ``token_count`` gives for the tiny inputs."""
        return None if self.input_tokens is None else self.input_tokens + self.text_tokens


def _rows(tensor: torch.Tensor) -> int:
    """Batch x sequence of a (batch, sequence, features) tensor: every axis but the last."""
    return tensor.shape[:-1].numel()


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def embedding_tokens(module: nn.Module, value: torch.Tensor) -> int:
    """The tokens the patch embedding ``module`` makes of the input ``value``, by the rule the draft's source
    writes: one per row of a Linear's in_features, per patch of a Conv's kernel over its last axes, per id."""
    if isinstance(module, nn.Linear):
        return value.numel() // module.in_features
    if isinstance(module, _CONVS):
        patched = value.shape[-len(module.kernel_size) :]
        rows = value.numel() // (module.in_channels * math.prod(patched))  # batch, and any axis left whole
        return rows * math.prod(size // p for size, p in zip(patched, module.kernel_size, strict=True))
    return value.numel()


def _first_tensor(args: Sequence[Any], kwargs: Mapping[str, Any]) -> torch.Tensor | None:
    return next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)


class _QueryRows(TorchDispatchMode):
    """Records the query rows of the first fused SDPA call made while ``active``."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False
        self.rows: int | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # PyTorch's SDPA kernels take (batch, heads, sequence, head_dim) queries.
        query = args[0] if args else None
        wanted = self.active and self.rows is None and op_matches(func.name(), DEFAULT_RETAINED_OPS)
        if wanted and isinstance(query, torch.Tensor) and query.ndim == 4:
            self.rows = query.shape[0] * query.shape[-2]
        return func(*args, **(kwargs or {}))


def _classify(path: str, module: nn.Module, value: torch.Tensor, given: torch.Tensor) -> PatchEmbedding | None:
    """``module`` as the patch embedding of input ``given``, called on ``value`` (a view of it), or None where it
    does not make tokens of all of it (a slice; a Conv that overlaps, pads, or patches other axes)."""
    name = type(module).__name__
    if not isinstance(module, _CONVS):
        kind = "ids" if isinstance(module, nn.Embedding) else "linear"
        return PatchEmbedding(path, name, kind) if value.numel() == given.numel() else None
    kernel = tuple(module.kernel_size)
    padding = module.padding
    unpadded = padding == "valid" or (not isinstance(padding, str) and not any(padding))
    if tuple(module.stride) == kernel and unpadded and given.shape[-len(kernel) :] == value.shape[-len(kernel) :]:
        return PatchEmbedding(path, name, "conv", kernel)
    return None


def measure_tokens(model: nn.Module, blocks: Mapping[str, nn.Module], inputs: Mapping[str, Any]) -> TokenDerivation:
    """One forward of ``model`` on ``inputs`` with hooks: its patch embedding, the first block's input rows and
    attention query rows, and how the tokens the embedding gives (plus a text input's) compare with them."""
    given = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.ndim >= 2}
    calls: list[tuple[str, nn.Module, torch.Tensor]] = []
    first: dict[str, int] = {}
    queries = _QueryRows()
    handles: list[RemovableHandle] = []

    def embed_hook(path: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if not first and args and isinstance(args[0], torch.Tensor):
                calls.append((path, module, args[0]))

        return hook

    def block_pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        tensor = _first_tensor(args, kwargs)
        if not first and tensor is not None:
            first["rows"] = _rows(tensor)
            queries.active = True

    def block_post(*_: Any) -> None:
        queries.active = False

    for path, module in model.named_modules():
        if isinstance(module, _EMBEDDINGS):
            handles.append(module.register_forward_pre_hook(embed_hook(path)))
    for block in blocks.values():
        handles.append(block.register_forward_pre_hook(block_pre, with_kwargs=True))
        handles.append(block.register_forward_hook(block_post))
    try:
        with torch.no_grad(), queries:
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    return _derive(given, calls, first.get("rows"), queries.rows)


def _embedding(
    given: Mapping[str, torch.Tensor], calls: Sequence[tuple[str, nn.Module, torch.Tensor]]
) -> tuple[str, PatchEmbedding, nn.Module] | None:
    """(input name, embedding, module) of the first module that consumes an input, ``hidden_states`` first: the
    input itself or a view of it, or for ``hidden_states`` a Linear on a patchified copy (as many values)."""
    for name in sorted(given, key=lambda n: n != "hidden_states"):
        for path, module, value in calls:
            found = _classify(path, module, value, given[name]) if _shares(value, given[name]) else None
            if found is not None:
                return name, found, module
        for path, module, value in calls if name == "hidden_states" else ():
            if isinstance(module, nn.Linear) and value.numel() == given[name].numel():
                return name, PatchEmbedding(path, type(module).__name__, "linear"), module
    return None


def _derive(
    given: Mapping[str, torch.Tensor],
    calls: Sequence[tuple[str, nn.Module, torch.Tensor]],
    block_rows: int | None,
    query_rows: int | None,
) -> TokenDerivation:
    found = _embedding(given, calls)
    if found is None:
        return TokenDerivation(None, None, None, block_rows, query_rows, note="no patch embedding found")
    name, embedding, module = found
    image = embedding_tokens(module, given[name])
    seen = query_rows if query_rows is not None else block_rows
    measured = TokenDerivation(name, embedding, image, block_rows, query_rows)
    if seen is None:
        return replace(measured, note="no block ran")
    if seen == image:
        return measured
    text = next(
        (
            other
            for other in sorted(given, key=lambda n: n != "encoder_hidden_states")
            if other != name and given[other].ndim == 3 and image + _rows(given[other]) == seen
        ),
        None,
    )
    if text is not None:
        return replace(measured, text=text, text_tokens=seen - image)
    where = "attention" if query_rows is not None else "input"
    return replace(measured, note=f"the first block's {where} saw {seen} tokens, the patch embedding gives {image}")


def token_line(tokens: TokenDerivation) -> str:
    """How the draft counts tokens, in words, with what the tiny forward measured."""
    embedding = tokens.embedding
    if embedding is None or tokens.input is None:
        return f"{tokens.note}: the draft's token_count guesses from the input shapes; review it"
    how = {"ids": "one per id", "linear": "one per row of its in_features", "conv": f"one per patch {embedding.patch}"}
    line = f"{tokens.tokens} on the tiny inputs: {tokens.input} by {embedding.path} ({embedding.module_type}, "
    line += how[embedding.kind] + ")"
    if tokens.text is not None:
        line += f" plus {tokens.text}, which the blocks' attention joins"
    if tokens.note is not None:
        return f"{line}; review it: {tokens.note}"
    seen = "attention" if tokens.attention_tokens is not None else "input"
    return f"{line}, as the first block's {seen} saw them"
