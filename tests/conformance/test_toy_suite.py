"""The whole conformance suite on the pure-torch toy adapter, given as an object registered nowhere."""

from __future__ import annotations

from ac_core.testing import TOY_ADAPTER
from ac_core_conformance import AdapterConformance


class TestToyAdapter(AdapterConformance):
    adapter = TOY_ADAPTER
