"""Attention calls per block and the backend claims, verified by counting kernels on the tiny models (CPU)."""

from __future__ import annotations

import logging

import pytest

from ac_core import DEFAULT_RETAINED_OPS, apply_activation_checkpointing
from ac_core.measure import OpCounter

from .cases import assert_same_training, blocks, loss_and_grads, per_call_ops, served

CPU_SDPA = "aten::_scaled_dot_product_flash_attention_for_cpu"


@pytest.mark.parametrize(("spec", "model_spec"), list(served()))
def test_declared_attention_calls_match_kernel_calls(spec, model_spec):
    case = model_spec.build_tiny()
    declared = {fqn: model_spec.attention_calls[type(block).__name__] for fqn, block in blocks(case, model_spec)}
    calls = per_call_ops(case, model_spec, [CPU_SDPA])
    for fqn, per_call in calls.items():
        assert per_call, f"{fqn} never ran"
        assert set(per_call) == {declared[fqn]}, f"{fqn}: kernel calls per forward {per_call}, declared {declared[fqn]}"


def _backend_params():
    params = []
    for param in served():
        spec, model_spec = param.values
        for backend in spec.backends:
            if backend.is_available("cpu"):
                name = f"{param.id}-{backend.name}"
                params.append(pytest.param(spec, model_spec, backend, id=name, marks=param.marks))
    return params


@pytest.mark.parametrize(("spec", "model_spec", "backend"), _backend_params())
def test_backend_claim_holds_on_cpu(spec, model_spec, backend, caplog):
    """A retainable backend runs its declared op once per attention call and 'ops' never reruns it in backward;
    a backend declared not retainable runs none of the adapter's retainable ops and still trains exactly."""
    case = model_spec.build_tiny()
    spec.set_backend(case.model, backend.name)
    every_retained = spec.retained_ops() | DEFAULT_RETAINED_OPS
    watched = backend.ops if backend.retainable else every_retained
    for fqn, per_call in per_call_ops(case, model_spec, watched).items():
        expected = model_spec.attention_calls[type(case.model.get_submodule(fqn)).__name__]
        assert set(per_call) == {expected if backend.retainable else 0}, f"{backend.name} in {fqn}: {per_call}"

    plain = model_spec.build_tiny()
    spec.set_backend(plain.model, backend.name)
    expected_training = loss_and_grads(plain)
    apply_activation_checkpointing(case.model, "ops")
    with caplog.at_level(logging.WARNING, logger="ac_core"), OpCounter() as counter:
        got = loss_and_grads(case)
    assert_same_training(got, expected_training)
    nothing_retained = [r for r in caplog.records if "retained nothing" in r.getMessage()]
    if backend.retainable:
        assert counter.count(backend.ops, "backward") == 0
        assert nothing_retained == []
    else:
        assert len(nothing_retained) == 1


def test_switching_one_diffusers_model_leaves_the_others_alone():
    dispatch = pytest.importorskip("diffusers.models.attention_dispatch")
    from ac_core_adapters import wan
    from ac_core_adapters.models.wan import tiny_wan

    registry = dispatch._AttentionBackendRegistry
    before = registry._active_backend
    switched, other = tiny_wan(), tiny_wan()
    wan.SPEC.set_backend(switched.model, "_native_math")
    assert registry._active_backend == before  # diffusers' own setter would have made math the global default
    counts = {}
    for name, case in (("switched", switched), ("other", other)):
        with OpCounter() as counter:
            case.run()
        counts[name] = counter.count([CPU_SDPA])
    assert counts == {"switched": 0, "other": 6}
    try:
        other.model.set_attention_backend("_native_math")
        assert registry._active_backend != before  # the upstream behaviour the wrapper undoes
    finally:
        registry._active_backend = before
