"""Candidate forward inputs of a tiny diffusers model, read from its own modules and config, best first.

The latents' layout comes from the patch embedding (a Conv2d takes ``(B, C, H, W)``, a Conv3d ``(B, C, F, H, W)``,
a Linear the packed ``(B, tokens, features)`` or latents it patches itself); the text width from the text
projection's ``in_features``. Inputs that describe the latents (ids, shapes, sizes) are derived from the same
geometry, so each candidate is consistent in itself.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from .configs import CHANNELS, SMALL_DIM
from .input_spec import BATCH, FRAMES, SEQ, SIDE, TEXT, TensorInput

# Names of the modules that take the latents and those that take the text (a module's path holds one).
_LATENT_MODULES = ("x_embed", "img_in", "patch", "proj_in", "input", "visual", "pos_embed", "image_projector")
_TEXT_MODULES = ("context", "caption", "txt", "text", "cap_", "y_embedder", "y_proj", "llm", "encoder_proj", "cond")
# Config names of the latent channels, in the order they are read.
_CHANNELS = ("in_channels", "in_visual_dim", "io_channels", "latent_dim", "in_dim", "input_dims")

_LATENTS = ("hidden_states", "x")
_TEXTS = ("encoder_hidden_states", "text_bth", "cap_feats", "audio_encoder_hidden_states")
_POOLED = ("pooled_projections", "pooled_text_emb", "pooled_embeds", "global_hidden_states")
_GEOMETRY = (
    "img_ids", "txt_ids", "img_shapes", "shape_list", "num_frames", "height", "width", "original_size", "target_size",
    "crop_coords", "position_ids", "padding_mask",
)  # fmt: skip
_MASKS = ("encoder_attention_mask", "encoder_hidden_states_mask", "encoder_mask", "text_embedding_mask")


@dataclass(frozen=True)
class _Latents:
    """One candidate ``hidden_states`` and the token grid (frames, height, width) it makes after patching."""

    shape: tuple[int, ...]
    grid: tuple[int, int, int]


def _config_int(config: Any, *names: str) -> int | None:
    for name in names:
        value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _patch(config: Any) -> tuple[int, int]:
    """(temporal, spatial) patch size from ``patch_size`` (an int, or a (t, h, w) / (h, w) tuple) and
    ``patch_size_t``."""
    value = config.get("patch_size") if isinstance(config, Mapping) else getattr(config, "patch_size", None)
    if isinstance(value, list | tuple) and value and all(isinstance(v, int) for v in value):
        return (value[0] if len(value) == 3 else 1), value[-1]
    spatial = value if isinstance(value, int) else 1
    return _config_int(config, "patch_size_t") or 1, spatial


def _outer_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Linear and convolution layers outside the repeated blocks (no ModuleList between them and the model)."""
    lists = [name for name, module in model.named_modules() if isinstance(module, nn.ModuleList)]
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear | nn.Conv2d | nn.Conv3d) and not any(name.startswith(f"{p}.") for p in lists):
            yield name, module


