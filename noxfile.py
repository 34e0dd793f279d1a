"""Sessions: `nox` with no arguments runs exactly what CI runs."""

from __future__ import annotations

import nox

# The CPU wheel of this torch lies on the CI machines' disk; an unpinned torch pulls a multi-GB CUDA build.
TORCH = "torch==2.13.0"

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = False


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def tests(session: nox.Session) -> None:
    session.install(TORCH, "-e", ".[all,test]")
    session.run("pytest", "-n", "auto", "tests", *session.posargs)
