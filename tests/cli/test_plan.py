"""``ac-core plan``: a memory-budget plan made on the meta device, printed and written as JSON."""

from __future__ import annotations

import pytest
import torch

from ac_core.budget import CheckpointPlan, plan_activation_checkpointing
from ac_core.cli import main
from ac_core.cli.plan import make_plan
from ac_core.registry import get_adapter
from ac_core.testing import TOY_ADAPTER, toy_case


def test_toy_plan_on_meta_is_the_plan_on_real_tensors(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "toy", "--budget", "0.5", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    plan = CheckpointPlan.from_json(out.read_text())
    assert f"CheckpointPlan {plan.fingerprint}" in printed and "layers.3" in printed
    assert "planned on meta" in printed and f"wrote {out}" in printed
    case = toy_case()
    assert plan == plan_activation_checkpointing(case.model, case.inputs, 0.5, adapter=TOY_ADAPTER)


def test_preset_sized_and_cast_on_meta_and_real():
    model = TOY_ADAPTER.models[0]
    meta = make_plan(TOY_ADAPTER, model, "toy-wide", "1MiB", layers=2, seq=64, device="meta")
    real = make_plan(TOY_ADAPTER, model, "toy-wide", "1MiB", layers=2, seq=64, device="cpu")
    assert meta == real and len(meta.blocks) == 2
    assert meta.held_bytes <= meta.budget_bytes == 2**20
    # (In bfloat16 a CPU run keeps layer-norm statistics in bfloat16 where meta, as CUDA, keeps float32: a few
    # bytes per token per norm apart, so the exact match is checked in float32.)
    half = make_plan(TOY_ADAPTER, model, "toy-wide", 0.5, layers=2, seq=64, dtype=torch.bfloat16)
    assert half.inputs == (("x", (1, 64, 1024), "torch.bfloat16"),)
    assert half.none_bytes < meta.none_bytes


def test_wan_tiny_meta_plan_matches_real():
    # diffusers calls SDPA by keyword: on meta it must still take the CPU flash kernel, as a real run does.
    pytest.importorskip("diffusers")
    wan = get_adapter("wan")
    meta = make_plan(wan, wan.models[0], "tiny", 0.4, device="meta")
    real = make_plan(wan, wan.models[0], "tiny", 0.4, device="cpu")
    assert meta == real
    assert any("flash_attention" in op for block in meta.blocks for op, _ in block.keep)


def test_bad_budgets_and_flags(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["plan", "toy", "--budget", "lots"])
    assert "not a size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "toy", "--budget", "1.5"])
    assert "0 < f <= 1" in capsys.readouterr().err
    assert main(["plan", "toy", "--budget", "1000"]) == 2
    assert "least any plan holds" in capsys.readouterr().err
    assert main(["plan", "toy", "--preset", "nope", "--budget", "0.5"]) == 2
    assert "toy-wide" in capsys.readouterr().err
    assert main(["plan", "toy", "--budget", "0.5", "--layers", "2"]) == 2
    assert "tiny preset has a fixed config" in capsys.readouterr().err
    assert main(["plan", "toy", "--budget", "0.5", "--json", str(tmp_path / "no" / "p.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_offload_flag_moves_block_inputs_to_the_host(tmp_path, capsys):
    # At 64k tokens a toy-wide block's input is 256 MiB: eight of them outweigh offload's default window (1 GiB
    # of copies in flight, 512 MiB prefetched), so offload brings the least possible under what 2 GiB allows.
    out = tmp_path / "plan.json"
    args = ["plan", "toy", "--preset", "toy-wide", "--layers", "8", "--seq", "65536", "--budget", "2GiB"]
    assert main(args) == 2
    assert "least any plan holds" in capsys.readouterr().err
    assert main([*args, "--offload", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    plan = CheckpointPlan.from_json(out.read_text())
    assert plan.offload is not None and all(b.offload for b in plan.blocks)
    assert plan.device_bytes <= plan.budget_bytes == 2 * 2**30
    assert "host 256.00 MiB" in printed and "counted in the budget" in printed
