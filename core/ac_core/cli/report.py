"""``ac-core bench`` output: the table, the JSON file and the PNG plot."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..units import human_bytes
from ._common import TINY, human_flops
from .rows import BUDGET, NONE, STEP, Row


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f} s" if value >= 1 else f"{value * 1e3:.1f} ms"


def _grads(row: Row) -> str:
    if row.grad_ok is None:
        return "-"
    diff = "0" if row.grad_max_abs_diff == 0 else f"{row.grad_max_abs_diff:.1e}"
    return f"ok ({diff})" if row.grad_ok else f"[red]DIFFER ({diff})[/]"


def print_table(console: Console, rows: Sequence[Row], env: dict[str, Any]) -> None:
    """The rows as a rich table, grouped by model, with the run's settings in the title."""
    where = f"{env['device']} ({env['device_name']}), {env['dtype']}, preset {env['preset']}"
    if env.get("seq") is not None or env.get("layers") is not None:
        where += f", seq {env.get('seq') or 'default'}, layers {env.get('layers') or 'default'}"
    host = env["preset"] == TINY
    predicted = env.get("predict") is not None
    caption = _CAPTION.format(**env) + (_CPU_CLOCK_CAPTION if env.get("clock") == "cpu" else "")
    caption += _PREDICT_CAPTION.format(**env) if predicted else ""
    caption += _HOST_CAPTION if host else ""
    table = Table(title=f"ac-core bench: {where}", caption=caption, caption_justify="left")
    step, ratio = (HOST_STEP, HOST_RATIO) if host else ("step", "vs none")
    columns = [
        ("adapter", "left"),
        ("model", "left"),
        ("policy", "left"),
        ("act. peak", "right"),
        ("held for bwd", "right"),
        ("FLOPs", "right"),
        ("recompute", "right"),
        ("attn re-run", "right"),
        (step, "right"),
        (ratio, "right"),
        *([(PREDICTED, "right")] if predicted else []),
        ("grads vs none", "left"),
    ]
    for name, justify in columns:
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    previous = None
    notes: list[str] = []
    for row in rows:
        if previous is not None and (row.adapter, row.model) != previous:
            table.add_section()
        previous = (row.adapter, row.model)
        if row.status != "ok":
            # The reason goes below the table, numbered: it is too long for a cell.
            style = "yellow" if row.status == "skipped" else "red"
            notes.append(f"[{style}]({len(notes) + 1})[/] {escape(row.reason or '')}")
            status = f"[{style}]{row.status} ({len(notes)})[/]"
            table.add_row(row.adapter, row.model or "-", escape(row.label or "-"), status)
            continue
        table.add_row(
            row.adapter,
            row.model,
            escape(row.label or "-"),  # a subset row's label has [brackets], which rich reads as markup
            human_bytes(row.activation_peak_bytes),
            human_bytes(row.held_for_backward_bytes),
            human_flops(row.flops),
            _percent(row.recompute_overhead),
            str(row.attention_recomputed),
            _seconds(row.step_time_s),
            _ratio(row.time_ratio),
            *([_ratio(None if row.predicted_overhead is None else 1 + row.predicted_overhead)] if predicted else []),
            _grads(row),
        )
    console.print(table)
    for note in notes:
        console.print(note)
    for line in budget_lines(rows) + step_lines(rows):
        console.print(line, markup=False)
    if predicted:
        for line in correlation_lines(rows, env["predict"]):
            console.print(line, markup=False)


