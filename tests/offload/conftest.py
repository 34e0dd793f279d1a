from __future__ import annotations

import pytest

from ac_core.offload import _transport


@pytest.fixture(autouse=True)
def _fresh_inactive_notice():
    # "Offload does nothing here" is said once per process; each test starts as a fresh process would.
    _transport._reset_inactive_notice()
    yield
    _transport._reset_inactive_notice()
