"""``ac-core bench --predict`` and ``--memory``: each row's predicted step-time overhead beside the measured, their
rank correlation, step-budget rows in both costs, and timing interleaved over the rows."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from ac_core import AdapterSpec, ModelCase, ModelSpec, checkpointed_blocks
from ac_core.blocks import resolve_blocks
from ac_core.budget import MemoryBudget, StepBudget, StepPlanner, predict_step, profile_model
from ac_core.budget.devices import CALIBRATION_ENV, DEVICES, Device, save_calibration
from ac_core.budget.predict import step_facts
from ac_core.budget.solve import none_step_seconds, recompute_seconds
from ac_core.cli import main
from ac_core.cli.report import spearman
from ac_core.cli.rows import STEP, Variant, variants
from ac_core.cli.runner import Planner, Settings, SkipRow, build, model_rows
from ac_core.policies import BlockDecision, BlockMode
from ac_core.testing import TOY_ADAPTER, ToyTransformer

H100 = DEVICES["h100-sxm"]
TOY = TOY_ADAPTER.models[0]
FIXED = ("none", "full", "ops", "block_skip(n=2)")


def _settings(**options) -> Settings:
    return Settings("tiny", None, None, torch.device("cpu"), torch.float32, steps=1, warmup=0, **options)


def _step_memory(case: ModelCase) -> int:
    """A step budget halfway between what every block checkpointed and none are predicted to peak at, the
    budget's 5% margin kept free on top."""
    budget = StepBudget("1GiB", device="cpu", loss=case.loss)
    inputs = dict(case.inputs)
    peaks = [predict_step(case.model, inputs, p, budget, adapter=TOY_ADAPTER).peak for p in ("full", "none")]
    assert peaks[0] < peaks[1]
    return round(sum(peaks) / 2 / (1 - budget.margin))


@pytest.mark.parametrize(
    ("xs", "ys", "rho"),
    [
        ([1, 2, 3], [1, 3, 2], 0.5),
        ([1, 2, 3], [3, 2, 1], -1.0),
        ([0.1, 5.0, 2.0, 7.0], [10, 400, 30, 401], 1.0),  # ranks only: any increasing map is 1
        ([1, 2, 2, 3], [1, 2, 3, 4], 4.5 / math.sqrt(22.5)),  # the tie at rank 2.5 each
        ([1, 1, 2, 2], [1, 2, 1, 2], 0.0),
    ],
)
def test_spearman_on_known_values(xs, ys, rho):
    assert spearman(xs, ys) == pytest.approx(rho, abs=1e-12)


def test_spearman_is_undefined_without_spread_and_refuses_unpaired_values():
    assert spearman([1.0], [2.0]) is None
    assert spearman([1, 2, 3], [4, 4, 4]) is None
    with pytest.raises(ValueError, match="paired values: 2 xs against 3 ys"):
        spearman([1, 2], [1, 2, 3])


def test_predicted_overheads_of_the_fixed_rows_and_a_plan():
    settings = _settings(predict=H100)
    half = MemoryBudget.of(0.5)
    chosen = variants(["full", "ops", "block_skip", "budget"], [2], None, [half])
    rows = model_rows(TOY_ADAPTER, TOY, chosen, settings, lambda n: None)
    assert all(row.status == "ok" and row.predicted_overhead is not None for row in rows), rows
    predicted = {row.label: float(row.predicted_overhead or 0) for row in rows}
    assert predicted["none"] == 0
    assert max(predicted[label] for label in FIXED) == predicted["full"] > 0
    assert 0 < predicted["ops"] < predicted["full"]  # ops keeps the attention kernels' outputs
    assert 0 < predicted["block_skip(n=2)"] < predicted["full"]

    # Against the profile directly: full recomputes each block's whole recompute, block_skip every other one's.
    case = build(TOY, settings)
    planner = Planner(case, TOY_ADAPTER, settings)
    profile = planner.profile
    none = none_step_seconds(profile, H100)
    whole = [block.recompute_seconds(H100) for _, block in profile.blocks]
    assert predicted["full"] == pytest.approx(sum(whole) / none, rel=1e-12)
    assert predicted["block_skip(n=2)"] == pytest.approx(sum(whole[::2]) / none, rel=1e-12)
    # A plan's own prediction, and the same from its blocks as decisions.
    plan = planner(Variant("budget", budget=half))
    assert plan.device == H100.name and plan.cost == "flops"
    assert predicted["budget(0.5)"] == plan.overhead
    assert recompute_seconds(profile, plan.blocks, H100) == pytest.approx(plan.recompute_seconds, rel=1e-12)
    everything = [BlockDecision(path, BlockMode.OPS, retain=frozenset(op.op for op in block.recomputed))
                  for path, block in profile.blocks]  # fmt: skip
    assert recompute_seconds(profile, everything, H100) == 0


