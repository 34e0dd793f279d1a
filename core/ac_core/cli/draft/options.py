"""What ``ac-core inspect module:Class`` is given: the class, ``--config`` or ``--factory``; and the error that says
what to pass."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...errors import AdapterError
from ...refs import load_ref


class DraftError(Exception):
    """The model could not be built or run from derived settings: the message says what to pass instead."""


def load_class(ref: str) -> type[nn.Module]:
    """The model class ``module:Class`` names (``diffusers:SD3Transformer2DModel``)."""
    obj = load_ref(ref, what="model class")
    if not (isinstance(obj, type) and issubclass(obj, nn.Module)):
        raise AdapterError(f"{ref!r} is a {type(obj).__name__}, not an nn.Module class")
    return obj


def load_factory(ref: str, cls: type[nn.Module]) -> Callable[[], nn.Module]:
    """``--factory``: the function ``module:function`` names, wrapped to seed torch at 0 (same weights each time)
    and to check that it returns a built ``cls``."""
    factory = load_ref(ref, what="model factory")
    if not callable(factory):
        raise DraftError(
            f"--factory {ref!r} is a {type(factory).__name__}, not a function; give a function that takes no "
            f"argument and returns a tiny {cls.__name__}"
        )

    def build() -> nn.Module:
        torch.manual_seed(0)
        try:
            model = factory()
        except Exception as exc:
            raise DraftError(f"--factory {ref!r} failed: {exc!r}") from exc
        if not isinstance(model, cls):
            raise DraftError(
                f"--factory {ref!r} returned a {type(model).__name__}, not a {cls.__name__}; give a function that "
                f"returns the built model of the class inspected"
            )
        return model

    return build


def load_config(value: str | None) -> dict[str, Any] | None:
    """``--config``: a JSON object, or ``@file.json``."""
    if value is None:
        return None
    text = open(value[1:]).read() if value.startswith("@") else value  # noqa: SIM115
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DraftError(f"--config is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise DraftError(f"--config must be a JSON object, got {type(config).__name__}")
    return {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}
