"""``ac-core compare --frontier``: both frontiers of saved bytes against recompute, as a table, JSON and a plot."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..budget import CheckpointPlan
from ..experiments import Frontier, FrontierPoint, frontier_fractions
from ..measure import CompiledActivations

_MiB = 2**20
_DPI = 120


def frontier_value(text: str) -> tuple[float, ...]:
    """``--frontier``: a number of points (``5``), spread over torch's budget from 0.1 to 0.9, or the fractions
    themselves (``0.1,0.25,0.5``)."""
    try:
        if "," not in text and "." not in text:
            return frontier_fractions(int(text))
        fractions = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"--frontier takes a number of points (5) or torch's budget fractions (0.1,0.5,0.9), not {text!r} ({exc})"
        ) from None
    if not fractions or any(not 0 <= f <= 1 for f in fractions):
        raise argparse.ArgumentTypeError(f"--frontier: torch's budget fractions lie in [0, 1], got {text!r}")
    return fractions


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_frontier(frontier: Frontier, title: str) -> str:
    """Per point: torch's fraction, what each side saves (MiB) and recomputes (GFLOP, and predicted ms with a
    device), and ac-core over torch; then the points where no plan fits, with why, and those whose plan compiles
    in another layout than the default."""
    timed = frontier.device is not None
    how = f"time on {frontier.device}" if timed else "FLOPs"
    least = f"{frontier.least_bytes / _MiB:.2f} MiB"
    lines = [
        title,
        f"frontiers at equal saved bytes ({frontier.backend}; ac-core plans minimise recompute {how}; "
        f"its least plan saves {least})",
    ]
    head = f"{'torch budget':>12} {'torch MiB':>10} {'ac-core MiB':>11} {'torch GFLOP':>12} {'ac-core GFLOP':>13}"
    head += f" {'ratio':>6}"
    if timed:
        head += f" {'torch ms':>9} {'ac-core ms':>10} {'ratio':>6}"
    lines.append(head)
    for p in frontier.points:
        ours = p.ours
        row = (
            f"{p.fraction:>12.3g} {p.torch.saved_bytes / _MiB:>10.2f} "
            f"{_cell(None if ours is None else ours.saved_bytes / _MiB, '.2f'):>11} "
            f"{p.torch.recompute_flops / 1e9:>12.2f} "
            f"{_cell(None if ours is None else ours.recompute_flops / 1e9, '.2f'):>13} "
            f"{_cell(p.flops_ratio, '.3f'):>6}"
        )
        if timed:
            torch_ms = None if p.torch_seconds is None else p.torch_seconds * 1e3
            ours_ms = None if p.ours_seconds is None else p.ours_seconds * 1e3
            row += f" {_cell(torch_ms, '.3f'):>9} {_cell(ours_ms, '.3f'):>10} {_cell(p.seconds_ratio, '.3f'):>6}"
        lines.append(row)
    lines += [f"budget {p.fraction:g}: no ac-core plan: {p.refused}" for p in frontier.points if p.refused]
    lines += [
        f"budget {p.fraction:g}: ac-core's plan compiles {_layout(p.plan)}"
        for p in frontier.points
        if p.plan is not None and not p.plan.default_layout
    ]
    return "\n".join(lines)


def _layout(plan: CheckpointPlan) -> str:
    """A plan's compiled layout in words (see :class:`~ac_core.budget.CheckpointPlan`)."""
    outside = "recomputed whole" if plan.compile_outside == "recomputed" else "held"
    free = "by torch's rules" if plan.compile_free == "torch_rules" else "at fewest bytes"
    inputs = "recomputable" if plan.compile_block_inputs == "recomputable" else "held"
    return f"with the code outside the blocks {outside}, the ops without FLOPs {free}, the block inputs {inputs}"


