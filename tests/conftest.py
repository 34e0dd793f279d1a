from __future__ import annotations

import pytest

from ac_core import ops


@pytest.fixture(autouse=True)
def _fresh_once_per_process_warnings():
    # The "retained nothing" warning fires once per process; each test starts as a fresh process would.
    ops._reset_warnings()
    yield
    ops._reset_warnings()
