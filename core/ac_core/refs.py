"""Loading an object named ``"module:attr"``: adapters, their tiny-model factories and presets, CLI arguments."""

from __future__ import annotations

import importlib
from typing import Any

from .errors import AdapterError


def is_ref(value: object) -> bool:
    """Whether ``value`` is a ``"module:attr"`` string (a dotted module, one colon, an attribute path)."""
    if not isinstance(value, str):
        return False
    module, sep, attr = value.partition(":")
    return bool(sep and module and attr and ":" not in attr)


def load_ref(ref: str, *, what: str = "object") -> Any:
    """The object ``"pkg.module:attr"`` names (``attr`` may be dotted); an AdapterError naming the miss otherwise.

    ``what`` says in the message what the reference was for (``"adapter"``, ``"tiny factory"``).
    """
    if not is_ref(ref):
        raise AdapterError(f"{what} reference {ref!r} is not of the form 'package.module:attribute'")
    module_name, _, attr = ref.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise AdapterError(f"{what} {ref!r}: cannot import module {module_name!r} ({exc})") from exc
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise AdapterError(f"{what} {ref!r}: {module_name!r} has no attribute {attr!r}") from None
    return target
