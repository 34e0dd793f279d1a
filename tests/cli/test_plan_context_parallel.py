"""``ac-core plan --cp``: rank 0 of a context-parallel model planned on stand-in ranks (torch's fake process group),
its collectives profiled, kept and priced; one rank at the tokens divided where the adapter declares no way to run
context parallel; the stand-in group never outlives the command."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.distributed as dist

from ac_core import ModelCase, register_adapter, resolve_blocks
from ac_core.budget import CheckpointPlan, profile_model
from ac_core.budget.profile import OpOccurrence
from ac_core.cli import main
from ac_core.cli.context_parallel import planned_rank
from ac_core.registry import unregister_adapter
from ac_core.testing import TOY_ADAPTER, TOY_CONTEXT_PARALLEL, toy_wide

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built")

ALL_TO_ALL = "_c10d_functional::all_to_all_single"
ATTENTION = "aten::_scaled_dot_product_flash_attention_for_cpu"
TOY = ["plan", "toy", "--preset", "toy-wide", "--layers", "1", "--seq", "256"]


def _toy(whole: bool) -> ModelCase:
    with torch.device("meta"):
        return toy_wide(layers=1, seq=256 if whole else 128)


def _block_ops(mode: str | None) -> list[OpOccurrence]:
    """The first block's ops as rank 0 runs them under ``mode``, or (None) at one rank's share of the tokens."""
    with planned_rank(TOY_ADAPTER, mode, 2, _toy) as rank:
        case = rank.case
        profile = profile_model(resolve_blocks(case.model, TOY_ADAPTER, None), dict(case.inputs))
    return list(profile.blocks[0][1].forward)


def test_a_rank_is_profiled_with_its_all_to_alls_and_attention_over_the_whole_sequence():
    """Rank 0 of Ulysses over 2 (the toy: 16 heads of 64, width 1024, 256 tokens, float32): q, k, v and the output
    each go through one all-to-all of this rank's 128 tokens (512 KiB), and attention runs over all 256 tokens
    with 8 heads: half the unsplit model's FLOPs, twice those of a model built at 128 tokens."""
    ulysses = _block_ops("ulysses")
    exchanged = [op for op in ulysses if op.op == ALL_TO_ALL]
    assert [(op.nbytes, op.ranks, op.moves_parameters) for op in exchanged] == [(128 * 1024 * 4, 2, False)] * 4
    attention = next(op for op in ulysses if op.op == ATTENTION)
    assert attention.flops == 4 * 8 * 256 * 256 * 64
    divided = next(op for op in _block_ops(None) if op.op == ATTENTION)
    assert attention.flops == 2 * divided.flops
    assert not dist.is_initialized()


def test_the_ring_gathers_every_key_and_value_on_each_rank():
    ring = _block_ops("ring")
    gathered = [op for op in ring if op.op == "_c10d_functional::all_gather_into_tensor"]
    # k and v of this rank's 128 tokens, stacked, from both ranks: 2 x 2 x 128 x 1024 float32.
    assert [(op.nbytes, op.ranks) for op in gathered] == [(2 * 2 * 128 * 1024 * 4, 2)]
    assert sum(op.op == ATTENTION for op in ring) == 2  # one kernel call per rank's chunk of keys


