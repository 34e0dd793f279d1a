from __future__ import annotations

import pytest

from ac_core import register_adapter, registered_adapters
from ac_core.registry import unregister_adapter
from ac_core.testing import TOY_ADAPTER


@pytest.fixture
def toy_registered():
    """The toy adapter registered by name for the test, as an entry point would register it."""
    added = "toy" not in registered_adapters()
    if added:
        register_adapter(TOY_ADAPTER)
    yield TOY_ADAPTER
    if added:
        unregister_adapter("toy")
