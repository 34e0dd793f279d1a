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

from .class_builds import class_build

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


# Names of a model's width, its head counts and its rotary splits of the head dimension.
_WIDTHS = ("hidden_size", "dim", "model_dim", "dit_dim", "embed_dim", "d_model", "inner_dim")
_HEAD_COUNTS = ("num_attention_heads", "num_heads", "n_heads", "dit_heads", "nheads")
_ROTARY = ("axes", "rope", "rotary")

MAX_CHANNELS = 64
"""Channel counts up to this stay as declared: cheap at any tiny width, and constructors check relations between
them (``in_channels == 2 * latent_channels + 4``)."""

NONE_SIZES: dict[str, int] = {"in_channels": CHANNELS, "patch_size": 2, "caption_channels": SMALL_DIM}
"""Sizes a constructor needs whose default is None (set by the checkpoint's config), at tiny size."""


def _is_layer_count(name: str) -> bool:
    words = name.split("_")
    return "layers" in words or "blocks" in words or "depth" in words or name in ("nlayers", "layers")


def _is_head_count(name: str) -> bool:
    return name.endswith("heads")


def _scale_int(name: str, value: int, width: int | None) -> int:
    """One integer setting of a diffusers constructor at tiny size (unchanged where it is no size)."""
    if _is_layer_count(name):
        return min(value, LAYERS)
    if _is_head_count(name):
        return min(value, HEADS)
    if name.endswith("head_dim") or name == "d_kv":
        return min(value, HEAD_DIM)
    if name in _WIDTHS or (width is not None and value == width):
        return min(value, WIDTH)
    if "vocab" in name:
        return min(value, VOCAB)
    if name.endswith("token_id"):
        return value if value < VOCAB else 0
    if name.endswith("channels") and "num_channels" not in name:
        return value if value <= MAX_CHANNELS else SMALL_DIM
    if ("dim" in name or name.endswith("size") or name.startswith("d_")) and "patch" not in name and value > WIDTH:
        return SMALL_DIM
    return value


def _scale_axes(axes: tuple[int, ...], total: int) -> tuple[int, ...]:
    # Rotary axes split the head dimension into even parts that must add up to it.
    scaled = [max(2, round(a * total / sum(axes) / 2) * 2) for a in axes]
    scaled[-1] += total - sum(scaled)
    return tuple(scaled)


def _head_dims(defaults: Mapping[str, Any], config: Mapping[str, Any]) -> tuple[int | None, int]:
    """The head dimension of the full-size model (None where no default tells it) and of the tiny one."""

    def head_dim(values: Mapping[str, Any]) -> int | None:
        explicit = values.get("attention_head_dim", values.get("head_dim"))
        if isinstance(explicit, int):
            return explicit
        width = next((values[n] for n in _WIDTHS if isinstance(values.get(n), int)), None)
        heads = next((values[n] for n in _HEAD_COUNTS if isinstance(values.get(n), int)), None)
        return width // heads if width and heads else None

    return head_dim(defaults), head_dim({**defaults, **config}) or HEAD_DIM


def _rotary_size(total: int, full: int | None, tiny: int) -> int:
    """A rotary size (a split's sum, or the rotated channels) scaled as the head dimension is: one that covers the
    whole head dimension (or half of it) still does."""
    share = total / full if full else 1.0
    return max(2, round(tiny * share / 2) * 2)


