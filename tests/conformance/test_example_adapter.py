"""The whole conformance suite on the example third-party adapter in tests/example_adapter (CogVideoX).

It must be installed (``pip install -e tests/example_adapter``; the nox ``tests`` session does),
so that it registers through the entry point exactly as a third party's adapter would.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from ac_core import ENTRY_POINT_GROUP, get_adapter
from ac_core_conformance import AdapterConformance

ENTRY_POINTS = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
if "cogvideox" not in ENTRY_POINTS:
    raise ImportError(
        "the example adapter is not installed, so the 'cogvideox' entry point is missing: "
        "pip install --no-deps -e tests/example_adapter"
    )


class TestCogVideoXAdapter(AdapterConformance):
    """Named by its entry point, as ``pytest --ac-core-adapter cogvideox`` would."""

    adapter = "cogvideox"


def test_example_adapter_registers_through_its_entry_point():
    from ac_core_example_cogvideox import COGVIDEOX_ADAPTER

    assert ENTRY_POINTS["cogvideox"].value == "ac_core_example_cogvideox:COGVIDEOX_ADAPTER"
    assert get_adapter("cogvideox") is COGVIDEOX_ADAPTER
