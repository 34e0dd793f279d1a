"""Sessions: `nox` with no arguments runs exactly what CI runs."""

from __future__ import annotations

import nox

# The CPU wheel of this torch lies on the CI machines' disk; an unpinned torch pulls a multi-GB CUDA build.
TORCH = "torch==2.13.0"

# One conformance session per adapter we ship; each adapter is installed by the extra of the same name.
FAMILIES = ("wan", "hunyuan", "flux", "llama")

# One sweep session per library: every class it declares, built tiny and proven (docs/coverage.md).
SWEPT = ("diffusers", "transformers")

nox.options.sessions = [
    "lint",
    "tests",
    *(f"conformance-{family}" for family in FAMILIES),
    *(f"sweep-{library}" for library in SWEPT),
]
nox.options.reuse_existing_virtualenvs = False


@nox.session
def lint(session: nox.Session) -> None:
    # The type checker resolves imports, so the package and its libraries are installed too; the nodejs
    # extra brings pyright's runtime as a wheel instead of downloading it.
    session.install("ruff>=0.6", "pyright[nodejs]==1.1.414", TORCH, "-e", ".[all,test]")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("pyright")


@nox.session
def tests(session: nox.Session) -> None:
    # The example third-party adapter registers through its entry point, so it is installed, not imported.
    session.install(TORCH, "-e", ".[all,test]", "-e", "tests/example_adapter")
    session.run("pytest", "-n", "auto", "tests", *session.posargs)


def _conformance(family: str) -> None:
    @nox.session(name=f"conformance-{family}")
    def conformance(session: nox.Session) -> None:
        # Only this family's extra: proves it is enough for the adapter to load and pass.
        session.install(TORCH, "-e", f".[{family},test]")
        session.run(
            "pytest",
            "-n",
            "auto",
            "--pyargs",
            "ac_core_conformance",
            "--ac-core-adapter",
            family,
            *session.posargs,
        )

    conformance.__doc__ = f"The conformance suite on the {family!r} adapter (pass pytest options after --)."


for _family in FAMILIES:
    _conformance(_family)


def _sweep(library: str) -> None:
    @nox.session(name=f"sweep-{library}")
    def sweep(session: nox.Session) -> None:
        # The committed record is the baseline: a class proven there and not now fails the session.
        record = f"docs/coverage/{library}.json"
        session.install(TORCH, "-e", ".[all,test]")
        session.run(
            "ac-core",
            "sweep",
            library,
            "--json",
            record,
            "--table",
            "docs/coverage.md",
            "--baseline",
            record,
            *session.posargs,
        )

    sweep.__doc__ = f"Sweep every {library} model class: regenerate docs/coverage.md, fail on a regression."


for _library in SWEPT:
    _sweep(_library)
