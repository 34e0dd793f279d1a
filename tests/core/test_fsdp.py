"""Checkpointed blocks train under FSDP2 (2 CPU ranks, gloo) like a single plain process: the toy adapter's model, and
a tiny transformers and diffusers model served by the library route (both policies in one set of ranks)."""

from __future__ import annotations

import functools

import pytest
import torch

from ac_core import DEFAULT_RETAINED_OPS
from ac_core.testing import TOY_ADAPTER
from ac_core_conformance.distributed import StepResult, fsdp_steps, load_adapter, single_step

TOY = "ac_core.testing:TOY_ADAPTER"
TOY_CLS = TOY_ADAPTER.models[0].cls
ROUTE_MODELS = "tests.integration.route_models"

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")

# (adapter ref, model class, its adapter's name, policies run in one set of ranks)
CASES = [
    pytest.param(TOY, TOY_CLS, "toy", ["full"], id="toy-full"),
    pytest.param(TOY, TOY_CLS, "toy", ["ops"], id="toy-ops"),
    pytest.param(f"{ROUTE_MODELS}:QWEN3_ROUTE", 0, "transformers-route", ["full", "ops"], id="qwen3-route"),
    pytest.param(f"{ROUTE_MODELS}:QWEN_IMAGE_ROUTE", 0, "diffusers-route", ["full", "ops"], id="qwen_image-route"),
]


@pytest.fixture(scope="module")
def plain():
    """The single-process step of (adapter ref, model class), once per module."""
    return functools.cache(single_step)


@pytest.mark.parametrize(("ref", "model_cls", "adapter", "policies"), CASES)
def test_fsdp2_gradients_equal_single_process(plain, ref, model_cls, adapter, policies):
    if ref.startswith(ROUTE_MODELS):
        pytest.importorskip("transformers" if adapter == "transformers-route" else "diffusers")
    assert load_adapter(ref).name == adapter
    expected: StepResult = plain(ref, model_cls)
    results = fsdp_steps(ref, model_cls, policies)
    for policy in policies:
        result = results[policy]
        torch.testing.assert_close(result.loss, expected.loss, rtol=0, atol=1e-6)
        assert result.grads.keys() == expected.grads.keys()
        for name, grad in expected.grads.items():
            torch.testing.assert_close(result.grads[name], grad, rtol=1e-5, atol=1e-6, msg=f"{policy}: {name}")
        if policy == "ops":
            assert result.retained_ops and result.retained_ops <= DEFAULT_RETAINED_OPS
        else:
            assert result.retained_ops == frozenset()