def _ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks of ``values``; tied values share the average of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for position in range(start, end + 1):
            ranks[order[position]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rank correlation of paired ``xs`` and ``ys``: Pearson's correlation of their ranks, ties at
    their average rank. None where it is undefined: fewer than two pairs, or every value of one side tied."""
    if len(xs) != len(ys):
        raise ValueError(f"spearman takes paired values: {len(xs)} xs against {len(ys)} ys")
    if len(xs) < 2:
        return None
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    covariance = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    spread = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return covariance / spread if spread else None


def _by_model(rows: Sequence[Row]) -> dict[tuple[str, str], list[Row]]:
    models: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        if row.status == "ok":
            models.setdefault((row.adapter, row.model), []).append(row)
    return models


def correlations(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Per model, the rank correlation of predicted and measured step-time overhead over its rows with both
    (``rank_correlation`` None where undefined), and those rows' labels."""
    found = []
    for (adapter, model), measured in _by_model(rows).items():
        paired = [r for r in measured if r.predicted_overhead is not None and r.time_ratio is not None]
        rho = spearman([r.predicted_overhead or 0.0 for r in paired], [(r.time_ratio or 0.0) - 1 for r in paired])
        found.append({"adapter": adapter, "model": model, "rank_correlation": rho, "rows": [r.label for r in paired]})
    return found


def correlation_lines(rows: Sequence[Row], device: str) -> list[str]:
    """One line per model: the rank correlation of predicted (on ``device``) and measured overhead."""
    lines = []
    for found in correlations(rows):
        rho = found["rank_correlation"]
        value = "undefined (fewer than two rows, or all tied)" if rho is None else f"{rho:.3f}"
        lines.append(
            f"{found['adapter']} {found['model']}: rank correlation (Spearman) of predicted ({device}) and measured "
            f"step-time overhead over {len(found['rows'])} rows: {value}"
        )
    return lines


def step_pairs(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Per model and step budget measured in both costs: the time-costed and FLOP-costed rows' labels, median
    steps, predicted overheads, and the time-costed step over the FLOP-costed."""
    pairs = []
    for (adapter, model), measured in _by_model(rows).items():
        by_memory: dict[int, dict[str, Row]] = {}
        for row in measured:
            if row.policy == STEP and row.step_memory_bytes is not None and row.cost is not None:
                by_memory.setdefault(row.step_memory_bytes, {})[row.cost] = row
        for memory, costs in by_memory.items():
            time, flops = costs.get("time"), costs.get("flops")
            if time is None or flops is None or not time.step_time_s or not flops.step_time_s:
                continue
            pair: dict[str, Any] = {"adapter": adapter, "model": model, "memory_bytes": memory}
            for cost, row in (("time", time), ("flops", flops)):
                pair[cost] = {
                    "label": row.label,
                    "step_time_s": row.step_time_s,
                    "time_ratio": row.time_ratio,
                    "predicted_overhead": row.predicted_overhead,
                    "recompute_overhead": row.recompute_overhead,
                }
            pair["time_over_flops"] = time.step_time_s / flops.step_time_s
            pairs.append(pair)
    return pairs


def step_lines(rows: Sequence[Row]) -> list[str]:
    """One line per step budget measured in both costs: the two plans' measured steps side by side."""

    def one(side: dict[str, Any]) -> str:
        predicted = side["predicted_overhead"]
        guess = "" if predicted is None else f", predicted {_percent(predicted)}"
        return f"{_seconds(side['step_time_s'])} ({_ratio(side['time_ratio'])} none{guess})"

    return [
        f"{pair['adapter']} {pair['model']} step budget {human_bytes(pair['memory_bytes'], digits=2)}: "
        f"time-costed plan {one(pair['time'])}, FLOP-costed {one(pair['flops'])}: time-costed step "
        f"{pair['time_over_flops']:.3f}x the FLOP-costed"
        for pair in step_pairs(rows)
    ]


def budget_lines(rows: Sequence[Row]) -> list[str]:
    """One line per measured budget row: its budget, the plan's prediction, what was measured against both, and
    its recompute beside the best fixed row that fits the same budget."""
    lines = []
    for row in rows:
        if row.policy != BUDGET or row.status != "ok" or row.budget_bytes is None:
            continue
        held = row.held_for_backward_bytes or 0
        predicted = row.predicted_held_bytes or 0
        within = "within" if held <= 1.05 * row.budget_bytes else "OVER"
        error = f"{(predicted - held) / held:+.1%}" if held else "-"
        lines.append(
            f"{row.adapter} {row.model} {row.label}: budget {human_bytes(row.budget_bytes)}, planned "
            f"{human_bytes(predicted)} (error {error}), measured {human_bytes(held)}: {within} budget+5%; "
            f"planned recompute {human_flops(row.predicted_recompute_flops)}; {_versus_best_fixed(row)}"
        )
    return lines


def _versus_best_fixed(row: Row) -> str:
    recompute = f"{_percent(row.recompute_overhead)} recompute vs best fixed that fits"
    if row.best_fixed_label is None:
        return f"{recompute}: none fits"
    best = f"{row.best_fixed_label} {_percent(row.best_fixed_recompute_overhead)}"
    return f"{recompute}: {best} (held {human_bytes(row.best_fixed_held_bytes)})"


_CAPTION = (
    "act. peak: peak memory during forward+backward beyond parameters, gradients and inputs; "
    "held for bwd: bytes the forward leaves for backward; recompute: FLOPs over none; "
    "attn re-run: attention kernels run again in backward; step: median of {steps} timed step(s), one per round "
    "over the rows in turn, after {warmup} warm-up step(s) of the plain model and every row's measured step, the "
    "garbage collector paused."
)
_CPU_CLOCK_CAPTION = " Steps timed in CPU seconds of the process (--clock cpu), not wall-clock seconds."
PREDICTED = "predicted"
_PREDICT_CAPTION = (
    " predicted: step time over none's by roofline on {predict} (what the row recomputes, op by op, over none's "
    "predicted step); '-' where not modelled (the library's checkpointing, offload)."
)
# Tiny models are a few KiB wide: their steps time Python and dispatch overhead, which checkpointing adds to
# (a checkpointed row reruns its forward's Python), and not the device work a real-width model's step is.
HOST_STEP, HOST_RATIO = "step (host overhead, tiny)", "vs none (host overhead)"
_HOST_CAPTION = (
    " On the tiny preset step and vs none measure host (Python) overhead, not what a real-width step costs: "
    "time a real-width preset (--preset) for step-time ratios."
)


def _finite(value: Any) -> Any:
    # JSON has no inf/nan: a figure that is not finite is written as null.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def write_json(path: Path, rows: Sequence[Row], env: dict[str, Any]) -> None:
    """Every figure of every row, plus the environment, each model's rank correlation of predicted and measured
    overhead (with ``--predict``) and each step budget's two plans side by side, as JSON."""
    data = {
        "environment": env,
        "rows": [{k: _finite(v) for k, v in row.as_dict().items()} for row in rows],
        "rank_correlations": correlations(rows) if env.get("predict") is not None else [],
        "step_budgets": step_pairs(rows),
    }
    path.write_text(json.dumps(data, indent=2) + "\n")


def write_plot(path: Path, rows: Sequence[Row], env: dict[str, Any]) -> None:
    """Activation peak, as a percent of ``none``'s on the same model, against recompute overhead: one panel per
    adapter, one colour per model class."""
    fig = _figure(rows, env)
    import matplotlib.pyplot as plt  # after _figure has chosen the backend

    fig.savefig(path, format="png", dpi=_DPI)
    plt.close(fig)


def _figure(rows: Sequence[Row], env: dict[str, Any]) -> Any:
    """The plot's figure (matplotlib's, on its Agg backend: drawn to files, never to a window)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = plot_points(rows)
    adapters = list(dict.fromkeys(r.adapter for r, _ in measured)) or ["(no rows measured)"]
    fig, axes = plt.subplots(1, len(adapters), figsize=(5 * len(adapters), 4.2), dpi=_DPI, squeeze=False)
    labels: dict[Any, list[_Label]] = {}
    for ax, adapter in zip(axes[0], adapters, strict=True):
        models = list(dict.fromkeys(r.model for r, _ in measured if r.adapter == adapter))
        # Policies that land on the same point (e.g. full and the library's own, or one policy on two
        # model classes) share one label, in the model's colour or grey where models share it.
        shared: dict[tuple[float, float], tuple[list[str], set[str]]] = {}
        for index, model in enumerate(models):
            points = [(r, point) for r, point in measured if r.adapter == adapter and r.model == model]
            fixed = [(r, point) for r, point in points if r.policy != BUDGET]
            ax.scatter([x for _, (x, _) in fixed], [y for _, (_, y) in fixed], color=f"C{index}", label=model, zorder=3)
            # The budget policy's rows: a curve of memory against recompute, the fixed policies points beside it.
            curve = sorted((point for r, point in points if r.policy == BUDGET), key=lambda point: point[0])
            if curve:
                ax.plot(
                    [x for x, _ in curve],
                    [y for _, y in curve],
                    color=f"C{index}",
                    marker="D",
                    markersize=4,
                    linestyle="--",
                    label=f"{model} {BUDGET}",
                    zorder=3,
                )
            for r, (x, y) in points:
                names, colors = shared.setdefault((round(x, 3), round(y, 3)), ([], set()))
                names.append(r.label or "")
                colors.add(f"C{index}")
        labels[ax] = [
            _Label(x, y, ", ".join(dict.fromkeys(names)), colors.pop() if len(colors) == 1 else "0.3")
            for (x, y), (names, colors) in shared.items()
        ]
        ax.margins(x=0.25, y=0.15)  # room for the labels
        ax.set_title(adapter)
        ax.set_xlabel("recompute overhead (% FLOPs over none)")
        ax.set_ylabel("activation peak (% of none's on the model)")
        ax.grid(True, alpha=0.3)
        if models:
            ax.legend(fontsize=7)
    fig.suptitle(f"ac-core bench: {env['device']}, {env['dtype']}, preset {env['preset']}")
    fig.tight_layout()
    # Placed after the layout: label positions are worked out in display space, which the layout changes.
    for ax, panel in labels.items():
        _place_labels(ax, panel)
    return fig


def plot_points(rows: Sequence[Row]) -> list[tuple[Row, tuple[float, float]]]:
    """Each measured row with its point: (recompute overhead in %, activation peak in % of the ``none`` row's
    of the same model), so that panels of models a thousand times apart in size read alike.

    A model whose ``none`` row was not measured (or peaked at 0 bytes) has no points.
    """
    none_peaks = {
        (r.adapter, r.model): r.activation_peak_bytes
        for r in rows
        if r.label == NONE and r.status == "ok" and r.activation_peak_bytes
    }
    points = []
    for r in rows:
        reference = none_peaks.get((r.adapter, r.model))
        if r.status != "ok" or r.recompute_overhead is None or r.activation_peak_bytes is None or not reference:
            continue
        points.append((r, (100 * r.recompute_overhead, 100 * r.activation_peak_bytes / reference)))
    return points


_DPI = 100
_GAP = 3.0  # pixels between a point and its label, and between labels


@dataclass(frozen=True)
class _Label:
    x: float
    y: float
    text: str
    color: str


def _place_labels(ax: Any, labels: Sequence[_Label]) -> None:
    """Annotate each point with its label where the label overlaps no other label, marker or the legend.

    Top points first, each label takes the first free spot beside its point, right then left, then
    further above or below it; a label moved off its point gets a thin line back to it.
    """
    from matplotlib.transforms import Bbox

    renderer = ax.figure.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    points = [ax.transData.transform((label.x, label.y)) for label in labels]
    taken = [Bbox.from_bounds(px - 4, py - 4, 8, 8) for px, py in points]  # the markers
    legend = ax.get_legend()
    if legend is not None:
        taken.append(legend.get_window_extent(renderer))
    for label, (px, py) in sorted(zip(labels, points, strict=True), key=lambda item: -item[1][1]):
        probe = ax.figure.text(0, 0, label.text, fontsize=8)
        size = probe.get_window_extent(renderer)
        probe.remove()
        line = size.height + _GAP
        spots = [
            Bbox.from_bounds(px + dx, py + dy, size.width, size.height)
            for step in range(int(frame.height // line) + 1)
            for dy in (_GAP + step * line, -line - step * line)
            for dx in (_GAP + 2, -size.width - _GAP - 2)
        ]
        box = next((spot for spot in spots if _free(spot, frame, taken)), spots[0])
        taken.append(box)
        moved = not (py - line <= box.y0 <= py + _GAP)
        ax.annotate(
            label.text,
            (label.x, label.y),
            xytext=(box.x0 - px, box.y0 - py),
            textcoords="offset pixels",
            va="bottom",
            fontsize=8,
            color=label.color,
            zorder=4,
            arrowprops={"arrowstyle": "-", "color": label.color, "lw": 0.5, "shrinkA": 0} if moved else None,
        )


def _free(box: Any, frame: Any, taken: Sequence[Any]) -> bool:
    inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
    return inside and not any(box.overlaps(other) for other in taken)
