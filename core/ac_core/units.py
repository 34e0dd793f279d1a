"""Quantities as people read them, shared by the planner's tables and the command line's reports."""

from __future__ import annotations

_BINARY_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def human_bytes(n: float | None, digits: int = 1) -> str:
    """``n`` bytes in the largest binary unit it reaches, GiB at most, with ``digits`` decimals (``"1.5 GiB"``);
    under 1 KiB in whole bytes (``"512 B"``); ``"-"`` for None (nothing measured)."""
    if n is None:
        return "-"
    for unit, size in _BINARY_UNITS:
        if abs(n) >= size:
            return f"{n / size:.{digits}f} {unit}"
    return f"{n:.0f} B"
