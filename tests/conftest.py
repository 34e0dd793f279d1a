from __future__ import annotations

import os
import tempfile

import pytest
import torch

import ac_core

# pytest-xdist runs one worker per core, and torch's default of one intra-op thread per core then puts
# workers x cores spinning threads on the cores. Measured on 2 busy cores, tests/adapters with -n 2:
# 285 s with torch's default, 79 s with one thread per worker.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# Tests plan as on a machine never calibrated: `ac-core calibrate` run here writes the user's cache, which would
# cost every CPU plan in time. Tests of calibration point AC_CORE_CALIBRATION at their own files.
os.environ.pop("AC_CORE_CALIBRATION", None)
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="ac-core-tests-cache-")


@pytest.fixture(autouse=True)
def _fresh_once_per_process_warnings():
    # The "retained nothing" warning fires once per process; each test starts as a fresh process would.
    ac_core.reset_warnings()
    yield
    ac_core.reset_warnings()
