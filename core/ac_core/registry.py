"""Adapter discovery: the ``ac_core.adapters`` entry-point group plus adapters registered in code, then, for a
diffusers or transformers model none of them serves, the library route (:mod:`ac_core.libraries.route`). A model
in a wrapper (peft, torch.compile, DDP, accelerate) is served by the adapter of the model inside
(:mod:`ac_core.unwrap`)."""

from __future__ import annotations

import logging
from importlib.metadata import entry_points

from torch import nn

from .containers import blocks_hint
from .errors import AdapterError
from .libraries.route import Refusal, cached_adapter, derive_adapter, model_library
from .refs import is_ref, load_ref
from .spec import AdapterSpec
from .unwrap import unwrap_model

ENTRY_POINT_GROUP = "ac_core.adapters"

logger = logging.getLogger("ac_core")

_registry: dict[str, AdapterSpec] = {}
_failed: dict[str, str] = {}  # entry point name -> why it did not load, said again when it is asked for
_entry_points_loaded = False


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _registry:
            continue
        try:
            spec = ep.load()
            if callable(spec) and not isinstance(spec, AdapterSpec):
                spec = spec()
        except Exception as exc:
            # One broken third-party adapter must not take the others down with it.
            _failed[ep.name] = f"its entry point {ep.value!r} failed to load: {type(exc).__name__}: {exc}"
            logger.warning("ac-core: adapter entry point %r (%s) failed to load: %s", ep.name, ep.value, exc)
            continue
        if not isinstance(spec, AdapterSpec):
            _failed[ep.name] = f"its entry point {ep.value!r} gave a {type(spec).__name__}, not an AdapterSpec"
            logger.warning(
                "ac-core: adapter entry point %r (%s) gave %s, not an AdapterSpec; skipped",
                ep.name,
                ep.value,
                type(spec).__name__,
            )
            continue
        if spec.name != ep.name:
            logger.warning(
                "ac-core: entry point %r loads adapter named %r; registered as %r",
                ep.name,
                spec.name,
                spec.name,
            )
        _registry.setdefault(spec.name, spec)


def register_adapter(spec: AdapterSpec, *, replace: bool = False) -> AdapterSpec:
    """Register ``spec`` under its name; a second spec of the same name needs ``replace=True``."""
    if not isinstance(spec, AdapterSpec):
        raise TypeError(f"register_adapter takes an AdapterSpec, got {type(spec).__name__}")
    _load_entry_points()
    if spec.name in _registry and _registry[spec.name] is not spec and not replace:
        raise AdapterError(f"an adapter named {spec.name!r} is already registered; pass replace=True to replace it")
    _registry[spec.name] = spec
    return spec


def unregister_adapter(name: str) -> None:
    """Remove a registered adapter (mostly for tests); unknown names are ignored."""
    _load_entry_points()
    _registry.pop(name, None)


def registered_adapters() -> dict[str, AdapterSpec]:
    """All adapters known here, by name: entry points and code registrations."""
    _load_entry_points()
    return dict(_registry)


def _load(ref: str) -> AdapterSpec:
    spec = load_ref(ref, what="adapter")
    if callable(spec) and not isinstance(spec, AdapterSpec):
        spec = spec()
    if not isinstance(spec, AdapterSpec):
        raise AdapterError(f"adapter {ref!r} is a {type(spec).__name__}, not an AdapterSpec")
    return spec


def _wrapping(model: nn.Module) -> str:
    """`` (wrapping a.B, wrapping c.D)`` for a wrapped model, else empty: for messages."""
    return "".join(
        f" (wrapping {type(inner).__module__}.{type(inner).__qualname__} at {path!r})"
        for path, inner in unwrap_model(model)[1:]
    )


