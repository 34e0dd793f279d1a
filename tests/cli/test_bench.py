"""``ac-core bench``: every figure for every row, the plot, skipped adapters and bad flags."""

from __future__ import annotations

import gc
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ac_core import register_adapter, registered_adapters
from ac_core.cli import main
from ac_core.cli.allocator import KEEP_FREED, allocator_note
from ac_core.cli.report import HOST_RATIO, HOST_STEP
from ac_core.cli.rows import ROW_FIELDS, row_names, variants
from ac_core.cli.runner import Settings, model_rows
from ac_core.registry import unregister_adapter
from tests.cli.fakes import COLD_MODELS, COLD_TOY, GHOST, LIBRARY_TOY, ColdToy

POLICIES = row_names()  # none, the registered policies, library
ENVIRONMENT_FIELDS = {"torch", "diffusers", "transformers", "device", "dtype", "preset", "seq", "layers", "steps"}
TOY_DEPTH = 4
BUDGET_FIELDS = (
    "budget_bytes",
    "predicted_held_bytes",
    "predicted_recompute_flops",
    "best_fixed_label",
    "best_fixed_held_bytes",
    "best_fixed_recompute_overhead",
    "step_memory_bytes",
    "cost",
    "predicted_overhead",
)


def _bench(tmp_path: Path, *flags: str) -> tuple[int, dict]:
    out = tmp_path / "bench.json"
    code = main(["bench", "--threads", "1", "--json", str(out), *flags])
    return code, json.loads(out.read_text())


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    assert data[12:16] == b"IHDR" and data[-8:-4] == b"IEND", "PNG chunks missing"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_toy_rows_json_table_and_plot(tmp_path, capsys):
    plot = tmp_path / "bench.png"
    code, data = _bench(tmp_path, "--adapter", "toy", "--steps", "2", "--plot", str(plot))
    assert code == 0
    assert data["environment"].keys() >= ENVIRONMENT_FIELDS
    assert data["environment"]["torch"] == torch.__version__ and data["environment"]["preset"] == "tiny"
    rows = {row["policy"]: row for row in data["rows"]}
    assert list(rows) == list(POLICIES)
    for row in data["rows"]:
        assert tuple(row) == ROW_FIELDS
    measured = [p for p in POLICIES if p != "library"]
    for policy in measured:
        row = rows[policy]
        assert row["status"] == "ok", row
        assert all(row[f] is not None for f in ROW_FIELDS if f not in ("reason", "containers", *BUDGET_FIELDS)), row
        assert all(row[f] is None for f in ("containers", *BUDGET_FIELDS)), row
        assert len(row["step_times_s"]) == 2 and row["grad_ok"] is True and row["grad_max_abs_diff"] == 0
    assert rows["none"]["recompute_overhead"] == 0 and rows["none"]["time_ratio"] == 1
    assert {p: rows[p]["attention_recomputed"] for p in measured} == {
        "none": 0,
        "full": TOY_DEPTH,
        "ops": 0,
        "block_skip": TOY_DEPTH // 2,
    }
    assert 0 < rows["ops"]["recompute_overhead"] < rows["full"]["recompute_overhead"]
    held = {p: rows[p]["held_for_backward_bytes"] for p in measured}
    assert held["full"] < held["ops"] < held["none"]
    assert rows["library"]["status"] == "skipped" and "no library checkpointing" in rows["library"]["reason"]
    out = capsys.readouterr().out
    for label in ("none", "full", "ops", "block_skip(n=2)", "library", "skipped (1)", "no library checkpointing"):
        assert label in out
    assert HOST_STEP in out and HOST_RATIO in out  # tiny models time Python, and the table says so
    assert _png_size(plot) == (500, 420)  # one panel: figsize 5 x 4.2 inches at 100 dpi