def _latents(model: nn.Module, config: Any) -> list[_Latents]:
    """Candidate latents, from the patch embedding first, then the usual layouts."""
    channels = _config_int(config, *_CHANNELS) or CHANNELS
    temporal, spatial = _patch(config)
    side = max(SIDE, 4 * spatial)  # divisible by the patch and by a 2x2 packing of patches
    frames = FRAMES * temporal
    grid = (frames // temporal, side // spatial, side // spatial)
    packed_grid = (1, 4, SEQ // 2)

    def image(c: int) -> _Latents:
        return _Latents((BATCH, c, side, side), (1, *grid[1:]))

    def video(c: int) -> list[_Latents]:
        return [_Latents((BATCH, c, frames, side, side), grid), _Latents((BATCH, frames, c, side, side), grid)]

    def channels_last(c: int) -> _Latents:
        return _Latents((BATCH, frames, side, side, c), grid)

    def packed(c: int) -> _Latents:
        return _Latents((BATCH, SEQ * 2, c), packed_grid)

    def from_module(module: nn.Module, strict: bool) -> list[_Latents]:
        # strict: any layer of the model, so it must take the configured channels; else a latent-named one.
        if isinstance(module, nn.Conv3d) and (module.in_channels == channels or not strict):
            return video(module.in_channels)
        if isinstance(module, nn.Conv2d) and (module.in_channels == channels or not strict):
            return [image(module.in_channels)]
        if not isinstance(module, nn.Linear):
            return []
        features, per_patch = module.in_features, spatial * spatial * temporal
        if features == channels or (not strict and (spatial == 1 or features % per_patch)):
            return [packed(features), image(features), *video(features), channels_last(features)]
        if spatial > 1 and features % per_patch == 0 and (features // per_patch == channels or not strict):
            c = features // per_patch
            return [image(c), *video(c), channels_last(c), packed(features)]
        return []

    outer = list(_outer_modules(model))
    named = [(m, False) for n, m in outer if any(word in n for word in _LATENT_MODULES)]
    found: list[_Latents] = []
    for module, strict in [*named, *((m, True) for _, m in outer)]:
        found = from_module(module, strict)
        if found:
            break
    found += [image(channels), packed(channels), *video(channels)]
    return list(dict.fromkeys(found))


def _text_widths(model: nn.Module, config: Any) -> list[int]:
    """Candidate last dims of the text input: the text projections' in_features, then the config's text dims."""
    widths = [
        module.in_features
        for name, module in _outer_modules(model)
        if isinstance(module, nn.Linear)
        and any(word in name for word in _TEXT_MODULES)
        and not any(word in name for word in ("time", "pool"))
    ]
    declared = _config_int(
        config, "joint_attention_dim", "text_embed_dim", "cross_attention_dim", "caption_channels", "text_dim",
        "cap_feat_dim", "context_in_dim", "text_in_dim", "in_text_dim", "cond_token_dim", "text_hidden_dim",
    )  # fmt: skip
    ordered: list[int] = [*widths[:2], *([declared] if declared else []), SMALL_DIM]
    return list(dict.fromkeys(ordered))[:3]


def _pooled_width(model: nn.Module, config: Any) -> int:
    declared = _config_int(config, "pooled_projection_dim", "in_text_dim2", "global_cond_dim", "text_embed_2_dim")
    if declared is not None:
        return declared
    pooled = [m.in_features for n, m in _outer_modules(model) if isinstance(m, nn.Linear) and "pool" in n]
    return pooled[0] if pooled else SMALL_DIM


def _nested(param: inspect.Parameter) -> bool:
    """Whether the annotation asks for a list per sample of lists (``list[list[tuple[int, int, int]]]``)."""
    return "list[list" in str(param.annotation).replace("List[List", "list[list").replace("typing.", "")


def _geometry(name: str, param: inspect.Parameter, latents: _Latents) -> Any:
    """A value describing ``latents`` for the parameter ``name``, or None where the name says nothing of them."""
    frames, height, width = latents.grid
    tokens = frames * height * width
    if name == "img_ids":
        return TensorInput("zeros", (tokens, 3))
    if name == "txt_ids":
        return TensorInput("zeros", (TEXT, 3))
    if name in ("img_shapes", "shape_list"):
        shapes = [(frames, height, width)]
        return [shapes] * BATCH if _nested(param) else shapes * BATCH
    if name in ("num_frames", "height", "width"):
        return {"num_frames": frames, "height": height, "width": width}[name]
    if name in ("original_size", "target_size"):
        return TensorInput("full", (BATCH, 2), values=(float(8 * latents.shape[-1]),))
    if name == "crop_coords":
        return TensorInput("zeros", (BATCH, 2))
    if name == "position_ids":  # (t, h, w) rotary coordinates of the text and image tokens together
        return TensorInput("zeros", (TEXT + tokens, 3), dtype="long")
    if name == "padding_mask":
        return TensorInput("ones", (BATCH, 1, *latents.shape[-2:]))
    return None


def _choices(name: str, param: inspect.Parameter, model: nn.Module, config: Any) -> list[Any] | None:
    """Candidate values for a parameter the latents do not decide, best first; None to leave it out."""
    required = param.default is inspect.Parameter.empty
    if name in _TEXTS:
        return [TensorInput("randn", (BATCH, TEXT, w)) for w in _text_widths(model, config)]
    if name in _POOLED:
        return [TensorInput("randn", (BATCH, _pooled_width(model, config)))]
    if name in _MASKS or (required and name.endswith("mask")):
        return [TensorInput("ones", (BATCH, TEXT)), TensorInput("ones", (BATCH, TEXT), dtype="bool")]
    if required and (name.endswith(("_id", "_ids", "indices", "indexes", "tags")) or name == "input_ids"):
        return [TensorInput("randint", (BATCH, TEXT), high=2)]
    if name in ("text_lens",):
        return [TensorInput("tensor", values=(TEXT,) * BATCH, dtype="long")]
    if "timestep" in name or name in ("t", "sigma", "timesteps") or name.endswith("_time"):
        if not required and name != "timestep":
            return None
        return [
            TensorInput("tensor", values=(10, 500), dtype="long"),
            TensorInput("tensor", values=(0.01, 0.5)),
            TensorInput("full", (BATCH, FRAMES), values=(0.5,)),  # one per latent frame
        ]
    if name == "return_dict":
        return [False]
    if required:
        return [TensorInput("randn", (BATCH, SIDE, SMALL_DIM))]
    return None


def _group(name: str, choices: list[Any]) -> str:
    """The choice a parameter shares with those whose candidates are the same (timesteps, masks take one form)."""
    return repr(choices) if len(choices) > 1 and all(isinstance(c, TensorInput) for c in choices) else name


def diffusers_candidates(model: nn.Module, params: Mapping[str, inspect.Parameter]) -> Iterator[dict[str, Any]]:
    """Input specs for ``model.forward``'s ``params``, best first: every choice's first candidate, then those
    that differ in one choice, then in two, and so on."""
    config = getattr(model, "config", None)
    latent_names = [n for n in params if n in _LATENTS][:1]
    fixed: dict[str, list[Any]] = {}
    groups: dict[str, str] = {}  # parameter -> the choice it shares: all timesteps take one form, all masks one
    for name, param in params.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) or name in latent_names:
            continue
        if name in _GEOMETRY and latent_names:
            continue
        choices = _choices(name, param, model, config)
        if choices is not None:
            groups[name] = _group(name, choices)
            fixed.setdefault(groups[name], choices)
    options = [_latents(model, config) if latent_names else [None], *fixed.values()]
    position = {group: 1 + index for index, group in enumerate(fixed)}
    # Fewest choices off their first candidate first; among those, another layout of the latents first.
    combos = sorted(itertools.product(*(range(len(o)) for o in options)), key=lambda c: (sum(c), -c[0]))
    for combo in combos:
        latents: _Latents | None = options[0][combo[0]]
        spec: dict[str, Any] = {}
        for name, param in params.items():
            if latents is not None and name in latent_names:
                spec[name] = TensorInput("randn", latents.shape)
            elif name in groups:
                spec[name] = fixed[groups[name]][combo[position[groups[name]]]]
            elif latents is not None:
                value = _geometry(name, param, latents)
                if value is not None:
                    spec[name] = value
        yield spec