def test_a_plan_over_a_slow_link_keeps_the_all_to_alls(tmp_path, capsys):
    """On PCIe (rtx4090: 32 GB/s between GPUs) an all-to-all of 512 KiB takes 8 us: the plan keeps all four."""
    out = tmp_path / "plan.json"
    assert main([*TOY, "--cp", "2", "--budget", "0.9", "--gpu", "rtx4090", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "256 tokens, 128 per rank over cp 2; rank 0 of 2 planned under ulysses on stand-in ranks" in printed
    keep = {tuple(op) for op in json.loads(out.read_text())["blocks"][0]["keep"]}
    assert {(ALL_TO_ALL, index) for index in range(4)} <= keep
    assert dict((name, shape) for name, shape, _ in CheckpointPlan.from_json(out.read_text()).inputs)["x"] == (
        1,
        128,
        1024,
    )
    assert not dist.is_initialized()


def test_wan_plans_its_whole_video_under_diffusers_ulysses(tmp_path, capsys):
    """diffusers splits Wan's sequence in its own hooks: the plan's input is the whole video, as the model is called
    in a context-parallel run, and the rank's share is said without a grid of its own."""
    pytest.importorskip("diffusers")
    out = tmp_path / "plan.json"
    args = ["plan", "wan", "--preset", "wan2.1-1.3b", "--layers", "1", "--frames", "5", "--height", "64"]
    assert main([*args, "--width", "128", "--cp", "2", "--gpu", "rtx4090", "--budget", "0.9", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "2 x 4 x 8 = 64 tokens, 32 per rank over cp 2; rank 0 of 2 planned under ulysses" in printed
    plan = CheckpointPlan.from_json(out.read_text())
    assert dict((name, shape) for name, shape, _ in plan.inputs)["hidden_states"] == (
        1,
        16,
        2,
        8,
        16,
    )  # 2 latent frames, not split
    keep = {tuple(op) for op in json.loads(out.read_text())["blocks"][0]["keep"]}
    assert any(op == ALL_TO_ALL for op, _ in keep)
    assert not dist.is_initialized()


def test_the_stand_in_group_is_destroyed_when_planning_fails(capsys):
    assert main([*TOY, "--cp", "2", "--budget", "1"]) == 2  # one byte: below the least any plan holds
    assert "least" in capsys.readouterr().err
    assert not dist.is_initialized()


def test_a_process_group_of_the_callers_is_refused_and_left_alone(capsys):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        assert main([*TOY, "--cp", "2", "--budget", "0.5"]) == 2
        assert "run ac-core plan outside torch.distributed" in capsys.readouterr().err
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--cp-mode", "ring"], "--cp-mode ring: a mode of context parallelism needs ranks: give --cp 2 or more"),
        (["--cp", "2", "--cp-mode", "zigzag"], "--cp-mode zigzag: adapter toy runs context parallel as ulysses, ring"),
    ],
)
def test_bad_modes_name_the_fix(flags, message, capsys):
    assert main([*TOY, *flags, "--budget", "0.5"]) == 2
    assert message in capsys.readouterr().err


def test_measure_refuses_ranks(capsys):
    args = [*TOY, "--device", "cpu", "--memory", "1GiB", "--cp", "2", "--measure"]
    assert main(args) == 2
    assert "--measure with --cp 2: one process cannot run a context-parallel step" in capsys.readouterr().err


def test_a_mode_for_an_adapter_without_context_parallelism_names_the_fix(capsys):
    pytest.importorskip("diffusers")
    args = ["plan", "hunyuan", "--preset", "hunyuanvideo", "--layers", "1", "--seq", "64", "--cp", "2"]
    assert main([*args, "--cp-mode", "ulysses", "--budget", "0.5"]) == 2
    assert "adapter hunyuan declares no context parallelism; leave --cp-mode out" in capsys.readouterr().err


def test_a_model_the_declaration_excludes_plans_one_rank_at_its_share(capsys):
    declined = dataclasses.replace(TOY_CONTEXT_PARALLEL, unsupported=lambda model: "the toy declines")
    register_adapter(dataclasses.replace(TOY_ADAPTER, name="declining", context_parallel=declined))
    try:
        args = ["plan", "declining", "--preset", "toy-wide", "--layers", "1", "--seq", "256", "--cp", "2"]
        assert main([*args, "--budget", "0.5"]) == 0
    finally:
        unregister_adapter("declining")
    printed = capsys.readouterr().out
    assert "the toy declines: one rank planned at the tokens divided, without its collectives" in printed
    assert not dist.is_initialized()
