"""Which saved tensors offload would move, per policy, counted through the recording double.

Inside a checkpointed block torch's checkpoint takes every save itself; under ``ops`` its
selective-checkpoint caching mode keeps the retained attention outputs in its own storage, never
through saved-tensor hooks. So ``full`` and ``ops`` hand offload the same tensors (the blocks'
inputs and what lies outside the blocks), and the attention outputs stay on the device.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from ac_core import (
    Kept,
    OffloadConfig,
    apply_activation_checkpointing,
    apply_activation_offload,
    last_offload_stats,
    no_offload,
    offload_activations,
    use_offload_transport,
)
from ac_core.measure import held_for_backward
from ac_core.offload.testing import RecordingTransport
from ac_core.testing import toy_case

from ..core.helpers import assert_same_training, loss_and_grads
from .helpers import EVERYTHING, assert_contract_kept, parameter_storages, toy, train_step

BATCH, TOKENS, DIM, HEADS, DEPTH = 2, 32, 64, 4, 3
ACT = BATCH * TOKENS * DIM * 4  # one fp32 activation of the residual stream
BLOCK_INPUT, HEAD_INPUT = (BATCH, TOKENS, DIM), (BATCH * TOKENS, DIM)  # the head's Linear flattens its input
QKV_OR_ATTENTION, LOGSUMEXP = (BATCH, HEADS, TOKENS, DIM // HEADS), (BATCH, HEADS, TOKENS)


def _step(policy: str, config: OffloadConfig = EVERYTHING, lag: int = 0):
    case = toy(policy, config, dim=DIM, heads=HEADS, depth=DEPTH, tokens=TOKENS, batch=BATCH)
    _, transport = train_step(case, lag)
    assert_contract_kept(transport)
    return case, transport, last_offload_stats(case.model)


@pytest.mark.parametrize("policy", ["full", "ops"])
def test_checkpointed_policies_offload_the_block_inputs_and_what_lies_outside_the_blocks(policy):
    _, transport, stats = _step(policy)
    assert [r.shape for r in transport.offloaded] == [BLOCK_INPUT] * DEPTH + [HEAD_INPUT]
    assert (stats.checkpoint_inputs, stats.checkpoint_input_bytes) == (DEPTH, DEPTH * ACT)
    assert stats.offloaded_bytes == (DEPTH + 1) * ACT
    # The batch (saved by the embedding) and the head's weight stay: they are alive anyway.
    assert stats.kept == {Kept.MODEL_INPUT: 1, Kept.PARAMETER: 1}


def test_without_checkpointing_every_activation_moves_and_no_parameter_does():
    case, transport, stats = _step("none")
    shapes = [r.shape for r in transport.offloaded]
    # Per block: q, k, v and the attention output, and the kernel's logsumexp; nothing retains them here.
    assert shapes.count(QKV_OR_ATTENTION) == 4 * DEPTH
    assert shapes.count(LOGSUMEXP) == DEPTH
    assert stats.checkpoint_inputs == 0
    assert not {r.storage for r in transport.offloaded} & parameter_storages(case.model)
    # Two LayerNorms (weight, bias) and four Linear weights per block, and the head's weight.
    assert stats.kept == {Kept.PARAMETER: 8 * DEPTH + 1, Kept.MODEL_INPUT: 1}
    assert stats.offloaded == len(transport.offloaded)


def test_block_skip_offloads_checkpointed_inputs_and_the_unchecked_blocks_activations():
    _, transport, stats = _step("block_skip")  # n_layer=2: blocks 0 and 2 checkpointed, block 1 not
    shapes = [r.shape for r in transport.offloaded]
    assert stats.checkpoint_inputs == 2
    assert shapes.count(QKV_OR_ATTENTION) == 4 and shapes.count(LOGSUMEXP) == 1  # block 1's attention only


def test_ops_keeps_exactly_the_retained_attention_outputs_on_the_device():
    batch, tokens, depth = 2, 128, 4
    act, lse = batch * tokens * DIM * 4, batch * HEADS * tokens * 4

    def held(policy: str, config: OffloadConfig | None) -> int:
        case = toy(policy, config, dim=DIM, heads=HEADS, depth=depth, tokens=tokens, batch=batch)
        with use_offload_transport(RecordingTransport()):
            return held_for_backward(case.run)[1]

    assert held("full", None) == (depth + 2) * act
    # What stays is the head's output, which the loss saves outside the model's forward.
    assert held("full", EVERYTHING) == act
    assert held("none", EVERYTHING) == act
    assert held("ops", None) == (depth + 2) * act + depth * (act + lse)
    assert held("ops", EVERYTHING) == act + depth * (act + lse)


def test_tensors_below_min_bytes_stay():
    _, transport, stats = _step("none", dataclasses.replace(EVERYTHING, min_bytes=ACT + 1))
    # Only the MLP's 4x-wide hidden activation (saved by GELU and by the second Linear) is above it.
    assert [r.nbytes for r in transport.offloaded] == [4 * ACT] * (2 * DEPTH)
    assert stats.kept[Kept.SMALL] > 0
    _, transport, stats = _step("none", OffloadConfig(min_tokens=1))  # default: 1 MiB
    assert transport.offloaded == [] and stats.kept[Kept.SMALL] > 0


def test_checkpoint_inputs_off_keeps_the_block_inputs():
    _, transport, stats = _step("full", dataclasses.replace(EVERYTHING, checkpoint_inputs=False))
    assert [r.shape for r in transport.offloaded] == [HEAD_INPUT]
    assert stats.kept[Kept.CHECKPOINT_INPUT] == DEPTH and stats.checkpoint_inputs == 0


def test_keep_on_device_module_stays():
    _, transport, stats = _step("full", dataclasses.replace(EVERYTHING, keep_on_device=("head",)))
    assert [r.shape for r in transport.offloaded] == [BLOCK_INPUT] * DEPTH
    assert stats.kept[Kept.NO_OFFLOAD] == 2  # the head's input and weight


def test_no_offload_region_stays_and_gradients_hold():
    def run(offload: bool):
        torch.manual_seed(0)
        x = torch.randn(64, 64, requires_grad=True)
        # A multi-item with enters left to right: the session is made once the double is in place.
        with (
            use_offload_transport(RecordingTransport()) as transport,
            offload_activations(EVERYTHING) if offload else torch.enable_grad() as session,
        ):
            a = (x * 2).sin()  # sin saves x * 2: moves
            with no_offload(), no_offload():
                b = a.cos()  # cos saves a: stays
            c = b.exp()  # exp saves its output: moves again after the region
        c.sum().backward()
        return x.grad, transport, session

    grad, transport, session = run(True)
    assert session.stats.offloaded == 2 and session.stats.kept == {Kept.NO_OFFLOAD: 1}
    assert len(transport.offloaded) == 2
    torch.testing.assert_close(grad, run(False)[0], rtol=0, atol=0)


def test_no_offload_traces_without_a_graph_break():
    def f(x):
        with no_offload():
            y = x.sin()
        return y.cos().sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="eager", fullgraph=True)
    x = torch.randn(8)
    torch.testing.assert_close(compiled(x), f(x))
    torch._dynamo.reset()


class _SharedConditioning(nn.Module):
    """Blocks take the stream by position and a conditioning tensor, shared by all, by keyword (as Flux's do)."""

    def __init__(self, dim: int = DIM, depth: int = DEPTH) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.layers = nn.ModuleList(_CondBlock(dim) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        cond = torch.tanh(h.mean(dim=1, keepdim=True)).expand_as(h).contiguous()
        for layer in self.layers:
            h = layer(h, cond=cond)
        return h


class _CondBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        return h + self.lin(h * cond)


def test_keyword_inputs_of_blocks_are_offloaded_once_and_shared():
    def case(offload: OffloadConfig | None):
        torch.manual_seed(0)
        model = _SharedConditioning()
        x = torch.randn(BATCH, TOKENS, DIM)
        config = None if offload is None else dataclasses.replace(offload, token_count=lambda m, i: i["x"].shape[1])
        apply_activation_checkpointing(model, "full", blocks=["layers"], offload=config)
        return model, x

    model, x = case(EVERYTHING)
    with use_offload_transport(RecordingTransport()) as transport:
        loss = model(x).pow(2).mean()
        loss.backward()
    stats = last_offload_stats(model)
    # Each block's stream input, and the conditioning once: later blocks share its host copy.
    assert [r.shape for r in transport.offloaded].count(BLOCK_INPUT) == DEPTH + 1
    assert stats.checkpoint_inputs == DEPTH + 1 and stats.shared == DEPTH - 1
    assert_contract_kept(transport)
    plain, x = case(None)
    plain(x).pow(2).mean().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_model_inputs_and_buffers_stay():
    class WithBuffer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("scale", torch.randn(TOKENS, DIM))
            self.lin = nn.Linear(DIM, DIM)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (self.lin(x) * self.scale).sin()

    model = WithBuffer()
    apply_activation_offload(model, dataclasses.replace(EVERYTHING, token_count=lambda m, i: i["x"].shape[1]))
    with use_offload_transport(RecordingTransport()) as transport:
        model(torch.randn(BATCH, TOKENS, DIM)).sum().backward()
    stats = last_offload_stats(model)
    # Linear saves x (the batch) for its weight's gradient, mul saves the buffer, sin its input (which moves).
    assert stats.kept == {Kept.MODEL_INPUT: 1, Kept.PARAMETER: 1}
    assert stats.offloaded == 1
    assert_contract_kept(transport)


def test_gradients_hold_through_the_double_with_lagging_copies():
    plain = loss_and_grads(toy_case(depth=DEPTH))
    got, transport = train_step(toy("none", depth=DEPTH), lag=5)
    assert_same_training(got, plain)
    assert_contract_kept(transport)
