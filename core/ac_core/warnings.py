"""Warnings ac-core gives once per process, and the public way to start over (tests, notebooks)."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("ac_core")

_given: set[str] = set()


def warn_once(key: str, message: str, *args: Any, level: int = logging.WARNING) -> bool:
    """Log ``message % args`` the first time ``key`` is seen in this process; returns whether it was logged."""
    if key in _given:
        return False
    _given.add(key)
    logger.log(level, message, *args)
    return True


def reset_warnings() -> None:
    """Forget which once-per-process warnings were given, so the next occurrence of each is logged again."""
    _given.clear()
