"""``ac-core bench --plot``: labels of nearby points do not overlap."""

from __future__ import annotations

import itertools

import pytest

from ac_core.cli.report import _Label, _place_labels

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
