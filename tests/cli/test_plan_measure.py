"""``ac-core plan --measure``: the plan applied to the preset built again and one whole step measured, its peak
printed and written beside the predicted; the flags it cannot measure name the fix."""

from __future__ import annotations

import json
import re

import pytest

from ac_core.budget import CheckpointPlan
from ac_core.cli import main

_TOY = ["plan", "toy", "--preset", "toy-wide", "--layers", "2", "--seq", "256", "--memory"]


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_measured_peak_within_10_percent_of_the_predicted_and_the_budget(tmp_path, capsys, optimizer):
    # toy-wide at 256 tokens: AdamW's least peak is about 467 MiB, none's about 490 MiB; SGD's 208 MiB less.
    memory = 500 * 2**20 if optimizer == "adamw" else 290 * 2**20
    out = tmp_path / "plan.json"
    args = [*_TOY, str(memory), "--optimizer", optimizer, "--device", "cpu", "--measure", "--json", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    measured = json.loads(out.read_text())["measured"]
    plan = CheckpointPlan.from_json(out.read_text())  # the figures beside the plan: it still loads
    assert plan.step_budget is not None and plan.step_budget.optimizer == optimizer
    assert measured["memory_bytes"] == memory and measured["within_budget"] is True
    assert measured["predicted_total_bytes"] <= memory
    assert measured["peak_bytes"] <= memory
    assert abs(measured["peak_bytes"] - measured["predicted_peak_bytes"]) <= 0.10 * measured["peak_bytes"]
    assert measured["ratio"] == pytest.approx(measured["peak_bytes"] / measured["predicted_peak_bytes"])
    line = re.search(r"measured step peak .* predicted \(ratio ([\d.]+);.*within the", printed)
    assert line is not None and float(line.group(1)) == pytest.approx(measured["ratio"], abs=1e-3)


@pytest.mark.parametrize(
    ("flags", "fix"),
    [
        (["--memory", "1GiB"], "plan on real tensors with --device cpu"),
        (["--memory", "1GiB", "--device", "cpu", "--fsdp", "2"], "one process cannot measure a sharded step"),
        (["--budget", "0.5", "--device", "cpu"], "give --memory (or --gpu), not --budget"),
    ],
)
def test_what_cannot_be_measured_names_the_fix(capsys, flags, fix):
    assert main(["plan", "toy", *flags, "--measure"]) == 2
    assert fix in capsys.readouterr().err
