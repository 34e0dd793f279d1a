"""``ac-core compare --frontier``: both frontiers at equal saved bytes on the toy (aot_eager), their JSON and plot, and
bad flags refused before anything is measured."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ac_core.budget.devices import device
from ac_core.cli import main
from ac_core.cli.compare_frontier import frontier_value

# A toy small enough to compile in a second or two: 2 blocks, width 64.
TOY = ["--depth", "2", "--dim", "64", "--heads", "2", "--tokens", "32", "--batch", "2"]
MEASURED = {"saved_bytes", "saved_tensors", "recompute_flops", "recompute_seconds", "recomputed"}


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_points_at_equal_saved_bytes_their_json_and_plot(tmp_path, capsys):
    out, plot = tmp_path / "frontier.json", tmp_path / "frontier.png"
    flags = ["--frontier", "0,0.5,0.9", "--gpu", "h100", "--json", str(out), "--plot", str(plot)]
    assert main(["compare", *TOY, *flags]) == 0
    printed = capsys.readouterr().out
    (frontier,) = json.loads(out.read_text())["frontiers"]
    assert frontier.keys() == {"model", "backend", "cost", "device", "least_saved_bytes", "points"}
    assert (frontier["backend"], frontier["cost"], frontier["device"]) == ("aot_eager", "time", device("h100").name)
    points = frontier["points"]
    assert [p["torch_fraction"] for p in points] == [0, 0.5, 0.9]
    # torch at 0 keeps nothing but the graph's inputs: below ac-core's least plan, which keeps each block's input.
    refused, *planned = points
    assert refused["ac_core"] is None and refused["flops_ratio"] is None
    assert refused["torch"]["saved_bytes"] < frontier["least_saved_bytes"]
    assert "less than ac-core's least plan saves" in refused["refused"] and "no ac-core plan" in printed
    for p in planned:
        torch_side, ours = p["torch"], p["ac_core"]
        assert torch_side.keys() == MEASURED and ours.keys() == MEASURED | {"plan"}
        assert frontier["least_saved_bytes"] <= ours["saved_bytes"] <= torch_side["saved_bytes"]  # equal bytes
        assert ours["plan"]["held_bytes"] <= ours["plan"]["budget_bytes"]
        if torch_side["recompute_flops"]:
            assert p["flops_ratio"] == pytest.approx(ours["recompute_flops"] / torch_side["recompute_flops"])
        assert torch_side["recompute_seconds"] > 0 and ours["recompute_seconds"] >= 0
        assert p["seconds_ratio"] == pytest.approx(ours["recompute_seconds"] / torch_side["recompute_seconds"])
        assert f"{torch_side['saved_bytes'] / 2**20:.2f}" in printed
    assert _png_size(plot) == (1320, 504)  # two panels, 5.5 x 4.2 inches each at 120 dpi
    assert f"wrote {out}" in printed and f"wrote {plot}" in printed


def test_frontier_takes_a_count_or_fractions():
    fractions = frontier_value("5")
    assert fractions == (0.1, 0.3, 0.5, 0.7, 0.9)
    assert frontier_value("1") == (0.5,) and frontier_value("0.25,0.5") == (0.25, 0.5)


def test_plot_alone_draws_flops(tmp_path, capsys):
    plot = tmp_path / "frontier.png"
    assert main(["compare", *TOY, "--frontier", "0.5", "--plot", str(plot)]) == 0
    assert _png_size(plot) == (660, 504)
    assert "ac-core plans minimise recompute FLOPs" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--frontier", "--plot", "out.jpg"], "--plot writes a PNG"),
        (["--frontier", "--json", "no/such/folder/f.json"], "folder no/such/folder does not exist"),
        (["--plot", "out.png"], "go with --frontier"),
        (["--gpu", "h100"], "go with --frontier"),
        (["--frontier", "--budget", "0.5"], "not both"),
        (["--frontier", "--gpu", "tpu9"], "--gpu:"),
    ],
)
def test_bad_flags_are_refused_before_measuring(flags, message, capsys):
    assert main(["compare", *TOY, *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("value", "message"),
    [("0,1.5", "fractions lie in [0, 1]"), ("many", "takes a number of points"), ("0", "at least one point")],
)
def test_bad_frontier_values_are_argument_errors(value, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["compare", "--frontier", value])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_plot_without_matplotlib_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert main(["compare", *TOY, "--frontier", "--plot", "out.png"]) == 2
    assert "pip install 'ac-core[plot]'" in capsys.readouterr().err
