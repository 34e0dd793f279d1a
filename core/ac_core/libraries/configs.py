"""A tiny config for a model class, derived from the class's own defaults: what ``ac-core inspect module:Class``
builds a model class no adapter serves from.

A diffusers ``ModelMixin`` takes its config as ``__init__`` keywords, a transformers ``PreTrainedModel`` a
``config_class`` object; either way the defaults are scaled down (2 layers, 2 heads of 16, small embedding
widths) and only the values that change are returned. The classes are read by name, not imported.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

# Sizes of the tiny build.
LAYERS = 2
HEADS = 2
HEAD_DIM = 16
WIDTH = HEADS * HEAD_DIM
SMALL_DIM = 16
CHANNELS = 4
VOCAB = 64


def library_of(cls: type) -> str:
    """``"transformers"`` for a ``PreTrainedModel``, ``"diffusers"`` for a ``ModelMixin``, else ``"torch"``."""
    names = {base.__module__.split(".")[0] + "." + base.__name__ for base in cls.__mro__}
    if "transformers.PreTrainedModel" in names:
        return "transformers"
    if "diffusers.ModelMixin" in names:
        return "diffusers"
    return "torch"


def _is_layer_count(name: str) -> bool:
    return (name.startswith("num_") and "layer" in name) or name in ("depth", "num_blocks", "layers")


def _scale_int(name: str, value: int, inner: int | None) -> int:
    if _is_layer_count(name):
        return min(value, LAYERS)
    if name in ("num_attention_heads", "num_heads", "num_key_value_heads", "num_kv_heads"):
        return min(value, HEADS)
    if name in ("attention_head_dim", "head_dim"):
        return min(value, HEAD_DIM)
    if inner is not None and value == inner:
        return WIDTH
    if name.endswith("channels") and "num_channels" not in name:
        return min(value, CHANNELS)
    if ("dim" in name or "channels" in name or (name.endswith("size") and "patch" not in name)) and value > WIDTH:
        return SMALL_DIM
    return value


def _scale_axes(axes: tuple[int, ...], total: int) -> tuple[int, ...]:
    # Rotary axes split the head dimension into even parts that must add up to it.
    scaled = [max(2, round(a * total / sum(axes) / 2) * 2) for a in axes]
    scaled[-1] += total - sum(scaled)
    return tuple(scaled)


def diffusers_config(cls: type) -> dict[str, Any]:
    """``cls.__init__``'s defaults scaled down to a tiny model (only the values that change)."""
    defaults = {
        name: p.default
        for name, p in inspect.signature(cls.__init__).parameters.items()
        if p.default is not inspect.Parameter.empty and name != "self"
    }
    heads = defaults.get("num_attention_heads")
    head_dim = defaults.get("attention_head_dim")
    inner = heads * head_dim if isinstance(heads, int) and isinstance(head_dim, int) else None
    config: dict[str, Any] = {}
    for name, value in defaults.items():
        if isinstance(value, bool) or not isinstance(value, int | tuple):
            continue
        if isinstance(value, int):
            scaled = _scale_int(name, value, inner)
        elif name.startswith("axes_dims") and value and all(isinstance(v, int) for v in value):
            scaled = _scale_axes(value, min(head_dim or HEAD_DIM, HEAD_DIM))
        else:
            continue
        if scaled != value:
            config[name] = scaled
    return config


def transformers_config(cls: type) -> dict[str, Any]:
    """The defaults of ``cls.config_class`` scaled down to a tiny model (only the values that change), with
    special token ids past the tiny vocabulary set to 0."""
    defaults = cls.config_class().to_dict()
    config: dict[str, Any] = {}
    for name, value in defaults.items():
        if isinstance(value, bool) or not isinstance(value, int):
            continue
        if name == "vocab_size":
            config[name] = min(value, VOCAB)
        elif name in ("hidden_size", "d_model", "n_embd"):
            config[name] = WIDTH
        elif name in ("intermediate_size", "ffn_dim", "n_inner"):
            config[name] = 2 * WIDTH
        elif name in ("num_hidden_layers", "n_layer", "num_layers"):
            config[name] = LAYERS
        elif name in ("num_attention_heads", "num_key_value_heads", "n_head"):
            config[name] = HEADS
        elif name == "head_dim":
            config[name] = HEAD_DIM
        elif name == "max_position_embeddings":
            config[name] = min(value, 64)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(defaults.get(name), int) and defaults[name] >= config.get("vocab_size", VOCAB):
            config[name] = 0
    return config


def derived_config(cls: type) -> dict[str, Any]:
    """The tiny config of ``cls`` for its library; empty for a plain torch module (its defaults as they are)."""
    library = library_of(cls)
    if library == "diffusers":
        return diffusers_config(cls)
    if library == "transformers":
        return transformers_config(cls)
    return {}


def build_model(cls: type, config: Mapping[str, Any]) -> nn.Module:
    """``cls`` built from ``config`` as its library takes a config, with torch seeded at 0 (same weights each time)."""
    torch.manual_seed(0)
    if library_of(cls) == "transformers":
        return cls(cls.config_class(**config))
    return cls(**config)
