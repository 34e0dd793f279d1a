"""The seed-compatible context, grad-mode and threshold semantics, and the CPU no-op."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys

import pytest
import torch

from ac_core import (
    OffloadConfig,
    OffloadSession,
    activation_offload_context,
    last_offload_stats,
    offload_activations,
    use_offload_transport,
)
from ac_core.offload.testing import RecordingTransport

from ..core.helpers import assert_same_training, loss_and_grads
from .helpers import EVERYTHING, toy


@pytest.mark.parametrize(
    ("token_count", "min_tokens", "grad", "active"),
    [
        (100, 0, True, False),  # 0 turns offload off
        (100, 100, True, True),  # reaching the threshold is enough
        (99, 100, True, False),
        (10**6, 1, True, True),
        (100, 50, False, False),  # no grad: nothing is saved for backward
    ],
)
def test_seed_semantics(token_count, min_tokens, grad, active):
    with use_offload_transport(RecordingTransport()), torch.set_grad_enabled(grad):
        context = activation_offload_context(token_count, min_tokens)
    assert isinstance(context, OffloadSession) is active
    if not active:
        assert isinstance(context, contextlib.nullcontext)


def test_inference_mode_is_a_null_context():
    with use_offload_transport(RecordingTransport()), torch.inference_mode():
        assert isinstance(activation_offload_context(100, 1), contextlib.nullcontext)


@pytest.mark.parametrize("min_tokens", [-1, -100])
def test_negative_threshold_raises(min_tokens):
    with pytest.raises(ValueError, match="min_tokens"):
        activation_offload_context(10, min_tokens)


def test_active_context_offloads_what_is_saved_inside_it():
    case = toy("full", offload=None)
    with use_offload_transport(RecordingTransport()) as transport:
        with activation_offload_context(64, 64) as session:
            loss = case.run()
        loss.backward()
    # Default threshold (1 MiB): the toy's activations are all smaller, so nothing moves; all of them were seen.
    assert session.stats.offloaded == 0 and sum(session.stats.kept.values()) > 0
    with use_offload_transport(transport), offload_activations(EVERYTHING, 64) as session:
        loss = toy("full", offload=None, depth=4).run()
    loss.backward()
    # The 4 blocks' inputs, the head's input and, since this context knows no model, the batch (saved by
    # the embedding) and the head's output (saved by the loss, computed inside the context here).
    assert (session.stats.offloaded, session.stats.checkpoint_inputs) == (7, 4)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("min_tokens", -1),
        ("min_tokens", 1.5),
        ("min_tokens", True),
        ("min_bytes", -1),
        ("max_inflight_bytes", -1),
        ("prefetch_bytes", "1GB"),
        ("checkpoint_inputs", 1),
        ("max_host_fraction", 0),
        ("max_host_fraction", 1.5),
        ("max_host_fraction", True),
        ("keep_on_device", "lm_head"),
        ("keep_on_device", ("",)),
        ("token_count", 3),
    ],
)
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"OffloadConfig.{field}"):
        OffloadConfig(**{field: value})


def test_config_defaults_and_helpers():
    config = OffloadConfig(min_tokens=32768)
    assert config.min_bytes == 1 << 20 and config.checkpoint_inputs and config.max_host_fraction == 0.5
    assert config.applies_to(32768) and not config.applies_to(32767)
    assert not OffloadConfig().enabled and not OffloadConfig().applies_to(10**9)
    assert OffloadConfig(keep_on_device=["lm_head"]).keep_on_device == ("lm_head",)


def test_without_an_accelerator_offload_does_nothing_and_says_so_once(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    case = toy("full", EVERYTHING)
    with caplog.at_level(logging.DEBUG, logger="ac_core"):
        first = loss_and_grads(case)
        loss_and_grads(case)
        assert isinstance(activation_offload_context(10, 1), contextlib.nullcontext)
    notices = [r for r in caplog.records if "does nothing on this machine" in r.getMessage()]
    assert len(notices) == 1 and notices[0].levelno == logging.DEBUG
    assert last_offload_stats(case.model) is None
    assert_same_training(first, loss_and_grads(toy("full", offload=None)))


def test_without_an_accelerator_no_pinned_memory_path_is_even_loaded():
    code = (
        "import sys, torch, ac_core\n"
        "from ac_core.testing import toy_case, TOY_ADAPTER\n"
        "case = toy_case()\n"
        "config = ac_core.OffloadConfig(min_tokens=1, min_bytes=1)\n"
        "ac_core.apply_activation_checkpointing(case.model, 'full', adapter=TOY_ADAPTER, offload=config)\n"
        "case.run().backward()\n"
        "with ac_core.activation_offload_context(10, 1):\n"
        "    case.run().backward()\n"
        "print('ac_core.offload._cuda' in sys.modules, torch.cuda.is_initialized())\n"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.split() == ["False", "False"]
