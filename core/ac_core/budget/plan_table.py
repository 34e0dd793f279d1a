"""A checkpoint plan as a table for people: per block its mode, kept ops, bytes held and recompute (FLOPs, and
predicted time on the plan's device); the totals, with the predicted step-time overhead over ``none``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..policies import BlockMode
from ..units import human_bytes
from .profile import describe_signature

if TYPE_CHECKING:
    from .checkpoint_plan import CheckpointPlan


def _size(nbytes: float) -> str:
    return human_bytes(nbytes, digits=2)


def _time(seconds: float) -> str:
    """Seconds in s, ms or us, three significant digits."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-6:.3g} us"


def _predicted(plan: CheckpointPlan) -> str:
    """The totals line of a plan with a device: predicted recompute, offload and step-time overhead."""
    recompute = plan.recompute_seconds or 0.0
    line = f"predicted on {plan.device} (knapsack cost: {plan.cost}): recompute {_time(recompute)}"
    if plan.offload_seconds:
        line += f", offload's exposed copies {_time(plan.offload_seconds)}"
    if plan.overhead is not None and plan.none_seconds is not None:
        line += (
            f"; step-time overhead over none {plan.overhead:+.1%} (none's predicted step {_time(plan.none_seconds)}: "
            "the blocks' forward by roofline, backward as twice it, ops outside the blocks not counted)"
        )
    return line


def plan_table(plan: CheckpointPlan) -> str:
    """``str(plan)``: the plan's header lines and one row per block."""
    offload = plan.offload is not None
    timed = plan.device is not None
    rows = [
        (
            "block",
            "class",
            "mode",
            "kept ops",
            "held",
            *(("inputs",) if offload else ()),
            "recompute FLOPs",
            *(("recompute time",) if timed else ()),
        )
    ]
    for b in plan.blocks:
        kept = ", ".join(f"{op.removeprefix('aten::')}#{i}" for op, i in b.keep) or "-"
        inputs = f"host {_size(b.host_bytes)}" if b.offload else "-" if b.mode == BlockMode.NONE else "device"
        cells = (b.path, b.class_name, b.mode.value, kept, _size(b.held_bytes), *((inputs,) if offload else ()))
        seconds = (_time(b.recompute_seconds or 0.0),) if timed else ()
        rows.append((*cells, f"{b.recompute_flops:,}", *seconds))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        f"CheckpointPlan {plan.fingerprint} for {plan.model_class} at ({describe_signature(plan.inputs)})",
        f"budget {_size(plan.budget_bytes)}; predicted held for backward {_size(plan.held_bytes)} "
        f"(none {_size(plan.none_bytes)}, least possible {_size(plan.min_bytes)}); "
        f"recompute {plan.recompute_flops:,} FLOPs",
    ]
    if timed:
        lines.append(_predicted(plan))
    if any(b.offload for b in plan.blocks):
        lines.append(
            f"offload: {_size(plan.host_bytes)} of block inputs to host memory, {_size(plan.freed_bytes)} "
            f"freed on the device; up to {_size(plan.window_bytes)} of them on the device at once (copies in "
            f"flight, prefetched), counted in the budget: {_size(plan.device_bytes)} in all"
        )
    elif offload:
        lines.append("offload: allowed, not needed at this budget")
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)
