from __future__ import annotations

import os

import pytest
import torch

import ac_core

# pytest-xdist runs one worker per core, and torch's default of one intra-op thread per core then puts
# workers x cores spinning threads on the cores. Measured on 2 busy cores, tests/adapters with -n 2:
# 285 s with torch's default, 79 s with one thread per worker.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fresh_once_per_process_warnings():
    # The "retained nothing" warning fires once per process; each test starts as a fresh process would.
    ac_core.reset_warnings()
    yield
    ac_core.reset_warnings()
