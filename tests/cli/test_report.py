"""``ac-core bench`` output: the plot's labels do not overlap, its y axis is a percent of none's peak, and the
table's step-time columns say what they time."""

from __future__ import annotations

import itertools

import pytest
from rich.console import Console

from ac_core.cli.report import HOST_RATIO, HOST_STEP, _figure, _Label, _place_labels, plot_points, print_table
from ac_core.cli.rows import Row

matplotlib = pytest.importorskip("matplotlib")


def test_labels_of_nearby_points_do_not_overlap():
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4.2), dpi=100)
    # Two model classes, five policies each, a hair apart: the crowding of a panel like hunyuan's.
    labels = [
        _Label(x + 0.3 * model, y + 0.01 * model, name, f"C{model}")
        for model in range(2)
        for x, y, name in ((0, 2.0, "none"), (20, 1.2, "block_skip(n=2)"), (21, 1.0, "ops"), (30, 0.9, "full"))
    ]
    ax.scatter([label.x for label in labels], [label.y for label in labels])
    ax.margins(x=0.25, y=0.15)
    fig.tight_layout()
    _place_labels(ax, labels)
    renderer = fig.canvas.get_renderer()
    boxes = [text.get_window_extent(renderer) for text in ax.texts]
    plt.close(fig)
    assert len(boxes) == len(labels)
    assert not [(a, b) for a, b in itertools.combinations(boxes, 2) if a.overlaps(b)]


KIB, MIB = 2**10, 2**20
ENV = {"device": "cpu", "device_name": "a CPU", "dtype": "float32", "preset": "tiny", "steps": 3, "warmup": 1}


def _row(model: str, label: str, peak: int | None, overhead: float | None, status: str = "ok") -> Row:
    return Row("hunyuan", model, label.split("(")[0], label, status, activation_peak_bytes=peak,
               recompute_overhead=overhead)  # fmt: skip


# A tiny model and one of 16 MiB in the same panel, as hunyuan's; a model whose none failed has no points.
ROWS = [
    _row("Small", "none", 100 * KIB, 0.0),
    _row("Small", "full", 25 * KIB, 0.30),
    _row("Small", "budget(0.5)", 50 * KIB, 0.10),
    _row("Big", "none", 16 * MIB, 0.0),
    _row("Big", "full", 12 * MIB, 0.30),
    _row("Big", "ops", None, None, status="error"),
    _row("Orphan", "none", None, None, status="error"),
    _row("Orphan", "full", 1 * MIB, 0.30),
]


def test_the_plot_draws_each_peak_as_a_percent_of_its_models_none():
    assert [(row.model, row.label, point) for row, point in plot_points(ROWS)] == [
        ("Small", "none", (0.0, 100.0)),
        ("Small", "full", (30.0, 25.0)),
        ("Small", "budget(0.5)", (10.0, 50.0)),
        ("Big", "none", (0.0, 100.0)),
        ("Big", "full", (30.0, 75.0)),
    ]
    import matplotlib.pyplot as plt

    fig = _figure(ROWS, ENV)
    (ax,) = fig.axes
    drawn = [collection.get_offsets().tolist() for collection in ax.collections]
    budget = [list(line.get_ydata()) for line in ax.lines]
    ylabel = ax.get_ylabel()
    plt.close(fig)
    assert drawn == [[[0.0, 100.0], [30.0, 25.0]], [[0.0, 100.0], [30.0, 75.0]]]  # Small, then Big
    assert budget == [[50.0]] and ylabel == "activation peak (% of none's on the model)"


def _table(preset: str) -> str:
    rows = [Row("toy", "Toy", "none", "none", "ok", step_time_s=0.0175, time_ratio=1.0),
            Row("toy", "Toy", "full", "full", "ok", step_time_s=0.035, time_ratio=2.0)]  # fmt: skip
    console = Console(record=True, width=400)
    print_table(console, rows, {**ENV, "preset": preset})
    return console.export_text()


def test_step_columns_of_the_tiny_preset_say_they_time_host_overhead():
    tiny = _table("tiny")
    assert HOST_STEP in tiny and HOST_RATIO in tiny and "measure host (Python) overhead" in tiny
    assert "17.5 ms" in tiny and "2.00x" in tiny
    wide = _table("toy-wide")
    assert "host" not in wide and " step " in wide and " vs none " in wide and "2.00x" in wide
