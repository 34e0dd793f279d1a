"""Old keyword and attribute names that keep working, with a DeprecationWarning naming the new one."""

from __future__ import annotations

import warnings
from typing import Any

UNSET: Any = object()
"""Default of a deprecated keyword: tells "not given" apart from any value."""


def renamed(function: str, old: str, new: str, old_value: Any, new_value: Any, new_default: Any) -> Any:
    """The value of keyword ``new``, or of ``old`` (with a DeprecationWarning) where only ``old`` was given."""
    if old_value is UNSET:
        return new_value
    if new_value is not new_default:
        raise TypeError(f"{function}() got both {old}= and its new name {new}=; pass {new}= only")
    warnings.warn(f"{function}(): {old}= is renamed {new}=; pass {new}= instead", DeprecationWarning, stacklevel=3)
    return old_value


def old_attribute(module: str, old: str, use: str, value: Any) -> Any:
    """``value`` looked up under its old public name ``module.old``, with a DeprecationWarning naming ``use``."""
    warnings.warn(f"{module}.{old} is deprecated; use {use}", DeprecationWarning, stacklevel=3)
    return value
