"""What the suite runs on: an adapter, found from an object, a registered name or ``"module:attr"``, and its models."""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, replace
from importlib.metadata import entry_points

from torch import nn

from ac_core import (
    ENTRY_POINT_GROUP,
    AdapterError,
    AdapterSpec,
    ModelBlocks,
    ModelSpec,
    get_adapter,
    registered_adapters,
    resolve_blocks,
)
from ac_core.refs import is_ref

AdapterRef = AdapterSpec | str
"""An adapter as the suite accepts it: the spec itself, its registered name, or ``"module:attr"``."""


def load_adapter(ref: AdapterRef) -> AdapterSpec:
    """The AdapterSpec ``ref`` names: a spec (returned as is), a registered name, or ``"module:attr"``."""
    # get_adapter also finds one from a model; the suite is always told which adapter to check.
    if not isinstance(ref, (AdapterSpec, str)) or not ref:
        raise TypeError(f"an adapter is an AdapterSpec, a registered name or 'module:attr', got {ref!r}")
    return get_adapter(ref)


def _entry_point_names() -> set[str]:
    return {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}


def _module_attribute_of(spec: AdapterSpec) -> str | None:
    # A spec registered only in code is found by identity among loaded modules' globals.
    found: list[str] = []
    for name, module in list(sys.modules.items()):
        if module is None or name == "__main__":
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        found.extend(f"{name}:{attr}" for attr, value in list(namespace.items()) if value is spec)
    # Prefer the defining library module over test modules that merely import it.
    found.sort(key=lambda ref: ("test" in ref.partition(":")[0], ref))
    return found[0] if found else None


def portable_ref(ref: AdapterRef) -> str:
    """A string that another process (a spawned FSDP rank) resolves to the same adapter.

    A ``"module:attr"`` string is kept; a name is kept when an installed entry point provides it;
    a spec object is found as a module-level attribute of a loaded module. A spec that exists only
    inside a function (or a name registered only with ``register_adapter``) cannot be found from
    another process: define it at module level, or give the suite its ``"module:attr"``.
    """
    if isinstance(ref, str) and is_ref(ref):
        return ref
    spec = load_adapter(ref)
    if spec.name in _entry_point_names() and registered_adapters().get(spec.name) is spec:
        return spec.name
    found = _module_attribute_of(spec)
    if found is None:
        raise AdapterError(
            f"adapter {spec.name!r} is registered only in this process, so the FSDP2 check's worker processes "
            "cannot load it. Define the AdapterSpec at module level in an importable module and give the suite "
            "'module:attr' (or register it through the ac_core.adapters entry point)."
        )
    return found


@dataclass(frozen=True)
class Subject:
    """One model class of one adapter: the unit every check runs on.

    ``ref`` is how the adapter was named to the suite; processes the suite spawns resolve it again.
    """

    adapter: AdapterSpec
    model: ModelSpec
    ref: AdapterRef

    def __post_init__(self) -> None:
        if self.model not in self.adapter.models:
            raise AdapterError(f"{self.model.cls} is not one of adapter {self.adapter.name!r}'s model specs")

    @property
    def id(self) -> str:
        """``adapter-ModelClass``, as test ids show it; ``adapter-ModelClass-factory`` where the adapter
        declares the class more than once (e.g. one spec per block variant)."""
        return f"{self.adapter.name}-{self.adapter.model_label(self.model)}"

    def blocks(self, model: nn.Module) -> ModelBlocks:
        """``model``'s blocks as this subject's ModelSpec declares them (not another spec of the same class)."""
        return resolve_blocks(model, replace(self.adapter, models=(self.model,)))

    def plan(self, model: nn.Module) -> ModelBlocks:
        """The old name of :meth:`blocks` (a DeprecationWarning says so)."""
        warnings.warn("Subject.plan(model) is deprecated; use Subject.blocks(model)", DeprecationWarning, stacklevel=2)
        return self.blocks(model)


def subjects_of(ref: AdapterRef) -> list[Subject]:
    """Every model class the adapter ``ref`` serves, as Subjects."""
    adapter = load_adapter(ref)
    return [Subject(adapter, model, ref) for model in adapter.models]


__all__ = ["AdapterRef", "Subject", "load_adapter", "portable_ref", "subjects_of"]
