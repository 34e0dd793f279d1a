from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Each test compiles from scratch: no graph cached by an earlier test's compile.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
