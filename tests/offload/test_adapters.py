"""Every registered adapter's tiny model trains the same with offload, under every policy.

Parametrized from the registry at collection time, so adapters registered through the
``ac_core.adapters`` entry points are picked up as they land; a library that is not installed
skips its adapter. The toy adapter (not registered by default) always runs.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from ac_core import AdapterSpec, ModelCase, ModelSpec, last_offload_stats, registered_adapters
from ac_core.testing import TOY_ADAPTER

from ..core.helpers import assert_same_training
from .helpers import EVERYTHING, POLICIES, assert_contract_kept, loss_and_grads, parameter_storages, prepare, train_step


def _tiny_models() -> list:
    adapters = {TOY_ADAPTER.name: TOY_ADAPTER, **registered_adapters()}
    return [
        pytest.param(spec, model, id=f"{name}-{model.class_name}")
        for name, spec in sorted(adapters.items())
        for model in spec.models
        if model.tiny is not None
    ]


def _build(spec: AdapterSpec, model: ModelSpec) -> ModelCase:
    if spec.library and importlib.util.find_spec(spec.library) is None:
        pytest.skip(f"{spec.library} is not installed ({spec.install_hint})")
    try:
        return model.build_tiny()
    except ImportError as exc:
        pytest.skip(f"adapter {spec.name!r}: {exc}")


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(("spec", "model"), _tiny_models())
def test_offload_keeps_loss_and_gradients(spec, model, policy):
    built = _build(spec, model)
    reference = prepare(copy.deepcopy(built), policy, None, spec)
    torch.manual_seed(0)
    expected = loss_and_grads(reference)

    case = prepare(built, policy, EVERYTHING, spec)
    torch.manual_seed(0)
    got, transport = train_step(case, lag=2)  # copies finish two copies late: the still-on-device path runs too
    # A saved view with gaps (a slice of a fused projection) comes back contiguous, which can change a
    # backward kernel's summation order: equal up to float rounding, not bit for bit.
    assert_same_training(got, expected, atol=1e-6)
    assert_contract_kept(transport)
    stats = last_offload_stats(case.model)
    assert stats is not None and stats.offloaded > 0
    assert not {r.storage for r in transport.offloaded} & parameter_storages(case.model)
    if policy != "none":
        assert stats.checkpoint_inputs > 0


@pytest.mark.parametrize(("spec", "model"), _tiny_models())
def test_adapter_counts_the_tokens_of_its_tiny_inputs(spec, model):
    built = _build(spec, model)
    assert spec.token_count is not None, f"adapter {spec.name!r} declares no token_count: offload cannot gate on it"
    tokens = spec.token_count(built.model, built.inputs)
    assert isinstance(tokens, int) and tokens > 0
