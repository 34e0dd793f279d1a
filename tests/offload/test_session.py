"""The session's ordering: the in-flight bound, the still-on-device fast path, prefetch, and safe release."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from ac_core import OffloadConfig, last_offload_stats, offload_activations, use_offload_transport
from ac_core.offload.testing import RecordingTransport
from ac_core.testing import toy_case

from ..core.helpers import assert_same_training, loss_and_grads
from .helpers import EVERYTHING, assert_contract_kept, toy, train_step

DEPTH = 3
ACT = 2 * 32 * 64 * 4  # the toy's residual-stream activation; full offloads DEPTH + 1 of them


def test_copies_that_never_finish_are_bounded_by_max_inflight_bytes():
    config = dataclasses.replace(EVERYTHING, max_inflight_bytes=ACT)
    case = toy("full", config, depth=DEPTH)
    got, transport = train_step(case, lag=1000)  # the double's copy engine lags far behind compute
    stats = last_offload_stats(case.model)
    # Holding one activation is allowed: each further one makes compute wait for the oldest copy.
    assert stats.throttled == transport.throttled == DEPTH
    # The last one was still on the device when backward came: used as it is, no copy back.
    assert stats.reused == 1 and transport.reloads == DEPTH
    assert_contract_kept(transport)
    assert_same_training(got, loss_and_grads(toy("full", None, depth=DEPTH)))


def test_finished_copies_let_go_without_waiting():
    case = toy("full", depth=DEPTH)
    _, transport = train_step(case, lag=0)
    stats = last_offload_stats(case.model)
    assert stats.throttled == transport.fenced == 0 and stats.reused == 0


@pytest.mark.parametrize(("prefetch_bytes", "prefetched", "on_demand"), [(1 << 30, DEPTH, 1), (0, 0, DEPTH + 1)])
def test_backward_prefetches_ahead_of_use(prefetch_bytes, prefetched, on_demand):
    case = toy("full", dataclasses.replace(EVERYTHING, prefetch_bytes=prefetch_bytes), depth=DEPTH)
    _, transport = train_step(case)
    stats = last_offload_stats(case.model)
    # Only the first tensor backward needs is fetched when asked for; the rest were already coming back.
    assert (stats.prefetched, stats.on_demand) == (prefetched, on_demand)
    assert_contract_kept(transport)


def test_prefetch_budget_below_one_tensor_still_prefetches_one_at_a_time():
    case = toy("full", dataclasses.replace(EVERYTHING, prefetch_bytes=1), depth=DEPTH)
    _, transport = train_step(case)
    stats = last_offload_stats(case.model)
    assert (stats.prefetched, stats.on_demand) == (DEPTH, 1)
    assert_contract_kept(transport)


def test_dropping_the_graph_without_backward_releases_everything_safely():
    case = toy("none", depth=DEPTH)
    with use_offload_transport(RecordingTransport(lag=1000)) as transport:
        loss = case.run()
        pending = len(transport.offloaded)
        del loss
        gc.collect()
    # Every copy still running was fenced before its source could go, and all host memory came back.
    assert transport.fenced > 0 and transport.fenced <= pending
    assert_contract_kept(transport)


def test_backward_twice_with_retain_graph():
    plain = toy_case(depth=DEPTH)
    loss = plain.run()
    loss.backward(retain_graph=True)
    loss.backward()
    expected = {n: p.grad.clone() for n, p in plain.model.named_parameters()}

    case = toy("none", depth=DEPTH)
    with use_offload_transport(RecordingTransport()) as transport:
        loss = case.run()
        loss.backward(retain_graph=True)
        loss.backward()
        del loss
        gc.collect()
    for name, p in case.model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=0, atol=0, msg=name)
    assert_contract_kept(transport)


@pytest.mark.parametrize("min_bytes", [1, 1 << 30], ids=["offloaded", "kept"])
def test_in_place_change_of_a_saved_tensor_raises_as_autograd_does(min_bytes):
    x = torch.randn(256, requires_grad=True)
    config = OffloadConfig(min_tokens=1, min_bytes=min_bytes)
    with use_offload_transport(RecordingTransport(lag=10)), offload_activations(config):
        a = x * 2
        b = a.sin()  # saves a
    a.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        b.sum().backward()
    # The same program without offload: autograd raises too.
    a = x * 2
    b = a.sin()
    a.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        b.sum().backward()


def test_a_forward_whose_copies_are_still_running_when_backward_starts():
    plain = loss_and_grads(toy_case(depth=DEPTH))
    for lag in (1, 3, 50):
        got, transport = train_step(toy("none", depth=DEPTH), lag=lag)
        assert_same_training(got, plain)
        assert_contract_kept(transport)
