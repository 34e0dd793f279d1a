"""One sweep row and its JSON form: what was built, what served it, what each check found."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .checks import Outcome

PROVEN = "proven"
FAILED = "failed"
REFUSED = "refused"
NOT_BUILT = "not built"
TIMED_OUT = "timed out"
CRASHED = "crashed"
RESULTS = (PROVEN, FAILED, REFUSED, NOT_BUILT, TIMED_OUT, CRASHED)


@dataclass
class ClassResult:
    """The sweep's finding for one target: ``result`` one of :data:`RESULTS`, ``reason`` why where not proven."""

    library: str
    name: str
    class_name: str
    result: str
    reason: str = ""
    served_by: str | None = None
    containers: dict[str, int] = field(default_factory=dict)  # container path -> blocks in the tiny model
    attention: dict[str, Any] = field(default_factory=dict)  # block class -> attention calls per block
    checks: list[Outcome] = field(default_factory=list)
    declared: str = ""  # why the class's build is declared in ac_core.libraries.class_builds, where it is
    seconds: float = 0.0

    @property
    def proven(self) -> bool:
        return self.result == PROVEN

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ClassResult:
        checks = [Outcome(**c) for c in data.get("checks", [])]
        return cls(**{**data, "checks": checks})