def test_no_prediction_without_predict_nor_for_offload_rows():
    rows = model_rows(TOY_ADAPTER, TOY, variants(["full"], [2]), _settings(), lambda n: None)
    assert [row.predicted_overhead for row in rows] == [None, None]
    case = build(TOY, _settings())
    planner = Planner(case, TOY_ADAPTER, _settings(predict=H100))
    assert planner.overhead(Variant("library"), None) is None
    assert planner.overhead(variants(["full"], [2])[1], None) is not None


def test_memory_rows_plan_a_step_budget_in_each_cost():
    settings = _settings(predict=H100, step_device=H100)
    case = build(TOY, settings)
    memory = _step_memory(case)
    planner = Planner(case, TOY_ADAPTER, settings)
    chosen = variants(["none"], [2], memories=[memory])
    assert [v.label for v in chosen] == ["none", f"{STEP}({memory / 2**20:.2f} MiB,time)",
                                         f"{STEP}({memory / 2**20:.2f} MiB,flops)"]  # fmt: skip
    for variant, cost in zip(chosen[1:], ("time", "flops"), strict=True):
        plan = planner(variant)
        assert plan.cost == cost and plan.device == H100.name
        assert plan.step_budget == StepBudget(memory, device="cpu")
        assert any(block.mode != BlockMode.NONE for block in plan.blocks)  # none does not fit
        step = StepBudget(memory, device="cpu", loss=case.loss)
        peak = predict_step(case.model, dict(case.inputs), plan, step, adapter=TOY_ADAPTER)
        assert peak.fits
    sgd = Planner(case, TOY_ADAPTER, _settings(optimizer="sgd")).step_budget(memory)
    assert (sgd.optimizer, sgd.loss, sgd.device) == ("sgd", case.loss, "cpu")


def test_one_profile_and_one_step_measurement_serve_every_budget_and_step_row(monkeypatch):
    counts = {"profile": 0, "facts": 0}

    def counted(name, real):
        def call(*args, **kwargs):
            counts[name] += 1
            return real(*args, **kwargs)

        return call

    profile = counted("profile", profile_model)
    monkeypatch.setattr("ac_core.cli.runner.profile_model", profile)
    monkeypatch.setattr("ac_core.budget.planning.profile_model", profile)
    monkeypatch.setattr("ac_core.budget.planning.step_facts", counted("facts", step_facts))
    settings = _settings(predict=H100, step_device=H100)
    case = build(TOY, settings)
    memory = _step_memory(case)
    planner = Planner(case, TOY_ADAPTER, settings)
    budget = planner(Variant("budget", budget=MemoryBudget.of(0.5)))  # profiles before any step row
    steps = variants(["none"], [2], memories=[memory, memory + 2**20])[1:]
    plans = [planner(variant) for variant in steps]
    with pytest.raises(SkipRow, match="no plan fits"):
        planner(Variant(STEP, memory=1, cost="flops"))
    assert counts == {"profile": 1, "facts": 1}
    assert [p.cost for p in plans] == ["time", "flops"] * 2
    assert [p.step_budget.nbytes for p in plans if p.step_budget] == [memory] * 2 + [memory + 2**20] * 2
    assert planner(Variant("budget", budget=MemoryBudget.of(0.5))) == budget and counts["profile"] == 1
    # The same plans as a StepPlanner of each row's own, profiling afresh.
    blocks = resolve_blocks(case.model, TOY_ADAPTER, None)
    for variant, plan in zip(steps, plans, strict=True):
        assert variant.memory is not None
        step = planner.step_budget(variant.memory)
        own = StepPlanner(blocks, dict(case.inputs), step, cost=variant.cost, device=H100)
        assert own.plan() == plan
    assert counts == {"profile": 5, "facts": 5}


def _bench(tmp_path: Path, *flags: str) -> tuple[int, dict]:
    out = tmp_path / "bench.json"
    code = main(["bench", "--threads", "1", "--json", str(out), *flags])
    return code, json.loads(out.read_text())


