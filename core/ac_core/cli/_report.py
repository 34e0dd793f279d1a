"""``ac-core bench`` output: the table, the JSON file and the PNG plot."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ._common import human_bytes, human_flops
from .bench import Row


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
    table = Table(title=f"ac-core bench: {where}", caption=_CAPTION.format(**env), caption_justify="left")
    for name, justify in (
        ("adapter", "left"),
        ("model", "left"),
        ("policy", "left"),
        ("act. peak", "right"),
        ("held for bwd", "right"),
        ("FLOPs", "right"),
        ("recompute", "right"),
        ("attn re-run", "right"),
        ("step", "right"),
        ("vs none", "right"),
        ("grads vs none", "left"),
    ):
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
            table.add_row(row.adapter, row.model or "-", row.label or "-", status)
            continue
        table.add_row(
            row.adapter,
            row.model,
            row.label,
            human_bytes(row.activation_peak_bytes),
            human_bytes(row.held_for_backward_bytes),
            human_flops(row.flops),
            _percent(row.recompute_overhead),
            str(row.attention_recomputed),
            _seconds(row.step_time_s),
            _ratio(row.time_ratio),
            _grads(row),
        )
    console.print(table)
    for note in notes:
        console.print(note)


_CAPTION = (
    "act. peak: peak memory during forward+backward beyond parameters, gradients and inputs; "
    "held for bwd: bytes the forward leaves for backward; recompute: FLOPs over none; "
    "attn re-run: attention kernels run again in backward; step: median of {steps} timed step(s), after "
    "{warmup} warm-up step(s) per model and the row's measured step."
)


def _finite(value: Any) -> Any:
    # JSON has no inf/nan: a figure that is not finite is written as null.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def write_json(path: Path, rows: Sequence[Row], env: dict[str, Any]) -> None:
    """Every figure of every row, plus the environment, as JSON."""
    data = {"environment": env, "rows": [{k: _finite(v) for k, v in row.as_dict().items()} for row in rows]}
    path.write_text(json.dumps(data, indent=2) + "\n")


def write_plot(path: Path, rows: Sequence[Row], env: dict[str, Any]) -> None:
    """Activation peak against recompute overhead: one panel per adapter, one colour per model class."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in rows if r.status == "ok" and r.recompute_overhead is not None]
    adapters = list(dict.fromkeys(r.adapter for r in measured)) or ["(no rows measured)"]
    fig, axes = plt.subplots(1, len(adapters), figsize=(5 * len(adapters), 4.2), squeeze=False)
    for ax, adapter in zip(axes[0], adapters, strict=True):
        models = list(dict.fromkeys(r.model for r in measured if r.adapter == adapter))
        for index, model in enumerate(models):
            points = [r for r in measured if r.adapter == adapter and r.model == model]
            xs = [100 * r.recompute_overhead for r in points]
            ys = [r.activation_peak_bytes / 2**20 for r in points]
            ax.scatter(xs, ys, color=f"C{index}", label=model, zorder=3)
            # Policies that land on the same point (e.g. full and the library's own) share one label.
            labels: dict[tuple[float, float], list[str]] = {}
            for r, x, y in zip(points, xs, ys, strict=True):
                labels.setdefault((round(x, 3), round(y, 3)), []).append(r.label or "")
            for (x, y), names in labels.items():
                ax.annotate(", ".join(names), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.margins(x=0.2, y=0.15)  # room for the labels
        ax.set_title(adapter)
        ax.set_xlabel("recompute overhead (% FLOPs over none)")
        ax.set_ylabel("activation peak (MiB)")
        ax.grid(True, alpha=0.3)
        if models:
            ax.legend(fontsize=7)
    fig.suptitle(f"ac-core bench: {env['device']}, {env['dtype']}, preset {env['preset']}")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
