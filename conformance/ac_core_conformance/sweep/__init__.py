"""The sweep: every model class diffusers or transformers declares, built tiny and put through a light conformance.

``ac-core sweep`` runs it; :func:`sweep` returns one :class:`ClassResult` per class, kept as a
:class:`SweepRecord` (JSON) and rendered into ``docs/coverage.md``.
"""

from __future__ import annotations

from .catalog import LIBRARIES, Target, targets
from .checks import EXACT, Outcome, run_checks
from .report import (
    SweepRecord,
    failure_reasons,
    installed_versions,
    merged,
    read_record,
    regressions,
    render_section,
    write_record,
    write_table,
)
from .results import RESULTS, ClassResult
from .runner import TIME_LIMIT, sweep, sweep_one
from .subject import NotBuilt, Refused, tiny_subject

__all__ = [
    "EXACT",
    "LIBRARIES",
    "RESULTS",
    "TIME_LIMIT",
    "ClassResult",
    "NotBuilt",
    "Outcome",
    "Refused",
    "SweepRecord",
    "Target",
    "failure_reasons",
    "installed_versions",
    "merged",
    "read_record",
    "regressions",
    "render_section",
    "run_checks",
    "sweep",
    "sweep_one",
    "targets",
    "tiny_subject",
    "write_record",
    "write_table",
]
