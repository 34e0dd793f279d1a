"""A tiny model's forward inputs, found by probing ``forward``'s signature with candidate shapes until one runs."""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...libraries.configs import CHANNELS, SMALL_DIM, VOCAB, library_of
from .options import DraftError

# Sizes of the probed inputs.
BATCH = 2
TEXT = 4
SIDE = 8  # latent height and width
FRAMES = 2
SEQ = 8


@dataclass(frozen=True)
class TensorInput:
    """A tensor input, as built and as Python source: ``randn``/``zeros`` of ``shape``, ``randint(high)`` or a
    fixed ``tensor`` of ``values``."""

    kind: str
    shape: tuple[int, ...] = ()
    high: int = 0
    values: tuple[float, ...] = ()
    dtype: str | None = None

    def build(self) -> torch.Tensor:
        dtype = getattr(torch, self.dtype) if self.dtype else None
        if self.kind == "randn":
            return torch.randn(*self.shape)
        if self.kind == "zeros":
            return torch.zeros(*self.shape)
        if self.kind == "randint":
            return torch.randint(0, self.high, self.shape)
        return torch.tensor(list(self.values), dtype=dtype)

    def source(self) -> str:
        shape = ", ".join(map(str, self.shape))
        if self.kind in ("randn", "zeros"):
            return f"torch.{self.kind}({shape})"
        if self.kind == "randint":
            return f"torch.randint(0, {self.high}, ({shape}{',' if len(self.shape) == 1 else ''}))"
        values = ", ".join(repr(v) for v in self.values)
        return f"torch.tensor([{values}]" + (f", dtype=torch.{self.dtype})" if self.dtype else ")")


def build_inputs(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Forward's keyword arguments from input specs: each TensorInput built, other values as given."""
    return {k: v.build() if isinstance(v, TensorInput) else v for k, v in spec.items()}


def _candidates(model: nn.Module) -> dict[str, list[Any]]:
    """Per forward parameter, candidate inputs to try in order (the first one is preferred)."""
    params = inspect.signature(model.forward).parameters
    config = getattr(model, "config", None)

    def get(*names: str, default: int = SMALL_DIM) -> int:
        for name in names:
            value = getattr(config, name, None) if config is not None else None
            if value is None and isinstance(config, Mapping):
                value = config.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return default

    if library_of(type(model)) == "transformers":
        return {"input_ids": [TensorInput("randint", (BATCH, SEQ), high=get("vocab_size", default=VOCAB))]}
    channels = get("in_channels", default=CHANNELS)
    patch = get("patch_size", default=1)
    patch_t = get("patch_size_t", default=1)
    side = max(SIDE, 2 * patch)
    text = get("joint_attention_dim", "text_embed_dim", "cross_attention_dim", "caption_channels", "text_dim")
    pooled = get("pooled_projection_dim", default=SMALL_DIM)
    frames = FRAMES * patch_t
    found: dict[str, list[Any]] = {}
    for name, param in params.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if name == "hidden_states":
            found[name] = [
                TensorInput("randn", (BATCH, channels, side, side)),
                TensorInput("randn", (BATCH, SEQ * 2, channels)),
                TensorInput("randn", (BATCH, channels, frames, side, side)),
                TensorInput("randn", (BATCH, frames, channels, side, side)),
            ]
        elif name == "encoder_hidden_states":
            found[name] = [TensorInput("randn", (BATCH, TEXT, text))]
        elif name in ("pooled_projections", "pooled_text_emb"):
            found[name] = [TensorInput("randn", (BATCH, pooled))]
        elif name == "timestep":
            found[name] = [
                TensorInput("tensor", values=(10, 500), dtype="long"),
                TensorInput("tensor", values=(0.01, 0.5)),
            ]
        elif name == "img_ids":
            found[name] = [TensorInput("zeros", (SEQ * 2, 3))]
        elif name == "txt_ids":
            found[name] = [TensorInput("zeros", (TEXT, 3))]
        elif name == "return_dict":
            found[name] = [False]
        elif param.default is inspect.Parameter.empty:
            found[name] = [TensorInput("randn", (BATCH, SIDE, SMALL_DIM))]
    return found


def _first_tensor(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    for name in ("sample", "logits", "last_hidden_state"):
        value = getattr(output, name, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(output, (tuple, list)) and output:
        return _first_tensor(output[0])
    if isinstance(output, Mapping) and output:
        return _first_tensor(next(iter(output.values())))
    raise DraftError(f"forward returned a {type(output).__name__} with no tensor in it")


def loss_of(output: Any) -> torch.Tensor:
    """Mean square of the model output's first tensor: the draft's loss."""
    return _first_tensor(output).float().pow(2).mean()


def probe_inputs(model: nn.Module) -> dict[str, Any]:
    """Input specs (name -> TensorInput or value) with which one forward of ``model`` runs; DraftError if none."""
    candidates = _candidates(model)
    names = list(candidates)
    last: Exception | None = None
    for combination in itertools.islice(itertools.product(*(candidates[n] for n in names)), 32):
        spec = dict(zip(names, combination, strict=True))
        torch.manual_seed(0)
        try:
            with torch.no_grad():
                loss_of(model(**build_inputs(spec)))
        except Exception as exc:  # a wrong guess: try the next one
            last = exc
            continue
        return spec
    raise DraftError(
        f"no input derived from {type(model).__name__}.forward{inspect.signature(model.forward)} ran a forward "
        f"(last error: {last!r}); pass --inputs module:function, a function(model) returning forward's keyword "
        "arguments"
    )
