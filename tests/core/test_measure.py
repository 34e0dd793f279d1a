"""The measurement helpers count what they claim to."""

from __future__ import annotations

from ac_core import apply_activation_checkpointing
from ac_core.measure import OpCounter, held_for_backward, op_matches
from ac_core.testing import toy_case

BATCH, TOKENS, DIM, HEADS, DEPTH = 2, 128, 64, 4, 4
ACT = BATCH * TOKENS * DIM * 4  # one fp32 activation of the residual stream
LSE = BATCH * HEADS * TOKENS * 4  # the attention kernel's logsumexp, kept with its output


def _held(kind: str | None) -> int:
    case = toy_case(dim=DIM, heads=HEADS, depth=DEPTH, tokens=TOKENS, batch=BATCH)
    if kind:
        apply_activation_checkpointing(case.model, kind, blocks=["layers"])
    _, held = held_for_backward(case.run)
    return held


def test_held_bytes_are_exactly_what_each_policy_keeps():
    full, ops, plain = _held("full"), _held("ops"), _held(None)
    # full: each block's input, plus the head's input and output (the loss needs it).
    assert full == (DEPTH + 2) * ACT
    # ops: the same plus each block's attention output and logsumexp.
    assert ops == full + DEPTH * (ACT + LSE)
    assert plain > 5 * ops


def test_held_bytes_ignore_parameters_and_the_result():
    case = toy_case(depth=1)
    _, held = held_for_backward(lambda: case.model.embed.weight.t().sum())
    assert held == 0


def test_op_counter_splits_forward_and_backward():
    case = toy_case(depth=2)
    with OpCounter() as ops:
        loss = case.run()
        assert ops.count(["aten::addmm"], "backward") == 0
        loss.backward()
    assert ops.count(["aten::addmm"]) == 2 * 4 + 2
    assert ops.count(["aten::mm"], "backward") > 0
    assert op_matches("aten::mul.Tensor", {"aten::mul"}) and not op_matches("aten::mul.Tensor", {"aten::mm"})
