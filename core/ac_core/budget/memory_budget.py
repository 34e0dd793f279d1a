"""A memory budget as users give it (a fraction of ``none``, bytes, or a size such as ``"40GiB"``), parsed once."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 2**10,
    "m": 10**6, "mb": 10**6, "mib": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30,
    "t": 10**12, "tb": 10**12, "tib": 2**40,
}  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_WHAT = (
    "memory_budget is a fraction of what 'none' holds for backward (a float, 0 < f <= 1), bytes (an int) or a size "
    "string such as '40GiB'"
)


@dataclass(frozen=True)
class MemoryBudget:
    """A parsed memory budget: ``fraction`` of what ``none`` holds for backward, or ``nbytes``; ``given`` is what
    the user wrote, for messages. Made by :meth:`of`, which every consumer calls on what it was given."""

    given: float | int | str
    fraction: float | None = None
    nbytes: int | None = None

    @classmethod
    def of(cls, memory_budget: object) -> MemoryBudget:
        """``memory_budget`` parsed (a MemoryBudget as is); a TypeError/ValueError naming the fix otherwise."""
        if isinstance(memory_budget, MemoryBudget):
            return memory_budget
        if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float, str)):
            raise TypeError(f"{_WHAT}; got {memory_budget!r}")
        if isinstance(memory_budget, float):
            if not 0 < memory_budget <= 1:
                raise ValueError(
                    f"memory_budget={memory_budget!r}: a float is a fraction of what 'none' holds for backward, "
                    "0 < f <= 1; for bytes pass an int or a size string such as '40GiB'"
                )
            return cls(memory_budget, fraction=memory_budget)
        if isinstance(memory_budget, int):
            if memory_budget <= 0:
                raise ValueError(f"memory_budget={memory_budget!r}: bytes must be > 0")
            return cls(memory_budget, nbytes=memory_budget)
        match = _SIZE.match(memory_budget)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"memory_budget={memory_budget!r} is not a size: use a number and a unit such as '40GiB', '512MiB', "
                "'1.5GB' (units B, KB/KiB, MB/MiB, GB/GiB, TB/TiB)"
            )
        nbytes = math.floor(float(match.group(1)) * _UNITS[unit])
        if nbytes <= 0:
            raise ValueError(f"memory_budget={memory_budget!r}: bytes must be > 0")
        return cls(memory_budget, nbytes=nbytes)

    def bytes_of(self, none_bytes: int) -> int:
        """The budget in bytes, where ``none`` holds ``none_bytes``."""
        return math.floor(self.fraction * none_bytes) if self.fraction is not None else int(self.nbytes or 0)

    def fraction_of(self, none_bytes: int) -> float:
        """The budget as a fraction of ``none_bytes`` (a size above it: 1)."""
        return self.fraction if self.fraction is not None else min(1.0, (self.nbytes or 0) / none_bytes)

    def __str__(self) -> str:
        return str(self.given)
