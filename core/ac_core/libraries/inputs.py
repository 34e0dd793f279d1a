"""A tiny model's forward inputs, found by probing ``forward``'s signature with candidate shapes until one runs.

What a diffusers or transformers forward takes, by parameter name: the draft (``ac-core inspect module:Class``)
and the sweep build their tiny models' inputs from it.
"""

from __future__ import annotations

import inspect
import itertools
import traceback
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from .class_builds import class_build
from .configs import VOCAB, library_of
from .diffusers_inputs import diffusers_candidates
from .input_spec import BATCH, SEQ, TensorInput

__all__ = ["InputsError", "TensorInput", "build_inputs", "loss_of", "probe_inputs"]

MAX_TRIES = 48
"""Candidate specs tried before the probe gives up (each costs one tiny forward)."""


class InputsError(Exception):
    """No derived input ran a forward of the model, or its output holds no tensor."""


def _built(value: Any) -> Any:
    if isinstance(value, TensorInput):
        return value.build()
    if isinstance(value, Mapping):
        return {k: _built(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_built(v) for v in value)
    return value


def build_inputs(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Forward's keyword arguments from input specs: each TensorInput built (inside dicts, lists and tuples too, a
    forward that takes a dict of conditioning tensors), other values as given."""
    return {k: _built(v) for k, v in spec.items()}


def _candidates(model: nn.Module) -> Iterator[dict[str, Any]]:
    """Input specs for ``model.forward`` to try, best first: those the class's ``class_builds`` entry declares,
    then those derived from the signature (the declared ones fit the declared config, not one given by hand)."""
    params = inspect.signature(model.forward).parameters
    build = class_build(type(model))
    if build is not None and build.inputs is not None:
        yield dict(build.inputs)
    if library_of(type(model)) == "transformers":
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        yield {"input_ids": TensorInput("randint", (BATCH, SEQ), high=vocab if isinstance(vocab, int) else VOCAB)}
        return
    yield from diffusers_candidates(model, params)


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
    raise InputsError(f"forward returned a {type(output).__name__} with no tensor in it")


def loss_of(output: Any) -> torch.Tensor:
    """Mean square of the model output's first tensor: the draft's loss."""
    return _first_tensor(output).float().pow(2).mean()


def _described(spec: Mapping[str, Any]) -> str:
    return ", ".join(
        f"{k}={tuple(v.shape) if isinstance(v, TensorInput) and v.shape else v!r}" for k, v in spec.items()
    )


def _where(exc: Exception) -> str:
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"


def probe_inputs(model: nn.Module) -> dict[str, Any]:
    """Input specs (name -> TensorInput or value) with which one forward of ``model`` runs; InputsError if none."""
    first: tuple[dict[str, Any], Exception] | None = None
    tried = 0
    for spec in itertools.islice(_candidates(model), MAX_TRIES):
        tried += 1
        torch.manual_seed(0)
        try:
            with torch.no_grad():
                loss_of(model(**build_inputs(spec)))
        except Exception as exc:  # a wrong guess: try the next one
            first = first or (spec, exc)
            continue
        return spec
    detail = (
        "no candidate"
        if first is None
        else f"the first of {tried} tried, {_described(first[0])}, failed with {first[1]!r} at {_where(first[1])}"
    )
    raise InputsError(
        f"no input derived from the signature of {type(model).__name__}.forward ran it ({detail}; "
        f"it takes {', '.join(inspect.signature(model.forward).parameters)})"
    )
