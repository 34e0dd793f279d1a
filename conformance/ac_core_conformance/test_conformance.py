"""The suite for the adapters named on the command line: ``pytest --pyargs ac_core_conformance --ac-core-adapter X``.

Without ``--ac-core-adapter`` every test here is skipped, saying so.
"""

from __future__ import annotations

from ac_core_conformance.suite import AdapterConformance


class TestConformance(AdapterConformance):
    """The whole suite; its adapters come from ``--ac-core-adapter``."""
