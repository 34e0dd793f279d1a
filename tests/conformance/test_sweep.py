"""The sweep: its catalog, its rows for classes proven, refused, unbuilt, wrong, hanging and dying, its record, its
table and the command that fails on a regression."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ac_core.cli import main
from ac_core_conformance.sweep import (
    ClassResult,
    SweepRecord,
    Target,
    failure_reasons,
    merged,
    read_record,
    regressions,
    sweep,
    sweep_one,
    targets,
    write_table,
)
from ac_core_conformance.sweep.report import render_section
from ac_core_conformance.sweep.results import CRASHED, FAILED, NOT_BUILT, PROVEN, REFUSED, TIMED_OUT

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

CHECKS = (
    "blocks covered",
    "full: gradients bit-equal",
    "ops: gradients bit-equal",
    "ops: attention kept",
    "names unchanged",
    "50% budget plan held",
)


def _local(name: str) -> Target:
    return Target("diffusers", name, "tests.conformance.sweep_models", name)


def test_catalog_lists_every_declared_class():
    import diffusers.models.transformers as package
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = targets("diffusers")
    assert len(found) >= 69
    assert all(t.module.startswith(package.__name__ + ".") for t in found)
    assert {"WanAnimate2Transformer3DModel", "SD3Transformer2DModel", "CogVideoXTransformer3DModel"} <= {
        t.class_name for t in found
    }
    causal = targets("transformers")
    assert [t.model_type for t in causal] == sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert {t.name: t.class_name for t in causal}["qwen3"] == "Qwen3ForCausalLM"


def test_unknown_class_names_the_known_ones():
    with pytest.raises(ValueError, match=r"no NoSuchModel to sweep; its rows: .*qwen3"):
        targets("transformers", ["qwen3", "NoSuchModel"])
    assert [t.name for t in targets("transformers", ["Qwen3ForCausalLM"])] == ["qwen3"]


def test_a_route_served_class_is_proven_by_every_check():
    row = sweep_one(targets("transformers", ["qwen3"])[0])
    assert row.result == PROVEN, row.reason
    assert row.served_by == "transformers-route"
    assert row.containers == {"model.layers": 2}
    assert row.attention == {"Qwen3DecoderLayer": 1}
    assert [(o.check, o.status) for o in row.checks] == [(c, "passed") for c in CHECKS]


def test_a_curated_class_is_checked_through_its_adapter():
    row = sweep_one(targets("transformers", ["llama"])[0])
    assert (row.result, row.served_by) == (PROVEN, "llama")


def test_a_class_whose_recompute_differs_fails_on_gradients():
    row = sweep_one(_local("CountingModel"))
    assert row.result == FAILED
    assert row.reason.startswith("full: gradients bit-equal: "), row.reason
    assert "gradients differ" in row.reason or "loss" in row.reason
    assert [o.status for o in row.checks] == ["passed", "failed"]


def test_a_local_declared_model_is_proven():
    row = sweep_one(_local("SweptModel"))
    assert row.result == PROVEN, row.reason
    assert row.attention == {"SweptBlock": 1}


def test_refused_and_unbuilt_rows_say_why():
    refused = sweep_one(targets("transformers", ["ctrl"])[0])
    assert refused.result == REFUSED
    assert refused.reason.startswith("it declares no block class")
    unbuilt = sweep_one(targets("transformers", ["bamba"])[0])
    assert unbuilt.result == NOT_BUILT
    assert unbuilt.reason.startswith("the tiny config derived from its defaults does not build")


def test_each_class_runs_in_its_own_process_within_its_time_limit():
    seen: list[str] = []
    rows = sweep(
        [_local("HangingModel"), _local("DyingModel"), _local("SweptModel")],
        jobs=2,
        time_limit=15,  # room for the proven one on a loaded machine; the hanging one sleeps 600 s
        on_result=lambda row: seen.append(row.name),
    )
    assert [(r.name, r.result) for r in rows] == [
        ("HangingModel", TIMED_OUT),
        ("DyingModel", CRASHED),
        ("SweptModel", PROVEN),
    ]
    assert rows[0].reason == "stopped after 15 s"
    assert rows[1].reason == "the process died (exit code 3)"
    assert sorted(seen) == ["DyingModel", "HangingModel", "SweptModel"]


def _row(name: str, result: str, reason: str = "") -> ClassResult:
    return ClassResult("transformers", name, f"{name.title()}ForCausalLM", result, reason)


def test_regressions_merge_and_reasons():
    before = SweepRecord("transformers", {}, [_row("a", PROVEN), _row("b", PROVEN), _row("c", FAILED, "x")])
    now = SweepRecord("transformers", {}, [_row("a", PROVEN), _row("b", FAILED, "ops: loss 1.5 != 2.5")])
    assert [(b.name, n.result) for b, n in regressions(before, now)] == [("b", FAILED)]
    assert [(r.name, r.result) for r in merged(before, now).rows] == [("a", PROVEN), ("b", FAILED), ("c", FAILED)]
    reasons = failure_reasons([_row("d", FAILED, "ops: loss 1.5 != 2.5"), *now.rows])
    assert reasons == [("failed: ops: loss N != N", ["d", "b"])]


def test_table_rewrites_only_its_own_section(tmp_path: Path):
    table = tmp_path / "coverage.md"
    write_table(table, SweepRecord("diffusers", {"diffusers": "1"}, [_row("a", PROVEN)]), ["diffusers", "transformers"])
    write_table(table, SweepRecord("transformers", {}, [_row("t", FAILED, "why | not")]), ["diffusers", "transformers"])
    write_table(table, SweepRecord("diffusers", {"diffusers": "2"}, [_row("b", PROVEN)]), ["diffusers", "transformers"])
    text = table.read_text()
    assert "| b (BForCausalLM) |" in text and "| a (AForCausalLM) |" not in text
    assert "diffusers 2" in text and "why \\| not" in text
    assert text.index("sweep:diffusers:start") < text.index("sweep:transformers:start")


def test_command_writes_the_record_and_fails_on_a_regression(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    record, table = tmp_path / "transformers.json", tmp_path / "coverage.md"
    args = ["sweep", "transformers", "--classes", "qwen3", "ctrl", "--json", str(record), "--table", str(table)]
    assert main([*args, "--jobs", "2"]) == 0
    kept = read_record(record)
    assert kept is not None
    assert {r.name: r.result for r in kept.rows} == {"ctrl": REFUSED, "qwen3": PROVEN}
    assert "1 of 2 transformers classes proven" in capsys.readouterr().out
    # A baseline that had ctrl proven: the command now fails, naming it.
    data = json.loads(record.read_text())
    for row in data["rows"]:
        row["result"] = PROVEN
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps(data))
    assert main([*args, "--baseline", str(baseline)]) == 1
    out = capsys.readouterr().out
    assert "1 classes proven in" in out and "ctrl: refused" in out
    assert "| qwen3 (Qwen3ForCausalLM) | transformers-route |" in table.read_text()


def test_command_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]):
    assert main(["sweep", "transformers", "--table", "x.md"]) == 2
    assert "pass --json FILE too" in capsys.readouterr().err
    assert main(["sweep", "transformers", "--classes", "nope", "--json", "x.json"]) == 2
    assert "no nope to sweep" in capsys.readouterr().err


def test_a_class_built_as_declared_says_so_in_its_row():
    # LTX-2's audio text width is a relation between settings no scaling sees: its entry declares it.
    row = sweep_one(targets("diffusers", ["LTX2VideoTransformer3DModel"])[0])
    assert row.result == PROVEN, row.reason
    assert row.declared.startswith("the audio text width")
    table = render_section(SweepRecord("diffusers", {}, [row]))
    assert f"built as declared in ac_core.libraries.class_builds ({row.declared})" in table
    assert ClassResult.from_json(row.to_json()).declared == row.declared
