"""The conformance checks as plain functions, each with its pytest class: a check fails with an AssertionError naming
what is wrong.

Each takes a :class:`~ac_core_conformance.subjects.Subject` (an adapter and one of its model specs)
and skips (``pytest.skip``) only where the adapter declares no such capability or the device is absent.
This package exports every name (``__all__``) of each module the package's check registry lists.
"""

from __future__ import annotations

import importlib

from .._registry import CHECKS


def _exports() -> dict[str, object]:
    names: dict[str, object] = {}
    for check in CHECKS:
        module = importlib.import_module(f".{check.name}", __name__)
        names.update((name, getattr(module, name)) for name in module.__all__)
    return names


_NAMES = _exports()
globals().update(_NAMES)

__all__ = sorted(_NAMES)  # pyright: ignore[reportUnsupportedDunderAll]  # derived from the registry