def test_budget_rows_beside_the_fixed_policies(tmp_path, capsys):
    plot = tmp_path / "bench.png"
    code, data = _bench(
        tmp_path, "--adapter", "toy", "--policy", "full,budget", "--budget", "0.25,0.75", "--steps", "1",
        "--warmup", "0", "--plot", str(plot),
    )  # fmt: skip
    assert code == 0
    rows = {row["label"]: row for row in data["rows"]}
    assert list(rows) == ["none", "full", "budget(0.25)", "budget(0.75)"]
    assert data["environment"]["budgets"] == [0.25, 0.75]
    none = rows["none"]
    for fraction in (0.25, 0.75):
        row = rows[f"budget({fraction})"]
        assert row["status"] == "ok" and row["policy"] == "budget" and row["grad_ok"] is True, row
        # The plan is made on the model's forward; the row's held bytes add the loss's own saved tensors.
        loss_bytes = none["held_for_backward_bytes"] - round(row["budget_bytes"] / fraction)
        assert 0 <= loss_bytes < 0.05 * none["held_for_backward_bytes"]
        assert abs(row["held_for_backward_bytes"] - row["predicted_held_bytes"] - loss_bytes) <= 4  # rounding
        assert row["predicted_held_bytes"] <= row["budget_bytes"]
        assert row["flops"] - none["flops"] == row["predicted_recompute_flops"]
    assert rows["budget(0.25)"]["recompute_overhead"] > rows["budget(0.75)"]["recompute_overhead"]
    out = capsys.readouterr().out
    assert "budget(0.25): budget" in out and "within budget+5%" in out
    assert _png_size(plot) == (500, 420)


def test_budget_flags_are_checked(tmp_path, capsys):
    assert main(["bench", "--adapter", "toy", "--policy", "full", "--budget", "0.5"]) == 2
    assert "add budget to --policy" in capsys.readouterr().err
    assert main(["bench", "--adapter", "toy", "--policy", "budget", "--budget", "lots"]) == 2
    assert "not a size" in capsys.readouterr().err
    assert main(["bench", "--adapter", "toy", "--policy", "budget", "--budget", "1.5"]) == 2
    assert "0 < f <= 1" in capsys.readouterr().err


def test_library_checkpointing_row_is_measured(tmp_path):
    register_adapter(LIBRARY_TOY)
    try:
        code, data = _bench(tmp_path, "--adapter", "librarytoy", "--policy", "full,library", "--steps", "1")
    finally:
        unregister_adapter(LIBRARY_TOY.name)
    assert code == 0
    rows = {row["policy"]: row for row in data["rows"]}
    assert list(rows) == ["none", "full", "library"]  # none always runs first, as the reference
    library = rows["library"]
    assert library["status"] == "ok" and library["detail"] == "enable_gradient_checkpointing()"
    assert library["attention_recomputed"] == TOY_DEPTH and library["grad_ok"] is True
    # The library checkpoints the same blocks as 'full' with the same torch checkpoint: the same FLOPs.
    assert library["flops"] == rows["full"]["flops"]


def test_missing_library_is_skipped_with_the_install_command(tmp_path, capsys):
    register_adapter(GHOST)
    try:
        code, data = _bench(tmp_path, "--adapter", "ghost,toy", "--policy", "none")
    finally:
        unregister_adapter(GHOST.name)
    assert code == 1  # an adapter asked for by name was not measured at all
    ghost = [row for row in data["rows"] if row["adapter"] == "ghost"]
    assert len(ghost) == 1 and ghost[0]["status"] == "skipped"
    assert "pip install 'ac-core[ghost]'" in ghost[0]["reason"]
    captured = capsys.readouterr()
    assert "pip install 'ac-core[ghost]'" in captured.out
    assert "nothing was measured for ghost" in captured.err


def test_an_adapter_whose_every_row_is_skipped_for_its_version_fails(tmp_path, capsys):
    import dataclasses

    from ac_core.testing import TOY_ADAPTER

    old = dataclasses.replace(
        TOY_ADAPTER, name="old_toy", models=(dataclasses.replace(TOY_ADAPTER.models[0], versions="torch<2.0"),)
    )
    register_adapter(old)
    try:
        code, data = _bench(tmp_path, "--adapter", "old_toy", "--policy", "none", "--steps", "1", "--warmup", "0")
    finally:
        unregister_adapter(old.name)
    assert code == 1
    assert [row["status"] for row in data["rows"]] == ["skipped"] and "torch<2.0" in data["rows"][0]["reason"]
    assert "nothing was measured for old_toy" in capsys.readouterr().err