def get_adapter(model_or_name: nn.Module | type | str | AdapterSpec) -> AdapterSpec:
    """The adapter for a model (instance or class), a registered name, ``"module:attr"``, or a spec (as is).

    A model no registered adapter serves, if it is a diffusers or transformers model, gets the library route's
    adapter, derived from what its class declares; where that does not name its blocks either, the error lists
    the model's containers of repeated blocks as a ready ``blocks=[...]``.
    """
    if isinstance(model_or_name, AdapterSpec):
        return model_or_name
    if isinstance(model_or_name, str):
        if is_ref(model_or_name):
            return _load(model_or_name)
        adapters = registered_adapters()
        if model_or_name in adapters:
            return adapters[model_or_name]
        failed = _failed.get(model_or_name)
        if failed is not None:
            raise AdapterError(f"adapter {model_or_name!r} is installed but {failed}")
        raise AdapterError(
            f"no adapter named {model_or_name!r}; registered adapters: {sorted(adapters) or 'none'}"
            " (ours install with pip install 'ac-core[all]'; another is named as 'module:attr')"
        )
    if not isinstance(model_or_name, (nn.Module, type)):
        raise TypeError(
            f"adapter takes a registered adapter name (e.g. 'flux'), 'module:attr' of an AdapterSpec, or an "
            f"AdapterSpec; got {model_or_name!r} of type {type(model_or_name).__name__}"
        )
    cls, matches = _curated(model_or_name)
    if len(matches) > 1:
        raise AdapterError(
            f"{cls.__name__} is served by several adapters {[s.name for s in matches]}; name one with adapter=..."
        )
    if matches:
        return matches[0]
    routed = _library_route(model_or_name)
    if isinstance(routed, AdapterSpec):
        return routed
    raise _none_serves(model_or_name, routed)


def _curated(model: nn.Module | type) -> tuple[type, list[AdapterSpec]]:
    """The class served and the registered adapters serving it: of ``model``, else of the first model it wraps
    that one serves."""
    adapters = registered_adapters().values()
    cls = model if isinstance(model, type) else type(model)
    matches = [spec for spec in adapters if spec.serves(cls)]
    if not matches and isinstance(model, nn.Module):
        for _, inner in unwrap_model(model)[1:]:
            matches = [spec for spec in adapters if spec.serves(inner)]
            if matches:
                return type(inner), matches
    return cls, matches


def _library_route(model: nn.Module | type) -> AdapterSpec | Refusal | None:
    """The library route's adapter (or refusal) for the first of ``model`` and the models it wraps that is a
    diffusers or transformers model; a class gets the spec derived for one of its models earlier, if any."""
    if isinstance(model, type):
        return cached_adapter(model)
    for _, inner in unwrap_model(model):
        routed = derive_adapter(inner)
        if routed is not None:
            return routed
    return None


def _none_serves(model: nn.Module | type, refusal: Refusal | None) -> AdapterError:
    cls = model if isinstance(model, type) else type(model)
    if isinstance(model, type):
        library = model_library(model)
        why = (
            f"; the {library} library route derives a model's blocks from the model itself: pass the model"
            if library
            else ""
        )
        hint = "pass blocks=[...] with the FQN of each container holding its blocks"
    else:
        why = f"; the {refusal.library} library route does not guess its blocks: {refusal.reason}" if refusal else ""
        hint = blocks_hint(model)
    return AdapterError(
        f"no registered adapter serves {cls.__module__}.{cls.__qualname__}"
        f"{_wrapping(model) if isinstance(model, nn.Module) else ''}{why}; registered adapters: "
        f"{sorted(registered_adapters()) or 'none'}. Name its block containers instead: {hint}."
    )


def find_adapter(model: nn.Module) -> AdapterSpec | None:
    """The adapter serving ``model`` (a registered one, else the library route's), or None where none does: the
    graph route, which finds blocks itself, asks this."""
    _, matches = _curated(model)
    if matches:
        return get_adapter(model)
    routed = _library_route(model)
    return routed if isinstance(routed, AdapterSpec) else None
