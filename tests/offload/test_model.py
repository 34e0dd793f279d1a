"""Offload as an option of apply_activation_checkpointing and on its own: gating, round trips, errors, compile."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from ac_core import (
    AdapterError,
    CheckpointType,
    OffloadConfig,
    apply_activation_checkpointing,
    apply_activation_offload,
    checkpointed_blocks,
    last_offload_stats,
    offload_activations,
    remove_activation_checkpointing,
    remove_activation_offload,
    use_offload_transport,
)
from ac_core.offload.testing import RecordingTransport
from ac_core.testing import TOY_ADAPTER, toy_case

from ..core.helpers import assert_same_training, loss_and_grads, structure
from .helpers import EVERYTHING, assert_contract_kept, train_step

TOKENS, BATCH = 32, 2  # the toy adapter counts batch x sequence: 64 tokens


@pytest.mark.parametrize(("min_tokens", "offloads"), [(BATCH * TOKENS, True), (BATCH * TOKENS + 1, False)])
def test_the_adapter_counts_tokens_and_only_forwards_that_reach_min_tokens_offload(min_tokens, offloads):
    case = toy_case(tokens=TOKENS, batch=BATCH, depth=2)
    config = dataclasses.replace(EVERYTHING, min_tokens=min_tokens)
    apply_activation_checkpointing(case.model, "full", adapter=TOY_ADAPTER, offload=config)
    _, transport = train_step(case)
    assert bool(transport.offloaded) is offloads
    assert (last_offload_stats(case.model) is not None) is offloads


def test_no_grad_forward_does_not_offload():
    case = toy_case(depth=2)
    apply_activation_checkpointing(case.model, "full", adapter=TOY_ADAPTER, offload=EVERYTHING)
    with use_offload_transport(RecordingTransport()) as transport, torch.no_grad():
        case.model(**case.inputs)
    assert transport.offloaded == [] and last_offload_stats(case.model) is None


def test_positional_and_keyword_inputs_bind_to_the_same_names():
    seen: list[tuple[str, ...]] = []

    def count(model, inputs):
        seen.append(tuple(inputs))
        return inputs["x"].shape[0] * inputs["x"].shape[1]

    case = toy_case(depth=1)
    apply_activation_offload(case.model, dataclasses.replace(EVERYTHING, token_count=count))
    with use_offload_transport(RecordingTransport()):
        case.model(case.inputs["x"]).sum().backward()
        case.model(x=case.inputs["x"]).sum().backward()
    assert seen == [("x",), ("x",)]


def test_apply_and_remove_round_trip_names_and_forwards():
    case = toy_case(depth=3)
    before = structure(case.model)
    state_keys = list(case.model.state_dict())
    config = dataclasses.replace(EVERYTHING, keep_on_device=("head",))
    apply_activation_checkpointing(case.model, "ops", adapter=TOY_ADAPTER, offload=config)
    assert [n for n, _ in case.model.named_parameters()] == before[1]
    assert list(case.model.state_dict()) == state_keys
    assert remove_activation_checkpointing(case.model) is case.model
    assert structure(case.model) == before
    _, transport = train_step(case)
    assert transport.offloaded == []


def test_offload_alone_then_removed_leaves_checkpointing_in_place():
    case = toy_case(depth=3)
    apply_activation_checkpointing(case.model, "full", blocks=["layers"])
    checkpointed = checkpointed_blocks(case.model)
    with_checkpoint = structure(case.model)
    assert apply_activation_offload(case.model, EVERYTHING, adapter=TOY_ADAPTER) is case.model
    assert checkpointed_blocks(case.model) == checkpointed
    _, transport = train_step(case)
    assert len(transport.offloaded) == 4
    assert remove_activation_offload(case.model) is case.model
    assert structure(case.model) == with_checkpoint
    assert checkpointed_blocks(case.model) == {f"layers.{i}": CheckpointType.FULL for i in range(3)}


def test_reapplying_without_offload_removes_it_and_with_another_config_replaces_it():
    case = toy_case(depth=2)
    apply_activation_checkpointing(case.model, "full", adapter=TOY_ADAPTER, offload=EVERYTHING)
    apply_activation_checkpointing(case.model, "full", adapter=TOY_ADAPTER)
    assert train_step(case)[1].offloaded == []
    apply_activation_checkpointing(case.model, "full", adapter=TOY_ADAPTER, offload=EVERYTHING)
    apply_activation_checkpointing(
        case.model, "ops", adapter=TOY_ADAPTER, offload=dataclasses.replace(EVERYTHING, checkpoint_inputs=False)
    )
    assert [r.shape for r in train_step(case)[1].offloaded] == [(64, 64)]  # only the head's input
    apply_activation_checkpointing(case.model, "ops", adapter=TOY_ADAPTER, offload=OffloadConfig(min_tokens=0))
    assert train_step(case)[1].offloaded == []
    assert "forward" not in case.model.__dict__


def test_deepcopy_keeps_offload_bound_to_the_copy():
    case = toy_case(depth=2)
    apply_activation_checkpointing(case.model, "full", adapter=TOY_ADAPTER, offload=EVERYTHING)
    clone = copy.deepcopy(case.model)
    assert clone.forward.__self__ is clone
    with use_offload_transport(RecordingTransport()):
        clone(**case.inputs).sum().backward()
    assert last_offload_stats(clone).offloaded == 3 and last_offload_stats(case.model) is None


def _unchanged_after(call, case) -> None:
    before = structure(case.model)
    call()
    assert structure(case.model) == before and checkpointed_blocks(case.model) == {}


def test_blocks_without_adapter_need_a_token_count_and_leave_the_model_unchanged():
    case = toy_case(depth=2)
    with pytest.raises(AdapterError, match=r"token_count=lambda model, inputs"):
        _unchanged_after(
            lambda: apply_activation_checkpointing(case.model, "full", blocks=["layers"], offload=EVERYTHING), case
        )
    assert structure(case.model) == structure(toy_case(depth=2).model)
    config = dataclasses.replace(EVERYTHING, token_count=lambda model, inputs: inputs["x"].shape[1])
    apply_activation_checkpointing(case.model, "full", blocks=["layers"], offload=config)
    assert len(train_step(case)[1].offloaded) == 3


def test_disabled_offload_needs_no_token_count():
    case = toy_case(depth=2)
    apply_activation_checkpointing(case.model, "full", blocks=["layers"], offload=OffloadConfig())
    assert len(checkpointed_blocks(case.model)) == 2


def test_keep_on_device_path_missing_is_an_error_naming_it():
    case = toy_case(depth=2)
    config = dataclasses.replace(EVERYTHING, keep_on_device=("lm_head",))
    with pytest.raises(AdapterError, match=r"'lm_head'.*\['embed', 'layers', 'head'\]"):
        apply_activation_checkpointing(case.model, "full", adapter=TOY_ADAPTER, offload=config)
    assert checkpointed_blocks(case.model) == {}
    with pytest.raises(AdapterError, match="lm_head"):
        apply_activation_offload(case.model, config, adapter=TOY_ADAPTER)
    assert "forward" not in case.model.__dict__


def test_offload_must_be_a_config():
    case = toy_case(depth=2)
    with pytest.raises(TypeError, match="OffloadConfig"):
        apply_activation_checkpointing(case.model, "full", adapter=TOY_ADAPTER, offload=32768)
    with pytest.raises(TypeError, match="OffloadConfig"):
        apply_activation_offload(case.model, 32768)


def test_adapter_without_token_count_or_model_no_adapter_serves():
    case = toy_case(depth=2)
    counting_nothing = dataclasses.replace(TOY_ADAPTER, name="toy-uncounted", token_count=None)
    with pytest.raises(AdapterError, match="declares no token_count"):
        apply_activation_checkpointing(case.model, "full", adapter=counting_nothing, offload=EVERYTHING)
    with pytest.raises(AdapterError, match="no registered adapter serves"):
        apply_activation_offload(case.model, EVERYTHING)
    assert "forward" not in case.model.__dict__


def test_a_token_count_that_fails_names_its_source():
    case = toy_case(depth=1)
    apply_activation_offload(case.model, dataclasses.replace(EVERYTHING, token_count=lambda m, i: i["latents"]))
    failing = pytest.raises(ValueError, match=r"OffloadConfig.token_count.*\['x'\]")
    with use_offload_transport(RecordingTransport()), failing:
        case.run()


def test_compiled_model_trains_with_offload_configured_and_offloads_from_outside():
    torch._dynamo.reset()
    expected = loss_and_grads(toy_case(depth=2))
    case = toy_case(depth=2)
    apply_activation_checkpointing(case.model, "full", adapter=TOY_ADAPTER, offload=EVERYTHING)
    model = case.model
    case.model = torch.compile(model, backend="aot_eager")
    with use_offload_transport(RecordingTransport()) as transport:
        got = loss_and_grads(case)
    # Traced code runs no saved-tensor hooks of its own: the model-level offload stands aside...
    assert transport.offloaded == [] and last_offload_stats(model) is None
    assert_same_training(got, expected)
    # ...and a session around the compiled call offloads the compiled graph's saved tensors.
    for p in model.parameters():
        p.grad = None
    with use_offload_transport(RecordingTransport()) as transport:
        with offload_activations(EVERYTHING, model=model, inputs=case.inputs.values()) as session:
            loss = case.run()
        loss.backward()
    assert session.stats.offloaded > 0
    assert_contract_kept(transport)
    assert_same_training((loss.detach(), {n: p.grad for n, p in model.named_parameters()}), expected)
    torch._dynamo.reset()
