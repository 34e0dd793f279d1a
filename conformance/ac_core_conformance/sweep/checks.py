"""The sweep's light conformance: the suite's own checks, run on one subject, as outcomes instead of test results.

Blocks covered, loss and gradients bit-equal to the plain model under ``full`` and ``ops``, attention never
re-run in backward under ``ops`` (where the default backend's kernel is one ops can keep), names unchanged, a
plan for half of what ``none`` holds held within its budget. The first failing check ends the subject's run.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from ..checks.attention import check_attention_retained
from ..checks.budget import check_budget
from ..checks.coverage import check_coverage
from ..checks.gradients import check_gradients
from ..checks.names import check_names
from ..subjects import Subject
from ..training import Tolerance

EXACT = Tolerance(rtol=0.0, atol=0.0)
"""On CPU a checkpointed model's recompute is bit-exact, so the sweep allows no difference at all."""


@dataclass(frozen=True)
class Outcome:
    """One check on one subject: ``passed``, ``skipped`` (with why) or ``failed`` (with the check's message)."""

    check: str
    status: str
    detail: str = ""


def _retains_attention(subject: Subject) -> str | None:
    """Why the attention check does not apply to ``subject``, or None where it does."""
    adapter = subject.adapter
    if adapter.default_backend is None:
        return "the adapter declares no attention backend"
    backend = adapter.backend(adapter.default_backend)
    if not backend.retainable:
        return f"its default backend {backend.name!r} is not retainable: {backend.not_retainable}"
    if not any(subject.model.attention_calls.values()):
        return f"its default backend {backend.name!r} runs no kernel ops keeps in the tiny model"
    return None


def _checks(subject: Subject) -> list[tuple[str, Callable[[], object] | str]]:
    """(name, run) per check, or (name, why it does not apply)."""
    not_applicable = _retains_attention(subject)
    backend = subject.adapter.default_backend or ""
    return [
        ("blocks covered", lambda: check_coverage(subject, "full")),
        ("full: gradients bit-equal", lambda: check_gradients(subject, "full", tolerance=EXACT)),
        ("ops: gradients bit-equal", lambda: check_gradients(subject, "ops", tolerance=EXACT)),
        ("ops: attention kept", not_applicable or (lambda: check_attention_retained(subject, backend))),
        ("names unchanged", lambda: check_names(subject, "ops")),
        ("50% budget plan held", lambda: check_budget(subject, 0.5, tolerance=EXACT)),
    ]


def _message(exc: BaseException) -> str:
    # One line for the table: the suite's messages span lines ("...:\n  - problem").
    text = " ".join(str(exc).split()) or type(exc).__name__
    text = re.sub(r"\[[^\[\]]{80,}\]", "[…]", text)  # long op-name lists: the problem after them matters
    if not isinstance(exc, AssertionError):
        text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= 400 else text[:399] + "…"


def run_checks(subject: Subject) -> list[Outcome]:
    """Each check's outcome, in order, up to and including the first that fails."""
    outcomes: list[Outcome] = []
    for name, run in _checks(subject):
        if isinstance(run, str):
            outcomes.append(Outcome(name, "skipped", run))
            continue
        try:
            run()
        except pytest.skip.Exception as exc:
            outcomes.append(Outcome(name, "skipped", str(exc.msg)))
        except Exception as exc:  # a check's failure, or the model's own error under it
            outcomes.append(Outcome(name, "failed", _message(exc)))
            break
        else:
            outcomes.append(Outcome(name, "passed"))
    return outcomes
