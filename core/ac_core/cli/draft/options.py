"""What ``ac-core inspect module:Class`` is given: the class, ``--config``; and the error that says what to pass."""

from __future__ import annotations

import json
from typing import Any

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