def _measured(m: CompiledActivations | None, seconds: float | None) -> dict[str, Any] | None:
    if m is None:
        return None
    return {
        "saved_bytes": m.saved_bytes,
        "saved_tensors": m.saved_tensors,
        "recompute_flops": m.recompute_flops,
        "recompute_seconds": seconds,
        "recomputed": dict(m.recomputed),
    }


def _point(p: FrontierPoint) -> dict[str, Any]:
    ours = _measured(p.ours, p.ours_seconds)
    if ours is not None and p.plan is not None:
        ours["plan"] = {
            "budget_bytes": p.plan.budget_bytes,
            "held_bytes": p.plan.held_bytes,
            "recompute_flops": p.plan.recompute_flops,
            "compile_outside": p.plan.compile_outside,
            "compile_free": p.plan.compile_free,
            "compile_block_inputs": p.plan.compile_block_inputs,
            "blocks": [{"path": b.path, "mode": b.mode.value, "keep": b.keep} for b in p.plan.blocks],
        }
    return {
        "torch_fraction": p.fraction,
        "torch": _measured(p.torch, p.torch_seconds),
        "ac_core": ours,
        "flops_ratio": p.flops_ratio,
        "seconds_ratio": p.seconds_ratio,
        "refused": p.refused,
    }


def frontier_record(frontier: Frontier, title: str) -> dict[str, Any]:
    """One frontier as JSON: the model (``title``), how it was measured, and each point."""
    return {
        "model": title,
        "backend": frontier.backend,
        "cost": frontier.cost,
        "device": frontier.device,
        "least_saved_bytes": frontier.least_bytes,
        "points": [_point(p) for p in frontier.points],
    }


def write_json(path: Path, frontiers: Sequence[tuple[str, Frontier]], env: dict[str, Any]) -> None:
    record = {"environment": env, "frontiers": [frontier_record(f, title) for title, f in frontiers]}
    path.write_text(json.dumps(record, indent=1) + "\n")


def write_plot(path: Path, frontiers: Sequence[tuple[str, Frontier]]) -> None:
    """One row per model: saved MiB against recomputed GFLOP, and (with a device) against predicted recompute ms;
    torch's frontier and ac-core's in each panel."""
    import matplotlib

    matplotlib.use("Agg")  # drawn to files, never to a window
    import matplotlib.pyplot as plt

    columns = 2 if any(f.device is not None for _, f in frontiers) else 1
    fig, axes = plt.subplots(
        max(1, len(frontiers)), columns, figsize=(5.5 * columns, 4.2 * max(1, len(frontiers))), squeeze=False
    )
    for row, (title, frontier) in zip(axes, frontiers, strict=False):
        panels = [("recomputed GFLOP", 1e-9, "flops")]
        if frontier.device is not None:
            panels.append((f"predicted recompute ms on {frontier.device}", 1e3, "seconds"))
        for ax, (label, scale, kind) in zip(row, panels, strict=False):
            for side, style in (("torch", "o-"), ("ac-core", "D--")):
                points = sorted(_plotted(frontier.points, side, kind))
                ax.plot(
                    [x / _MiB for x, _ in points],
                    [y * scale for _, y in points],
                    style,
                    label=side if side == "ac-core" else "torch activation_memory_budget",
                )
            ax.set_xlabel("saved for backward (MiB)")
            ax.set_ylabel(label)
            ax.set_title(title, fontsize=9)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        for ax in row[len(panels) :]:
            ax.set_visible(False)
    fig.suptitle(f"ac-core compare --frontier ({frontiers[0][1].backend if frontiers else 'no model'})")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=_DPI)
    plt.close(fig)


def _plotted(points: Sequence[FrontierPoint], side: str, kind: str) -> list[tuple[int, float]]:
    found = []
    for p in points:
        measured, seconds = (p.torch, p.torch_seconds) if side == "torch" else (p.ours, p.ours_seconds)
        if measured is None:
            continue
        y = measured.recompute_flops if kind == "flops" else seconds
        if y is not None:
            found.append((measured.saved_bytes, float(y)))
    return found
