"""``ac-core bench --subsets``: fixed policies on subsets of a model's containers, block_skip at several n, and
each budget row beside the best fixed row that fits its budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ac_core.cli import main
from ac_core.cli.rows import Row, Variant, best_fixed, compare_with_best_fixed, on_subsets, variants
from ac_core.cli.runner import Settings, model_rows
from ac_core.offload import OffloadConfig
from ac_core.policies import BlockSkip, Full

A, B = "transformer_blocks", "single_transformer_blocks"


def _row(label: str, held: int | None, overhead: float | None, status: str = "ok", **fields) -> Row:
    return Row(
        "a",
        "M",
        label.split("[")[0],
        label,
        status,
        held_for_backward_bytes=held,
        recompute_overhead=overhead,
        **fields,
    )


def _budget(budget_bytes: int | None) -> Row:
    return _row("budget(0.5)", 40, 0.05, budget_bytes=budget_bytes)


FIXED = [
    _row("none", 100, 0.0),
    _row("full", 10, 0.30),
    _row("ops", 20, 0.25),
    _row(f"full[{B}]", 50, 0.12),
    _row(f"ops[{B}]", 55, 0.10),
    _row("block_skip(n=2)", 50, 0.15),
    _row("block_skip(n=3)", None, None, status="error"),
]


@pytest.mark.parametrize(
    ("budget_bytes", "best"),
    [
        (100, "none"),  # none fits: no recompute at all
        (55, f"ops[{B}]"),  # held exactly at the budget fits
        (54, f"full[{B}]"),  # full[B] and block_skip(n=2) both hold 50: the one with less recompute
        (20, "ops"),
        (10, "full"),
        (9, None),  # nothing fits
    ],
)
def test_best_fixed_is_the_least_recompute_that_fits(budget_bytes, best):
    found = best_fixed(_budget(budget_bytes), FIXED)
    assert (found and found.label) == best


def test_best_fixed_ties_on_recompute_go_to_the_least_held():
    rows = [_row("x", 30, 0.1), _row("y", 20, 0.1), _row("z", 25, 0.1)]
    assert best_fixed(_budget(30), rows) is rows[1]


def test_best_fixed_fields_of_a_budget_row():
    row = _budget(54)
    compare_with_best_fixed(row, FIXED)
    assert (row.best_fixed_label, row.best_fixed_held_bytes, row.best_fixed_recompute_overhead) == (
        f"full[{B}]", 50, 0.12,
    )  # fmt: skip
    unplanned = _budget(None)  # a budget row that was skipped has no budget to fit
    compare_with_best_fixed(unplanned, FIXED)
    assert unplanned.best_fixed_label is None and unplanned.best_fixed_recompute_overhead is None


def test_on_subsets_adds_each_fixed_policy_on_each_proper_subset():
    offload = OffloadConfig(min_tokens=1)
    base = [*variants(["full", "block_skip", "library", "budget"], [2, 3], offload, [0.5])]
    labels = [v.label for v in on_subsets(base, [A, B])]
    assert labels == [
        "none", "none+offload",
        "full", f"full[{A}]", f"full[{B}]", "full+offload", "full+save_on_cpu",
        "block_skip(n=2)", f"block_skip(n=2)[{A}]", f"block_skip(n=2)[{B}]", "block_skip(n=2)+offload",
        "block_skip(n=3)", f"block_skip(n=3)[{A}]", f"block_skip(n=3)[{B}]", "block_skip(n=3)+offload",
        "library", "budget(0.5)",
    ]  # fmt: skip
    assert on_subsets(base, [A]) == base  # one container: its only proper subset is empty
    three = on_subsets([Variant(Full())], ["x", "y", "z"])
    assert [v.containers for v in three] == [None, ("x",), ("y",), ("z",), ("x", "y"), ("x", "z"), ("y", "z")]
    assert [v.label for v in on_subsets([Variant(BlockSkip(every=4))], ["x", "y"])][1] == "block_skip(n=4)[x]"


def test_subset_rows_and_the_best_fixed_on_tiny_flux(caplog):
    flux = pytest.importorskip("ac_core_adapters.flux").SPEC
    settings = Settings("tiny", None, None, torch.device("cpu"), torch.float32, steps=1, warmup=0, subsets=True)
    added: list[int] = []
    done: list[int] = []
    rows = model_rows(flux, flux.models[0], variants(["full", "block_skip", "budget"], [2, 3], None, [0.5]),
                      settings, done.append, added.append)  # fmt: skip
    by_label = {row.label: row for row in rows}
    assert list(by_label) == [
        "none", "full", f"full[{A}]", f"full[{B}]",
        "block_skip(n=2)", f"block_skip(n=2)[{A}]", f"block_skip(n=2)[{B}]",
        "block_skip(n=3)", f"block_skip(n=3)[{A}]", f"block_skip(n=3)[{B}]", "budget(0.5)",
    ]  # fmt: skip
    # The progress bar grew by the subset rows' steps (2 per row), and was advanced by every step.
    assert added == [6 * 2] and sum(done) == len(rows) * 2
    # Leaving the other containers unchecked is what a subset row is for: apply's warning about it is dropped.
    assert not [record for record in caplog.records if "outside every container" in record.getMessage()]
    assert all(row.status == "ok" and row.grad_ok for row in rows), [row.reason for row in rows]
    depth = by_label["full"].attention_recomputed // 2  # tiny flux: as many blocks in each container
    for container in (A, B):
        row = by_label[f"full[{container}]"]
        assert row.containers == [container] and row.detail == f"{depth} blocks checkpointed in {container}"
        assert row.attention_recomputed == depth
        assert (
            by_label["full"].held_for_backward_bytes
            < row.held_for_backward_bytes
            < by_label["none"].held_for_backward_bytes
        )
    assert by_label["block_skip(n=2)"].containers is None
    budget = by_label["budget(0.5)"]
    fixed = [row for row in rows if row.policy != "budget"]
    fits = [row for row in fixed if row.held_for_backward_bytes <= budget.budget_bytes]
    best = min(fits, key=lambda row: row.recompute_overhead)
    assert budget.best_fixed_label == best.label
    assert budget.best_fixed_recompute_overhead == best.recompute_overhead
    assert budget.best_fixed_held_bytes == best.held_for_backward_bytes


def test_the_budget_summary_names_the_best_fixed_row(tmp_path: Path, capsys, toy_registered):
    out = tmp_path / "bench.json"
    flags = ["--adapter", "toy", "--policy", "ops,block_skip,budget", "--n-layer", "2,3", "--budget", "0.25,0.01"]
    code = main(["bench", "--threads", "1", "--steps", "1", "--warmup", "0", "--subsets", "--json", str(out), *flags])
    assert code == 0
    data = json.loads(out.read_text())
    # The toy has one container: --subsets adds no row there.
    assert [row["label"] for row in data["rows"]] == [
        "none", "ops", "block_skip(n=2)", "block_skip(n=3)", "budget(0.25)", "budget(0.01)",
    ]  # fmt: skip
    assert data["environment"]["n_layer"] == [2, 3] and data["environment"]["subsets"] is True
    budget = data["rows"][4]
    assert budget["best_fixed_label"] == "ops"
    printed = capsys.readouterr().out
    overhead = f"{budget['recompute_overhead']:+.1%} recompute vs best fixed that fits: ops "
    assert "budget(0.25): budget" in printed and overhead + f"{budget['best_fixed_recompute_overhead']:+.1%}" in printed
    assert data["rows"][5]["status"] == "skipped"  # below the least any plan holds: no summary line


def test_subsets_needs_a_checkpointing_policy(capsys):
    assert main(["bench", "--adapter", "toy", "--policy", "none,budget", "--subsets"]) == 2
    assert "--subsets measures the checkpointing policies" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "2,x", ","])
def test_n_layer_takes_positive_ints(value, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--n-layer", value])
    assert "--n-layer" in capsys.readouterr().err