def _scale_indices(indices: tuple[int, ...], layers: int) -> tuple[int, ...]:
    """Indices of special layers among ``layers``, mapped onto the tiny model's layers in the same proportion."""
    return tuple(dict.fromkeys(min(i * LAYERS // max(layers, 1), LAYERS - 1) for i in indices))


def _scaled_scalar(name: str, value: Any, defaults: Mapping[str, Any], width: int | None) -> Any:
    """A number or None setting at tiny size (``value`` itself where it is no size)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return _scale_int(name, value, width)
    if value is not None:
        return value
    if name == "in_channels":
        # A GroupNorm over the input channels needs them divisible by its groups.
        return defaults.get("norm_num_groups", NONE_SIZES[name])
    if name in NONE_SIZES:
        return NONE_SIZES[name]
    if _is_head_count(name):
        return HEADS
    if name == "out_channels" and defaults.get("in_channels") is None:
        return _scaled_scalar("in_channels", None, defaults, width)  # defaults to in_channels, that one to None
    return value


def _scaled_split(name: str, value: Any, head_dims: tuple[int | None, int], layers: int) -> Any:
    """A rotary split of the head dimension, or the indices of special layers, at tiny size (else ``value``)."""
    ints: tuple[int, ...] | None = None
    if isinstance(value, tuple | list) and value and all(type(v) is int for v in value):
        ints = tuple(value)
    rotary = any(word in name for word in _ROTARY) and any(word in name for word in ("axes", "dim", "section"))
    rotary = rotary and "len" not in name
    if rotary and type(value) is int:
        return min(value, _rotary_size(value, *head_dims))
    if rotary and value is None and "axes" in name:
        return _scale_axes((1, 1), head_dims[1])  # the checkpoint's split, here the two image axes
    if ints is None:
        return value
    if rotary:
        scaled = _scale_axes(ints, max(_rotary_size(sum(ints), *head_dims), 2 * len(ints)))
    elif "layer" in name and max(ints) >= LAYERS:
        scaled = _scale_indices(ints, layers)
    else:
        return value
    return list(scaled) if isinstance(value, list) else scaled


def diffusers_config(cls: type) -> dict[str, Any]:
    """``cls.__init__``'s defaults scaled down to a tiny model (only the values that change)."""
    defaults = {
        name: p.default
        for name, p in inspect.signature(cls.__init__).parameters.items()
        if p.default is not inspect.Parameter.empty and name != "self"
    }
    heads = defaults.get("num_attention_heads")
    head_dim = defaults.get("attention_head_dim")
    width = heads * head_dim if isinstance(heads, int) and isinstance(head_dim, int) else None
    width = width or next((defaults[n] for n in _WIDTHS if isinstance(defaults.get(n), int)), None)
    layers = max((v for n, v in defaults.items() if isinstance(v, int) and _is_layer_count(n)), default=LAYERS)
    config = {n: s for n, v in defaults.items() if (s := _scaled_scalar(n, v, defaults, width)) != v}
    head_dims = _head_dims(defaults, config)
    config.update({n: s for n, v in defaults.items() if (s := _scaled_split(n, v, head_dims, layers)) != v})
    return config


EXPERTS = 4
EXPERTS_PER_TOKEN = 2


def _transformers_int(name: str, value: int) -> int:
    """A transformers config's integer setting at tiny size (unchanged where it is no size)."""
    if "vocab" in name:
        return min(value, VOCAB)
    if name in ("hidden_size", "d_model", "n_embd", "emb_dim", "embed_dim"):
        return WIDTH
    if "intermediate_size" in name or name in ("ffn_dim", "n_inner", "expert_ffn_hidden_size"):
        return min(value, 2 * WIDTH)
    if name in ("num_hidden_layers", "n_layer", "n_layers", "num_layers"):
        return min(value, LAYERS)
    if "heads" in name or name.endswith("_head"):  # attention, key-value, encoder/decoder, mamba, indexer heads
        return min(value, HEADS)
    if "head_dim" in name or name == "rotary_dim":
        return min(value, HEAD_DIM)
    if name.endswith("_rank"):  # low-rank query/key-value projections (multi-head latent attention)
        return min(value, WIDTH)
    if name in ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"):
        return min(value, EXPERTS)
    if name in ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k"):
        return min(value, EXPERTS_PER_TOKEN)
    if name in ("n_group", "topk_group", "n_shared_experts"):
        return min(value, 1)
    if name == "max_position_embeddings":
        return min(value, 64)
    return value


def _scaled_transformers(defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The values of one config's ``to_dict()`` that a tiny model changes; sub-configs (a multimodal model's
    ``text_config``, ``vision_config``) scaled the same way, by their own model type."""
    config: dict[str, Any] = {}
    for name, value in defaults.items():
        if isinstance(value, Mapping) and "model_type" in value:
            inner = _scaled_transformers(value)
            if inner:
                config[name] = {"model_type": value["model_type"], **inner}
        elif name == "head_dim" and value is None and "hidden_size" in defaults:
            config[name] = HEAD_DIM  # derived from the full-size width otherwise, and read as a number
        elif isinstance(value, int) and not isinstance(value, bool):
            scaled = _transformers_int(name, value)
            if scaled != value:
                config[name] = scaled
    types = defaults.get("layer_types")
    if isinstance(types, list) and len(types) > config.get("num_hidden_layers", len(types)):
        # One layer of each kind, in the order they first come, so that a hybrid model keeps every kind.
        kinds = list(dict.fromkeys(types))
        config["layer_types"] = kinds + kinds[-1:] * (LAYERS - len(kinds))
        config["num_hidden_layers"] = len(config["layer_types"])
    if "use_cache" in defaults:
        # Built to train: the KV cache serves only generation, and a plain run with it differs in the last bits
        # from a checkpointed one, which runs without it.
        config["use_cache"] = False
    if defaults.get("is_decoder") is False:
        config["is_decoder"] = True  # swept as causal language models
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(defaults.get(name), int) and defaults[name] >= config.get("vocab_size", VOCAB):
            config[name] = 0
    return config


def transformers_config(cls: type, config_class: type | None = None) -> dict[str, Any]:
    """The defaults of ``config_class`` (default ``cls.config_class``) scaled down to a tiny model (only the values
    that change), with special token ids past the tiny vocabulary set to 0."""
    return _scaled_transformers((config_class or cls.config_class)().to_dict())


def derived_config(cls: type, config_class: type | None = None) -> dict[str, Any]:
    """The tiny config of ``cls`` for its library, with the settings its ``class_builds`` entry declares; empty for
    a plain torch module (its defaults as they are).

    ``config_class``: a transformers config class other than ``cls.config_class`` (one model class serves several
    model types, each with its own config class).
    """
    library = library_of(cls)
    if library == "diffusers":
        config = diffusers_config(cls)
    elif library == "transformers":
        config = transformers_config(cls, config_class)
    else:
        config = {}
    build = class_build(cls)
    return {**config, **build.config} if build is not None else config


def build_model(cls: type, config: Mapping[str, Any], config_class: type | None = None) -> nn.Module:
    """``cls`` built from ``config`` as its library takes a config, with torch seeded at 0 (same weights each time)."""
    torch.manual_seed(0)
    if library_of(cls) != "transformers":
        return cls(**config)
    built = (config_class or cls.config_class)(**config)
    # A multimodal model type's causal LM takes its text config, as transformers' auto classes pass it.
    if type(built) is not cls.config_class and getattr(built, "sub_configs", {}).get("text_config") is cls.config_class:
        built = built.get_text_config()
    return cls(built)
