"""The graph route on every registered adapter's tiny model (and the toy's), measured in its partitioned graphs.

Adapters are picked up from the registry at collection, so one installed later is tested without
a change here; one whose library is not installed is skipped.
"""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch

from ac_core import (
    DEFAULT_SAC_SAVE_OPS,
    AdapterSpec,
    ModelSpec,
    apply_activation_checkpointing,
    registered_adapters,
)
from ac_core.libraries.checkpointing import library_checkpointing
from ac_core.measure.compiled import compiled_activations, with_and_without_pass
from ac_core.testing import TOY_ADAPTER

from ..core.helpers import assert_same_training, loss_and_grads

# Switches for the model's own gradient checkpointing: diffusers', transformers' (and its deprecated alias).
_LIBRARY_SWITCHES = (
    "enable_gradient_checkpointing",
    "activation_checkpointing_enable",
    "gradient_checkpointing_enable",
)


def _params() -> list:
    params = []
    adapters = {**registered_adapters(), TOY_ADAPTER.name: TOY_ADAPTER}
    for name, spec in sorted(adapters.items()):
        for model_spec in spec.models:
            if model_spec.tiny is None:
                continue
            missing = spec.library is not None and importlib.util.find_spec(spec.library) is None
            marks = (
                [pytest.mark.skip(reason=f"{spec.library} is not installed: {spec.install_hint}")] if missing else []
            )
            if model_spec.compile_unsupported:
                # The conformance suite holds the adapter to this claim on the plain model.
                marks.append(pytest.mark.skip(reason=f"declared compile_unsupported: {model_spec.compile_unsupported}"))
            params.append(pytest.param(spec, model_spec, id=f"{name}-{spec.model_label(model_spec)}", marks=marks))
    return params


def _turn_on_library_checkpointing(model: torch.nn.Module) -> bool:
    for switch in _LIBRARY_SWITCHES:
        if callable(getattr(model, switch, None)):
            getattr(model, switch)()
            return bool(library_checkpointing(model))
    return False


# Eager 'ops' under torch.compile recomputes these models' blocks outside the compiled graphs, where
# compiled_activations does not count it: WanAnimate2's prepare hands each checkpointed block a Python wrapper of
# its reference cache (so a recompute does not store again), which breaks the graph inside the checkpoint.
_EAGER_RECOMPUTE_UNCOUNTED = frozenset({"WanAnimate2Transformer3DModel"})


@pytest.mark.parametrize(("spec", "model_spec"), _params())
def test_graph_route_on_tiny_model(spec: AdapterSpec, model_spec: ModelSpec, caplog):
    expected = loss_and_grads(model_spec.build_tiny())
    case = model_spec.build_tiny()
    had_library_checkpointing = _turn_on_library_checkpointing(case.model)
    with caplog.at_level(logging.INFO, logger="ac_core"):
        plain, ours = with_and_without_pass(case, adapter=spec)
    # The model's own checkpointing, where it has one, was taken off and said so at info level.
    assert library_checkpointing(case.model) == []
    if had_library_checkpointing:
        assert any("eager checkpointing was removed" in r.getMessage() for r in caplog.records)

    grads = {name: p.grad.detach().clone() for name, p in case.model.named_parameters() if p.grad is not None}
    assert_same_training((torch.tensor(ours.loss), grads), (expected[0].float(), expected[1]), atol=1e-5)

    attention = DEFAULT_SAC_SAVE_OPS | spec.retained_ops()
    assert ours.runs_forward(attention) >= 1, f"no attention op of {sorted(attention)} in the forward graph"
    assert ours.recomputes(attention) == 0
    assert ours.saved_tensors < plain.saved_tensors
    assert ours.saved_bytes < plain.saved_bytes

    # Never more recompute than eager 'ops', also where a graph break cuts the model's own forward
    # ahead of its blocks (HunyuanVideo 1.5, Framepack): that piece is outside the blocks and saved.
    if model_spec.class_name in _EAGER_RECOMPUTE_UNCOUNTED:
        return
    eager = model_spec.build_tiny()
    apply_activation_checkpointing(eager.model, "ops", adapter=spec)
    eager_ops = compiled_activations(eager)
    assert ours.recompute_count <= eager_ops.recompute_count
