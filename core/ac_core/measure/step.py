"""One measured training step (forward, loss, backward) and timed repeats of it."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from ..ops import DEFAULT_RETAINED_OPS
from ..spec import ModelCase
from .flops import GlobalFlopCounter, flops_of
from .memory import held_for_backward
from .ops import OpCounter
from .peak import PeakMemory


@dataclass(frozen=True)
class StepMeasurement:
    """What one forward+backward of a :class:`ModelCase` cost.

    ``activation_peak_bytes``: peak memory during the step beyond parameters, buffers, gradients and
    inputs (all allocated before it). ``held_for_backward_bytes``: bytes the forward left alive for
    backward. ``flops``: forward and backward, recompute included; ``attention_flops`` the part spent
    in the attention kernels. ``attention_forward_calls`` / ``attention_recomputed``: attention forward
    kernel calls during forward, and during backward (recompute). ``grads``: parameter name -> gradient.
    """

    loss: float
    activation_peak_bytes: int
    held_for_backward_bytes: int
    flops: int
    attention_flops: int
    attention_forward_calls: int
    attention_recomputed: int
    grads: dict[str, torch.Tensor] = field(repr=False, compare=False)


def _device_of(case: ModelCase) -> torch.device:
    param = next(case.model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def zero_grads_(model: torch.nn.Module) -> None:
    """Zero every gradient in place, allocating the missing ones, so they cost the same in every step."""
    for param in model.parameters():
        if not param.requires_grad:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        else:
            param.grad.zero_()


def measure_step(
    case: ModelCase,
    attention_ops: Iterable[str] = DEFAULT_RETAINED_OPS,
    *,
    seed: int | None = 0,
    keep_grads: bool = True,
) -> StepMeasurement:
    """Run one forward+backward of ``case`` under every counter at once and return the figures.

    Memory, FLOPs and op counts come from the same step: the counters are dispatch modes that
    compose. ``attention_ops`` are the dispatcher names of the attention forward kernels (an
    adapter's declared backend ops plus :data:`DEFAULT_RETAINED_OPS`). ``seed`` reseeds torch first
    so that dropout draws the same masks in every measured step.
    """
    attention_ops = frozenset(attention_ops)
    zero_grads_(case.model)
    if seed is not None:
        torch.manual_seed(seed)
    peak = PeakMemory(_device_of(case), track=(case.model, list(case.inputs.values())))
    with peak, GlobalFlopCounter() as flops, OpCounter() as ops:
        loss, held = held_for_backward(case.run)
        loss.backward()
    counts = flops.get_flop_counts().get("Global", {})
    grads = {}
    if keep_grads:
        grads = {n: p.grad.detach().clone() for n, p in case.model.named_parameters() if p.grad is not None}
    return StepMeasurement(
        loss=float(loss.detach()),
        activation_peak_bytes=peak.bytes,
        held_for_backward_bytes=held,
        flops=flops.get_total_flops(),
        attention_flops=flops_of(counts, attention_ops),
        attention_forward_calls=ops.count(attention_ops, "forward"),
        attention_recomputed=ops.count(attention_ops, "backward"),
        grads=grads,
    )


def time_steps(
    case: ModelCase, steps: int, warmup: int = 0, *, on_step: Callable[[], None] | None = None
) -> list[float]:
    """Seconds of each of ``steps`` forward+backward passes after ``warmup`` untimed ones.

    ``on_step()`` is called after every pass, warm-up included (a progress bar's advance).
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"time_steps needs steps >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    device = _device_of(case)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    times = []
    for index in range(warmup + steps):
        zero_grads_(case.model)
        sync(device)
        start = time.perf_counter()
        case.run().backward()
        sync(device)
        if index >= warmup:
            times.append(time.perf_counter() - start)
        if on_step is not None:
            on_step()
    return times


# (rtol, atol) per dtype: recompute runs the same kernels, so on CPU the gradients are usually bit-equal;
# the slack covers kernels that accumulate in a nondeterministic order on GPUs.
GRAD_TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-6),
    torch.float64: (1e-10, 1e-12),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float16: (1e-3, 1e-5),
}


@dataclass(frozen=True)
class GradCheck:
    """Gradients compared with a reference: the largest absolute difference, and whether all are close."""

    max_abs_diff: float
    ok: bool


def compare_grads(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> GradCheck:
    """Compare two name -> gradient dicts with :data:`GRAD_TOLERANCE` for their dtype; names must match.

    A NaN where the reference has a NaN is equal (the same computation overflowed alike: a randomly initialised
    model at real width in bfloat16 can); a NaN against a number is an infinite difference.
    """
    if grads.keys() != reference.keys() or not reference:
        return GradCheck(float("inf"), False)
    worst, ok = 0.0, True
    for name, ref in reference.items():
        got = grads[name]
        rtol, atol = GRAD_TOLERANCE.get(ref.dtype, GRAD_TOLERANCE[torch.float32])
        diff = (got.float() - ref.float()).abs().masked_fill(got.isnan() & ref.isnan(), 0.0)
        worst = max(worst, diff.nan_to_num(nan=math.inf).max().item())
        ok = ok and torch.allclose(got, ref, rtol=rtol, atol=atol, equal_nan=True)
    return GradCheck(worst, ok)


__all__ = [
    "GRAD_TOLERANCE",
    "GradCheck",
    "StepMeasurement",
    "compare_grads",
    "measure_step",
    "time_steps",
    "zero_grads_",
]