def test_every_registered_adapter_on_the_tiny_preset_in_about_a_minute(tmp_path, toy_registered):
    # CPU time of this process (the bench runs on one thread here): xdist's other workers share the
    # machine's cores and would make wall time measure them too.
    start = time.process_time()
    code, data = _bench(tmp_path)
    elapsed = time.process_time() - start
    assert code == 0
    adapters = {row["adapter"] for row in data["rows"]}
    assert adapters == set(registered_adapters())
    assert all(row["status"] in ("ok", "skipped") for row in data["rows"])
    # A class declared twice (HunyuanVideo's two block variants) gives rows told apart by their model label.
    keys = [(row["adapter"], row["model"], row["label"]) for row in data["rows"]]
    assert len(keys) == len(set(keys))
    # "About a minute": 58-71 s of CPU on the 2-core machines, by processor (imports included when run alone).
    assert elapsed < 90, f"ac-core bench took {elapsed:.0f} s of CPU on the tiny preset"


def test_a_preset_sized_by_layers_and_seq(tmp_path, capsys):
    code, data = _bench(
        tmp_path, "--adapter", "toy", "--preset", "toy-wide", "--layers", "1", "--seq", "64", "--policy", "ops"
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "host overhead" not in out and "vs none" in out  # a real-width preset times the step itself
    assert data["environment"]["layers"] == 1 and data["environment"]["seq"] == 64
    assert [row["tokens"] for row in data["rows"]] == [64, 64]
    assert data["rows"][1]["detail"] == "1 blocks checkpointed"


@pytest.mark.parametrize("warmup", [1, 0])
def test_a_models_one_time_cost_lands_in_no_timed_step(warmup):
    settings = Settings("tiny", None, None, torch.device("cpu"), torch.float32, steps=2, warmup=warmup)
    COLD_MODELS.clear()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # xdist's other worker shares the cores: no thread waits on a descheduled one
    try:
        rows = model_rows(COLD_TOY, COLD_TOY.models[0], variants(["full"], [2]), settings, lambda n: None)
    finally:
        torch.set_num_threads(threads)
    (model,) = COLD_MODELS
    assert [row.status for row in rows] == ["ok", "ok"], [row.reason for row in rows]
    # The warm-up, then each row's measured step (collector on), then two rounds of the two rows' timed steps
    # (collector paused).
    assert model.collector == [True] * warmup + [True] * 2 + [False] * 4
    assert gc.isenabled()
    # The first forward's 0.5 s went to an untimed step: no timed step comes near it.
    times = [t for row in rows for t in row.step_times_s or []]
    assert len(times) == 4 and max(times) < ColdToy.cold_s / 2, times


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--adapter", "nope"], "unknown adapter 'nope'; valid values: all, "),
        (["--adapter", "toy", "--policy", "fastest"], "valid values: all, none, full, ops, block_skip, library"),
        (
            ["--adapter", "toy", "--preset", "huge"],
            "preset 'huge' is not offered by adapter(s) toy; valid values: tiny, toy-wide",
        ),
        (["--adapter", "toy", "--layers", "2"], "the tiny preset has a fixed config. Choose a preset: toy-wide"),
        (["--adapter", "toy", "--plot", "out.jpg"], "--plot writes a PNG"),
        (["--adapter", "toy", "--json", "/no/such/folder/x.json"], "folder /no/such/folder does not exist"),
    ],
)
def test_bad_flags_name_the_valid_values(flags, message, capsys):
    assert main(["bench", *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "valid"),
    [
        (["--dtype", "float8"], ("float32", "bfloat16", "float16")),
        (["--device", "tpu"], ("cpu", "cuda")),
    ],
)
def test_bad_choices_list_the_valid_ones(flags, valid, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"invalid choice: '{flags[1]}'" in err and all(v in err for v in valid)


def test_counts_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--steps", "0"])
    assert "--steps: must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_cuda(capsys):
    assert main(["bench", "--adapter", "toy", "--device", "cuda"]) == 2
    assert "--device cuda: CUDA is not available here" in capsys.readouterr().err


def test_all_without_registered_adapters(monkeypatch, capsys):
    monkeypatch.setattr("ac_core.cli._common.registered_adapters", dict)
    assert main(["bench"]) == 2
    assert "no adapter is registered" in capsys.readouterr().err


def test_the_module_runs_as_a_script():
    result = subprocess.run(
        [sys.executable, "-m", "ac_core.cli", "bench", "--adapter", "nope"], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert "ac-core bench: error: unknown adapter 'nope'" in result.stderr
    lean = "import sys, ac_core; print([m for m in sys.modules if m.startswith(('ac_core.cli', 'rich'))])"
    assert subprocess.run([sys.executable, "-c", lean], capture_output=True, text=True).stdout.strip() == "[]"


def test_offload_rows_and_the_synchronous_baseline(tmp_path):
    from ac_core.offload import use_offload_transport
    from ac_core.offload.testing import RecordingTransport

    # 512 tokens x width 1024 in float32: 2 MiB activations, above offload's 1 MiB threshold.
    flags = ("--adapter", "toy", "--preset", "toy-wide", "--layers", "2", "--seq", "512", "--steps", "1")
    with use_offload_transport(RecordingTransport()) as transport:
        code, data = _bench(tmp_path, *flags, "--policy", "none,full,ops", "--offload", "256")
    assert code == 0
    rows = {row["label"]: row for row in data["rows"]}
    assert list(rows) == ["none", "none+offload", "full", "full+offload", "full+save_on_cpu", "ops", "ops+offload"]
    assert rows["full+save_on_cpu"]["status"] == "skipped" and "needs CUDA" in rows["full+save_on_cpu"]["reason"]
    assert data["environment"]["offload_min_tokens"] == 256
    assert transport.offloaded and not transport.violations
    held = {label: row["held_for_backward_bytes"] for label, row in rows.items() if row["status"] == "ok"}
    for policy in ("none", "full", "ops"):
        assert rows[f"{policy}+offload"]["grad_ok"] is True
        assert held[f"{policy}+offload"] < held[policy], policy
    # Attention outputs retained by 'ops' stay on the device: offload moves the same tensors as under 'full'.
    assert held["ops+offload"] - held["full+offload"] == held["ops"] - held["full"]


def test_the_main_job_prints_no_library_notice(tmp_path):
    # diffusers warns about its float32 modules on any dtype given to .to(), transformers about use_cache
    # under its own checkpointing (the library row). A fresh process: transformers says it once per process.
    if not {"flux", "llama"} <= set(registered_adapters()):
        pytest.skip("the flux and llama adapters are not installed")
    json_path, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    flags = ["--adapter", "flux,llama", "--policy", "library", "--steps", "1", "--warmup", "0", "--threads", "1"]
    result = subprocess.run(
        [sys.executable, "-m", "ac_core.cli", "bench", *flags, "--json", str(json_path), "--plot", str(plot)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert "should be kept in float32" not in result.stdout and "use_cache" not in result.stdout
    lines = result.stdout.splitlines()
    assert lines[0].startswith("ac-core bench: ") and lines[-1] == f"wrote {json_path}, {plot}"
    rows = json.loads(json_path.read_text())["rows"]
    assert {row["adapter"] for row in rows} == {"flux", "llama"} and all(row["status"] == "ok" for row in rows)


def test_offload_flag_is_validated():
    with pytest.raises(SystemExit):
        main(["bench", "--adapter", "toy", "--offload", "0"])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's allocator only")
@pytest.mark.parametrize("tunables", [None, KEEP_FREED])
def test_a_real_width_cpu_run_says_when_glibc_gives_freed_memory_back(tmp_path, capsys, monkeypatch, tunables):
    if tunables is None:
        monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    else:
        monkeypatch.setenv("GLIBC_TUNABLES", tunables)
    code, data = _bench(tmp_path, "--adapter", "toy", "--preset", "toy-wide", "--layers", "1", "--seq", "64")
    out = capsys.readouterr().out
    assert code == 0 and data["environment"]["glibc_tunables"] == tunables
    assert (f"GLIBC_TUNABLES={KEEP_FREED}" in out) == (tunables is None)
    assert allocator_note(torch.device("meta")) is None  # only a CPU's steps pay glibc's page faults