def test_json_and_table_carry_the_predictions(tmp_path, capsys):
    memory = _step_memory(build(TOY, _settings()))
    flags = ["--adapter", "toy", "--policy", "none,full,ops,block_skip,budget", "--budget", "0.5"]
    code, data = _bench(tmp_path, *flags, "--memory", str(memory), "--predict", "h100", "--steps", "2")
    assert code == 0
    assert data["environment"]["predict"] == "h100-sxm" and data["environment"]["memories"] == [memory]
    rows = {row["label"]: row for row in data["rows"]}
    steps = [label for label in rows if label.startswith(f"{STEP}(")]
    assert [rows[label]["cost"] for label in steps] == ["time", "flops"]
    assert all(rows[label]["step_memory_bytes"] == memory for label in steps)
    assert all(row["status"] == "ok" and row["predicted_overhead"] is not None for row in data["rows"])
    assert all(len(row["step_times_s"]) == 2 for row in data["rows"])
    (found,) = data["rank_correlations"]
    assert found["rows"] == list(rows) and -1 <= found["rank_correlation"] <= 1
    (pair,) = data["step_budgets"]
    assert (pair["memory_bytes"], pair["time"]["label"], pair["flops"]["label"]) == (memory, *steps)
    assert pair["time_over_flops"] == rows[steps[0]]["step_time_s"] / rows[steps[1]]["step_time_s"]
    out = capsys.readouterr().out
    assert "predicted" in out and "rank correlation (Spearman) of predicted (h100-sxm) and measured" in out
    assert "time-costed plan" in out and "the FLOP-costed" in out


def test_predict_cpu_reads_the_calibration(tmp_path, monkeypatch):
    path = tmp_path / "calibration.json"
    monkeypatch.setenv(CALIBRATION_ENV, str(path))
    save_calibration(Device("cpu", 1e11, 5e10, None, 2e10, 2e10, 2**34), path)
    flags = ("--adapter", "toy", "--policy", "full", "--predict", "cpu", "--steps", "1", "--clock", "cpu")
    code, data = _bench(tmp_path, *flags)
    assert code == 0 and data["environment"]["predict"] == "cpu" and data["environment"]["clock"] == "cpu"
    assert all(row["step_time_s"] > 0 for row in data["rows"])
    assert [row["predicted_overhead"] > 0 for row in data["rows"]] == [False, True]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--predict", "tpu9"], "--predict: unknown device 'tpu9'; known: h100-sxm, h100-pcie, h200"),
        (["--memory", "0.5"], "--memory: '0.5': one rank's memory in bytes or a size such as 80GiB; a fraction"),
        (["--memory", "lots"], "--memory: "),
        (["--memory", ","], "--memory names no step budget; e.g. --memory 2GiB,3GiB"),
        (["--predict", "cpu"], "--predict cpu: no calibration at "),
        (["--memory", "2GiB"], "--memory (its step rows costed in time on --device) cpu: no calibration at "),
        (["--device", "cuda", "--clock", "cpu"], "--clock cpu times the process's CPU time, which a cuda step's"),
        (["--optimizer", "sgd"], "--optimizer counts its state in the step rows' step budgets; give --memory"),
    ],
)
def test_bad_flags_name_the_fix(flags, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(CALIBRATION_ENV, str(tmp_path / "never-written.json"))
    assert main(["bench", "--adapter", "toy", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    if "no calibration" in message:
        assert "run `ac-core calibrate` first" in err


class CheckpointRecorder(ToyTransformer):
    """A toy that notes, per forward, how many of its blocks are checkpointed: which row each step ran."""

    def __init__(self) -> None:
        super().__init__()
        self.checkpointed: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.checkpointed.append(len(checkpointed_blocks(self)))
        return super().forward(x)


RECORDERS: list[CheckpointRecorder] = []


def _recorder_case() -> ModelCase:
    torch.manual_seed(0)
    RECORDERS.append(CheckpointRecorder())
    return ModelCase(RECORDERS[-1], {"x": torch.randn(2, 32, 64)}, lambda out: out.pow(2).mean())


RECORDER = AdapterSpec(
    name="recorder",
    models=(ModelSpec(cls=f"{__name__}.CheckpointRecorder", containers=("layers",), tiny=_recorder_case),),
)


def test_rows_are_timed_interleaved_one_step_each_per_round():
    RECORDERS.clear()
    settings = Settings("tiny", None, None, torch.device("cpu"), torch.float32, steps=3, warmup=1)
    done: list[int] = []
    rows = model_rows(RECORDER, RECORDER.models[0], variants(["full", "block_skip"], [2]), settings, done.append)
    assert [row.status for row in rows] == ["ok"] * 3 and sum(done) == settings.steps_per_model(3)
    (model,) = RECORDERS
    # The warm-up, each row's measured step in turn, then three rounds of none, full, block_skip.
    assert model.checkpointed == [0] + [0, 4, 2] + [0, 4, 2] * 3
    assert not checkpointed_blocks(model)  # left plain
    assert all(len(row.step_times_s or []) == 3 for row in rows)
