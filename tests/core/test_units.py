"""``human_bytes``: the one byte formatting the planner's tables and ``ac-core report`` share."""

from __future__ import annotations

import pytest

from ac_core.units import human_bytes


@pytest.mark.parametrize(
    ("nbytes", "digits", "shown"),
    [
        (None, 1, "-"),
        (0, 1, "0 B"),
        (1023, 2, "1023 B"),
        (1024, 1, "1.0 KiB"),
        (16 * 1024, 2, "16.00 KiB"),
        (1536 * 2**20, 1, "1.5 GiB"),
        (2**20 - 1, 2, "1024.00 KiB"),  # rounds up in its unit rather than moving to the next
        (3 * 2**40, 2, "3072.00 GiB"),  # GiB is the largest unit
        (-2 * 2**20, 2, "-2.00 MiB"),
    ],
)
def test_human_bytes(nbytes, digits, shown):
    assert human_bytes(nbytes, digits=digits) == shown


def test_report_and_plan_defaults():
    # ``ac-core report`` passes no digits (one decimal); the plan table passes two.
    assert human_bytes(256 * 2**20) == "256.0 MiB"
    assert human_bytes(256 * 2**20, digits=2) == "256.00 MiB"
