"""Checkpointed blocks train under FSDP2 (2 CPU ranks, gloo) like a single plain process."""

from __future__ import annotations

import pytest
import torch

from ac_core import DEFAULT_RETAINED_OPS
from ac_core.testing import TOY_ADAPTER
from ac_core_conformance.distributed import fsdp_step, single_step

TOY = "ac_core.testing:TOY_ADAPTER"
TOY_CLS = TOY_ADAPTER.models[0].cls

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")


@pytest.fixture(scope="module")
def plain():
    return single_step(TOY, TOY_CLS)


@pytest.mark.parametrize("policy", ["full", "ops"])
def test_fsdp2_gradients_equal_single_process(plain, policy):
    result = fsdp_step(TOY, TOY_CLS, policy)
    torch.testing.assert_close(result.loss, plain.loss, rtol=0, atol=1e-6)
    assert result.grads.keys() == plain.grads.keys()
    for name, grad in plain.grads.items():
        torch.testing.assert_close(result.grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    if policy == "ops":
        assert result.retained_ops and result.retained_ops <= DEFAULT_RETAINED_OPS
    else:
        assert result.retained_ops == frozenset()
