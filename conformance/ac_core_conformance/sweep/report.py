"""The sweep's record: rows as JSON (kept, merged, compared with an earlier sweep) and as a markdown table.

The JSON file is the record; the table in ``docs/coverage.md`` is rendered from it, one section per library
between markers, so sweeping one library rewrites only its own section.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

from .results import PROVEN, RESULTS, ClassResult


@dataclass
class SweepRecord:
    """Every row of one library's sweep, with the versions it ran on."""

    library: str
    versions: dict[str, str]
    rows: list[ClassResult]

    @property
    def proven(self) -> list[ClassResult]:
        return [row for row in self.rows if row.proven]

    def to_json(self) -> dict[str, Any]:
        return {"library": self.library, "versions": self.versions, "rows": [row.to_json() for row in self.rows]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SweepRecord:
        return cls(data["library"], dict(data["versions"]), [ClassResult.from_json(r) for r in data["rows"]])


def installed_versions(library: str) -> dict[str, str]:
    return {name: version(name) for name in (library, "torch", "ac-core")}


def read_record(path: Path) -> SweepRecord | None:
    """The record in ``path``, or None where there is no such file."""
    if not path.exists():
        return None
    return SweepRecord.from_json(json.loads(path.read_text()))


def write_record(path: Path, record: SweepRecord) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record.to_json(), indent=1) + "\n")


def merged(earlier: SweepRecord | None, record: SweepRecord) -> SweepRecord:
    """``record``'s rows over ``earlier``'s (a sweep of some classes keeps the other classes' rows)."""
    if earlier is None or earlier.library != record.library:
        return record
    fresh = {row.name: row for row in record.rows}
    rows = [fresh.pop(row.name, row) for row in earlier.rows]
    rows += list(fresh.values())
    return SweepRecord(record.library, record.versions, sorted(rows, key=lambda row: row.name))


def regressions(baseline: SweepRecord, record: SweepRecord) -> list[tuple[ClassResult, ClassResult]]:
    """(before, now) of each class ``record`` swept that was proven in ``baseline`` and is not now."""
    before = {row.name: row for row in baseline.rows}
    return [
        (before[row.name], row)
        for row in record.rows
        if row.name in before and before[row.name].proven and not row.proven
    ]


def failure_reasons(rows: Iterable[ClassResult]) -> list[tuple[str, list[str]]]:
    """The reasons rows are not proven, grouped (numbers and names made generic), most common first."""
    groups: dict[str, list[str]] = {}
    for row in rows:
        if row.proven:
            continue
        groups.setdefault(reason_kind(row), []).append(row.name)
    return sorted(groups.items(), key=lambda item: (-len(item[1]), item[0]))


def reason_kind(row: ClassResult) -> str:
    """A row's reason without what is particular to its class: the kind of failure it is."""
    text = row.reason.replace(row.class_name, "<class>").split(" (", 1)[0]
    text = re.sub(r"'[^']*'|\"[^\"]*\"|\[[^\]]*\]", "…", text)
    text = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", text)
    return f"{row.result}: {text[:120]}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _attention(row: ClassResult) -> str:
    return "; ".join(f"{cls}: {calls}" for cls, calls in row.attention.items())


def _note(row: ClassResult) -> str:
    declared = [f"built as declared in ac_core.libraries.class_builds ({row.declared})"] if row.declared else []
    if not row.proven:
        return "; ".join([row.reason, *declared])
    skipped = [f"{o.check} not run: {o.detail}" for o in row.checks if o.status == "skipped"]
    return "; ".join([*declared, *skipped])


def render_section(record: SweepRecord) -> str:
    """The markdown section for ``record``: counts, then one row per class."""
    counts = Counter(row.result for row in record.rows)
    summary = ", ".join(f"{counts[r]} {r}" for r in RESULTS if counts[r] and r != PROVEN)
    versions = ", ".join(f"{k} {v}" for k, v in record.versions.items())
    lines = [
        f"## {record.library}",
        "",
        f"{len(record.rows)} classes ({versions}): **{counts[PROVEN]} proven**" + (f", {summary}." if summary else "."),
        "",
        "| Class | Served by | Containers (blocks) | Attention calls per block | Result | Reason or note |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in record.rows:
        name = row.name if row.name == row.class_name else f"{row.name} ({row.class_name})"
        containers = ", ".join(f"`{path}` ({n})" for path, n in row.containers.items())
        lines.append(
            "| "
            + " | ".join(
                _cell(cell) for cell in (name, row.served_by or "", containers, _attention(row), row.result, _note(row))
            )
            + " |"
        )
    return "\n".join(lines) + "\n"


_HEADER = """# Coverage: every model class the sweep builds and proves

Written by `ac-core sweep diffusers|transformers --json docs/coverage/LIBRARY.json --table docs/coverage.md` (CI
runs it in one nox session per library and fails when a class proven before is not proven now). Each class is
built tiny from its own defaults, served by the adapter ac-core picks for it (a curated adapter, else the
library route), and checked: blocks covered; loss and gradients bit-equal to the plain model under `full` and
`ops`; attention kernels re-run in backward under `ops` = 0 where the default backend reaches a retainable
kernel; parameter, state_dict and module names unchanged; a plan for 50% of what `none` holds held within its
budget. A row names the first check that failed, or why the class was not built or not served.
"""


def _markers(library: str) -> tuple[str, str]:
    return f"<!-- sweep:{library}:start -->", f"<!-- sweep:{library}:end -->"


def write_table(path: Path, record: SweepRecord, libraries: Sequence[str]) -> None:
    """Rewrite ``record.library``'s section of the markdown file ``path`` (created with every library's markers)."""
    text = (
        path.read_text()
        if path.exists()
        else _HEADER + "".join(f"\n{start}\n{end}\n" for start, end in map(_markers, libraries))
    )
    start, end = _markers(record.library)
    if start not in text or end not in text:
        text += f"\n{start}\n{end}\n"
    head, _, rest = text.partition(start)
    _, _, tail = rest.partition(end)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{head}{start}\n{render_section(record)}{end}{tail}")
