"""The library route: an adapter derived from what diffusers or transformers declare, for a model no adapter serves.

A diffusers ``ModelMixin`` or a transformers ``PreTrainedModel`` names its repeated block classes
(:mod:`.declarations`); the containers holding them, outermost only, are its block containers, and attention
comes from the library's backends (:mod:`.diffusers`, :mod:`.transformers`, with the KV-cache rule). Declared
classes outside every container (patch embeddings, norms, token refiners) are one-off modules, left alone. Where
the declarations are missing or contradict the model (no declared class in any container, or a container of
attention blocks of an undeclared class) nothing is guessed: the route says why, and the caller names the
model's containers. The registry tries it after the curated adapters.

The spec is kept per class and checked against each model's layout (a config can add or drop a container);
it is found again from the class in any process, so it is never named by reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from ..containers import inside, repeated_block_lists
from ..spec import AdapterSpec, ExcludedContainer, ModelSpec, class_path
from . import diffusers, transformers
from .configs import library_of
from .declarations import declared_block_classes, declared_containers, is_declared_block, one_off_modules

_LIBRARIES = ("diffusers", "transformers")

_cache: dict[type, AdapterSpec] = {}


@dataclass(frozen=True)
class Refusal:
    """Why the library route does not serve a model of ``library``: its declarations are missing or contradictory."""

    library: str
    reason: str


def route_name(library: str) -> str:
    """The name of the adapters the route derives for models of ``library``."""
    return f"{library}-route"


def route_source(spec: AdapterSpec) -> str | None:
    """``"the diffusers library route"`` for a spec the route derived (in this process or another), else None."""
    if spec.library in _LIBRARIES and spec.name == route_name(spec.library):
        return f"the {spec.library} library route"
    return None


def model_library(cls: type) -> str | None:
    """``"diffusers"`` or ``"transformers"`` where ``cls`` is a model of that library, else None (nothing imported)."""
    library = library_of(cls)
    return library if library in _LIBRARIES else None


def _runs_attention(container: nn.Module) -> bool:
    # Read from class names, as the declarations are: diffusers' Attention, transformers' *Attention modules.
    return any("Attention" in c.__name__ or "Attn" in c.__name__ for m in container.modules() for c in type(m).__mro__)


def _described(model: nn.Module, path: str) -> str:
    children = list(model.get_submodule(path).children())
    return f"{path!r} ({len(children)} x {type(children[0]).__name__})"


def _undeclared_attention_lists(model: nn.Module, declared: frozenset[str], containers: list[str]) -> list[str]:
    """Containers of repeated attention blocks outside ``containers`` with no module of a declared class in them."""
    found = []
    for path in repeated_block_lists(model):
        container = model.get_submodule(path)
        if inside(path, containers) or any(is_declared_block(m, declared) for m in container.modules()):
            continue
        if _runs_attention(container):
            found.append(path)
    return found


def _no_containers(library: str, declared: frozenset[str]) -> str:
    if declared:
        return (
            f"none of the block classes it declares ({', '.join(sorted(declared))}) sits in a ModuleList, "
            "ModuleDict or Sequential"
        )
    if library == "transformers":
        return (
            "it declares no block class (_no_split_modules is empty) and none of its modules is a "
            "GradientCheckpointingLayer"
        )
    return "it declares no block class (_repeated_blocks and _no_split_modules are empty)"


def _fields(library: str, cls: type) -> dict[str, Any]:
    if library == "diffusers":
        return diffusers.adapter_fields()
    # A class that does not support SDPA is built on eager attention.
    return transformers.adapter_fields(default_backend="sdpa" if getattr(cls, "_supports_sdpa", True) else "eager")


def _derive(model: nn.Module, library: str) -> AdapterSpec | Refusal:
    declared = declared_block_classes(model)
    containers = declared_containers(model, declared)
    if not containers:
        return Refusal(library, _no_containers(library, declared))
    one_offs = one_off_modules(model, declared, containers)
    excluded, contradicting = [], []
    for path in _undeclared_attention_lists(model, declared, containers):
        owner = next(((fqn, name) for fqn, name in one_offs if inside(path, [fqn])), None)
        if owner is None:
            contradicting.append(_described(model, path))
            continue
        excluded.append(
            ExcludedContainer(
                path,
                f"inside {owner[1]} at {owner[0]!r}, which {library} declares as one module rather than as "
                "repeated blocks: left unchecked (name it in blocks=[...] to checkpoint it)",
            )
        )
    if contradicting:
        return Refusal(
            library,
            f"{', '.join(contradicting)} hold{'s' if len(contradicting) == 1 else ''} attention blocks of a class it "
            f"does not declare (declared: {', '.join(sorted(declared)) or 'none'})",
        )
    cls = type(model)
    spec = ModelSpec(cls=class_path(cls), containers=tuple(containers), excluded=tuple(excluded))
    return AdapterSpec(name=route_name(library), models=(spec,), library=library, **_fields(library, cls))


def derive_adapter(model: nn.Module) -> AdapterSpec | Refusal | None:
    """The adapter derived from ``model``'s declarations, a :class:`Refusal` where they do not name its blocks, or
    None where ``model`` is no diffusers or transformers model.

    The same spec object comes back for every model of a class with the same containers.
    """
    cls = type(model)
    library = model_library(cls)
    if library is None:
        return None
    derived = _derive(model, library)
    if isinstance(derived, Refusal):
        return derived
    cached = _cache.get(cls)
    if cached is not None and cached.models == derived.models:
        return cached
    _cache[cls] = derived
    return derived


def cached_adapter(cls: type) -> AdapterSpec | None:
    """The spec the route last derived for a model of ``cls`` in this process, if any."""
    return _cache.get(cls)
