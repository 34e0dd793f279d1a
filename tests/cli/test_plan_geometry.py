"""Frames and resolution to tokens: each adapter's :class:`VideoGeometry` against its model's own VAE and patching,
the shapes it refuses, and ``ac-core plan --frames/--height/--width/--cp``."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from ac_core.budget import CheckpointPlan
from ac_core.cli import main
from ac_core.errors import AdapterError
from ac_core.registry import get_adapter
from ac_core.spec import VideoGeometry

WAN = VideoGeometry(vae_temporal=4, vae_spatial=8, patch=(1, 2, 2))


def _geometry(adapter: str) -> VideoGeometry:
    geometry = get_adapter(adapter).models[0].geometry
    assert geometry is not None
    return geometry


def test_wan21_at_81_frames_of_720p_is_75600_tokens():
    assert WAN.latent_shape(81, 720, 1280) == (21, 90, 160)
    assert WAN.token_grid(81, 720, 1280) == (21, 45, 80)
    assert WAN.tokens(81, 720, 1280) == 75_600
    assert WAN.tokens(1, 720, 1280) == 3_600  # the first frame alone is one latent frame


@pytest.mark.parametrize(
    ("geometry", "shape", "nearest"),
    [
        (WAN, (82, 720, 1280), "4k + 1 frames, height a multiple of 16 and width of 16; nearest valid: 81 x 720"),
        (WAN, (81, 721, 1000), "nearest valid: 81 x 720 x 1008"),
        (VideoGeometry(4, 8, (1, 2, 2), video=False), (3, 1024, 1024), "1 frame (an image model)"),
        (VideoGeometry(4, 8, (2, 2, 2)), (9, 64, 64), "8k + 5 frames"),
    ],
)
def test_shapes_that_do_not_divide_name_the_nearest_valid_one(geometry, shape, nearest):
    with pytest.raises(ValueError, match="does not divide into tokens") as caught:
        geometry.tokens(*shape)
    assert f"{' x '.join(map(str, shape))} (frames x height x width)" in str(caught.value)
    assert nearest in str(caught.value).replace(" (the VAE's 8x, then 2x2 patches)", "")


def test_bad_geometry_and_sizes_are_refused():
    with pytest.raises(AdapterError, match="ints >= 1"):
        VideoGeometry(0, 8, (1, 2, 2))
    with pytest.raises(AdapterError, match="ints >= 1"):
        VideoGeometry(4, 8, (2, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ints >= 1"):
        WAN.tokens(0, 720, 1280)


def _tiny_vae_latents(vae: torch.nn.Module, video: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return vae.encode(video).latent_dist.mode()  # type: ignore[operator]


def test_wan_geometry_is_the_wan_vae_and_patch_embedding():
    diffusers = pytest.importorskip("diffusers")
    spec = get_adapter("wan").models[0]
    geometry = _geometry("wan")
    torch.manual_seed(0)
    # Wan-VAE's own layout (dim_mult, temperal_downsample: diffusers' defaults, the released config), narrow.
    vae = diffusers.AutoencoderKLWan(base_dim=8, z_dim=4, num_res_blocks=1)
    frames, height, width = 9, 32, 48
    latents = _tiny_vae_latents(vae, torch.randn(1, 3, frames, height, width))
    assert tuple(latents.shape[2:]) == geometry.latent_shape(frames, height, width) == (3, 4, 6)
    model: Any = spec.build_tiny().model  # in_channels 4, the tiny VAE's z_dim
    assert tuple(model.config.patch_size) == geometry.patch
    with torch.no_grad():
        tokens = model.patch_embedding(latents).flatten(2).shape[2]
    assert tokens == geometry.tokens(frames, height, width) == 3 * 2 * 3


def test_hunyuan_geometry_is_the_hunyuan_vae_and_patch_embedding():
    diffusers = pytest.importorskip("diffusers")
    spec = get_adapter("hunyuan").models[0]
    geometry = _geometry("hunyuan")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLHunyuanVideo(
        latent_channels=4, block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4
    )
    frames, height, width = 9, 32, 48
    latents = _tiny_vae_latents(vae, torch.randn(1, 3, frames, height, width))
    assert tuple(latents.shape[2:]) == geometry.latent_shape(frames, height, width) == (3, 4, 6)
    model: Any = spec.build_tiny().model  # in_channels 4
    assert (model.config.patch_size_t, model.config.patch_size, model.config.patch_size) == geometry.patch
    with torch.no_grad():
        tokens = model.x_embedder(latents).shape[1]
    assert tokens == geometry.tokens(frames, height, width)
    assert geometry.tokens(129, 720, 1280) == 33 * 45 * 80


def test_flux_geometry_is_the_flux_vae_and_packing():
    diffusers = pytest.importorskip("diffusers")
    from diffusers.pipelines.flux.pipeline_flux import FluxPipeline

    geometry = _geometry("flux")
    torch.manual_seed(0)
    # FLUX.1's VAE layout: four encoder blocks (8x) and 16 latent channels, narrow.
    vae = diffusers.AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        latent_channels=16,
        norm_num_groups=4,
    )
    height, width = 64, 96
    latents = _tiny_vae_latents(vae, torch.randn(1, 3, height, width))
    assert (1, *latents.shape[2:]) == geometry.latent_shape(1, height, width) == (1, 8, 12)
    packed = FluxPipeline._pack_latents(latents, 1, 16, *latents.shape[2:])
    model = diffusers.FluxTransformer2DModel(
        in_channels=packed.shape[2], num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2
    )
    with torch.no_grad():
        tokens = model.x_embedder(packed).shape[1]
    assert tokens == geometry.tokens(1, height, width) == 24
    assert geometry.tokens(1, 1024, 1024) == 4096  # the preset's default seq


@pytest.mark.parametrize(("adapter", "preset"), [("wan", "wan2.1-14b"), ("hunyuan", "hunyuanvideo")])
def test_the_real_width_presets_patch_as_their_geometry_says(adapter, preset):
    pytest.importorskip("diffusers")
    spec = get_adapter(adapter).models[0]
    with torch.device("meta"):
        config: Any = spec.preset(preset)(layers=1, seq=16).model.config
    patch = config.patch_size if adapter == "wan" else (config.patch_size_t, config.patch_size, config.patch_size)
    assert tuple(patch) == _geometry(adapter).patch and config.in_channels == 16  # the VAEs' 16 latent channels


def test_flux_preset_takes_packed_16_channel_latents():
    pytest.importorskip("diffusers")
    with torch.device("meta"):
        config: Any = get_adapter("flux").models[0].preset("flux.1-dev")(layers=1, seq=16).model.config
    patch = _geometry("flux").patch
    assert config.in_channels == 16 * patch[1] * patch[2]


def test_llama_has_no_geometry():
    pytest.importorskip("transformers")
    assert all(model.geometry is None for model in get_adapter("llama").models)


def test_plan_from_frames_over_cp_ranks_writes_json(tmp_path, capsys):
    """HunyuanVideo declares no context parallelism: one rank is planned at its share of the tokens."""
    pytest.importorskip("diffusers")
    out = tmp_path / "plan.json"
    # 5 frames of 64x128: 2 x 4 x 8 = 64 tokens, 32 per rank: the grid with its width halved, 2 x 4 x 4.
    args = ["plan", "hunyuan", "--preset", "hunyuanvideo", "--layers", "1", "--frames", "5", "--height", "64"]
    assert main([*args, "--width", "128", "--cp", "2", "--budget", "0.5", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "5 frames of 64x128: 2 x 4 x 8 = 64 tokens, 32 per rank over cp 2 (2 x 4 x 4)" in printed
    assert "adapter hunyuan declares no context parallelism: one rank planned at the tokens divided" in printed
    plan = CheckpointPlan.from_json(out.read_text())
    assert dict((name, shape) for name, shape, _ in plan.inputs)["hidden_states"] == (1, 16, 2, 8, 8)
    assert json.loads(out.read_text())


@pytest.mark.parametrize(
    ("adapter", "flags", "message"),
    [
        ("llama", ["--preset", "llama-3-8b", "--frames", "81"], "takes tokens, not frames: --frames size video"),
        ("wan", ["--preset", "wan2.1-14b", "--frames", "81", "--height", "720"], "need --width too"),
        ("wan", ["--preset", "wan2.1-14b", "--frames", "82", "--height", "720", "--width", "1280"], "81 x 720"),
        ("wan", ["--preset", "wan2.1-14b", "--seq", "100", "--frames", "81"], "either --seq or --frames"),
        ("wan", ["--frames", "81", "--height", "720", "--width", "1280"], "tiny preset has a fixed config"),
        ("wan", ["--preset", "wan2.1-14b", "--cp", "2"], "--cp 2 splits the tokens over ranks: give --seq"),
        ("wan", ["--preset", "wan2.1-14b", "--seq", "75600", "--cp", "11"], "cp values that divide them"),
        ("flux", ["--preset", "flux.1-dev", "--frames", "2", "--height", "1024", "--width", "1024"], "1 frame"),
    ],
)
def test_bad_shapes_and_flags_name_the_fix(adapter, flags, message, capsys):
    pytest.importorskip("transformers" if adapter == "llama" else "diffusers")
    assert main(["plan", adapter, *flags, "--budget", "0.5"]) == 2
    assert message in capsys.readouterr().err


def test_flux_frames_default_to_one_image(capsys):
    pytest.importorskip("diffusers")
    args = ["plan", "flux", "--preset", "flux.1-dev", "--layers", "1", "--height", "64", "--width", "64"]
    assert main([*args, "--budget", "0.5"]) == 0
    assert "one frame of 64x64: 1 x 4 x 4 = 16 tokens" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--budget", "0.5", "--memory", "80GiB"], "are two budgets: give one"),
        (["--budget", "0.5", "--fsdp", "8"], "--fsdp: only for a step budget; give --memory or --gpu"),
        (["--optimizer", "sgd"], "give --memory (a whole step's peak on one rank"),
        (["--gpu", "h999"], "--gpu: unknown device 'h999'; known: h100-sxm"),
    ],
)
def test_step_budget_flags_that_do_not_go_together_name_the_fix(flags, message, capsys):
    assert main(["plan", "toy", *flags]) == 2
    assert message in capsys.readouterr().err


def test_memory_is_a_size_not_a_fraction(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "toy", "--memory", "0.5"])
    assert "a fraction of 'none' is --budget's" in capsys.readouterr().err


def test_step_budget_plan_prints_the_peak_and_its_neighbours_and_keeps_the_budget(tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = ["plan", "toy", "--device", "cpu", "--gpu", "h100", "--memory", "1GiB", "--fsdp", "2"]
    assert main([*args, "--optimizer", "sgd", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "step peak" in printed and "of 1.00 GiB: params" in printed
    assert "fits 4 blocks, 0 checkpointed, at +0.0% predicted step time" in printed
    assert "at 896.00 MiB it would need" in printed and "at 1.12 GiB it would need" in printed
    plan = CheckpointPlan.from_json(out.read_text())
    assert plan.step_budget is not None
    assert (plan.step_budget.memory, plan.step_budget.device, plan.step_budget.fsdp) == ("1GiB", "h100", 2)
    assert plan.step_budget.optimizer == "sgd"


def _planned_latents(plan: CheckpointPlan) -> tuple[int, ...]:
    return dict((name, shape) for name, shape, _ in plan.inputs)["hidden_states"]


@pytest.mark.parametrize(("cp", "rank_grid"), [(2, (3, 4, 4)), (4, (3, 4, 2)), (3, (1, 4, 8))])
def test_the_planned_input_is_exactly_the_tokens_per_rank(cp, rank_grid, tmp_path, capsys):
    """9 frames of 64x128 are 3 x 4 x 8 = 96 tokens; laid out as whole 30x52 frames, 48 per rank would be 50.
    (HunyuanVideo: no context parallelism declared, so one rank's share is built.)"""
    pytest.importorskip("diffusers")
    out = tmp_path / "plan.json"
    args = ["plan", "hunyuan", "--preset", "hunyuanvideo", "--layers", "1", "--frames", "9", "--height", "64"]
    args += ["--width", "128"]
    assert main([*args, "--cp", str(cp), "--budget", "0.5", "--json", str(out)]) == 0
    assert f"{96 // cp} per rank over cp {cp} ({' x '.join(map(str, rank_grid))})" in capsys.readouterr().out
    _, channels, frames, height, width = _planned_latents(CheckpointPlan.from_json(out.read_text()))
    assert channels == 16 and (frames, height // 2, width // 2) == rank_grid  # 2x2 patches
    assert frames * (height // 2) * (width // 2) == 96 // cp


def test_a_cp_that_divides_the_tokens_but_no_axis_names_the_grid(capsys):
    pytest.importorskip("diffusers")
    # 9 frames of 48x80: 3 x 3 x 5 = 45 tokens; 9 divides 45 but none of 3, 3, 5.
    args = ["plan", "wan", "--preset", "wan2.1-1.3b", "--frames", "9", "--height", "48", "--width", "80"]
    assert main([*args, "--cp", "9", "--budget", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "--cp 9: the 3 x 3 x 5 token grid (frames x height x width) has no axis that 9 divides" in err
    assert "cp values that divide an axis (up to 64): 1, 3, 5" in err


@pytest.mark.parametrize(("adapter", "seq", "grid"), [("wan", 100, (1, 2, 3)), ("flux", None, (2, 4, 4))])
def test_presets_refuse_seq_and_grid_together_and_a_bad_grid(adapter, seq, grid):
    pytest.importorskip("diffusers")
    spec = get_adapter(adapter).models[0]
    preset = next(iter(spec.presets))
    with pytest.raises(ValueError, match="not both" if seq is not None else "one frame"), torch.device("meta"):
        spec.preset(preset)(layers=1, seq=seq, grid=grid)


def test_the_flux_preset_builds_its_grid_exactly():
    pytest.importorskip("diffusers")
    with torch.device("meta"):
        case = get_adapter("flux").models[0].preset("flux.1-dev")(layers=1, grid=(1, 3, 5))
    assert tuple(case.inputs["hidden_states"].shape[:2]) == (1, 15) and tuple(case.inputs["img_ids"].shape) == (15, 3)


@pytest.mark.parametrize(
    ("adapter", "preset", "depth"),
    [
        ("wan", "wan2.1-1.3b", {"layers": 30}),
        ("wan", "wan2.1-14b", {"layers": 40}),
        ("hunyuan", "hunyuanvideo", {"layers": 20, "single_layers": 40}),
        ("flux", "flux.1-dev", {"layers": 19, "single_layers": 38}),
        ("llama", "llama-3-8b", {"layers": 32, "vocab": 128256}),
    ],
)
def test_each_preset_records_its_real_depth(adapter, preset, depth):
    spec = next(m for m in get_adapter(adapter).models if preset in m.presets)
    assert dict(spec.depths[preset]) == depth


def test_model_spec_refuses_a_depth_of_no_preset():
    from ac_core.spec import ModelSpec

    with pytest.raises(AdapterError, match=r"depths\['big'\] must name one of its presets"):
        ModelSpec(cls="pkg.Model", containers=("blocks",), depths={"big": {"layers": 4}})


_WAN_SMALL = ["--preset", "wan2.1-1.3b", "--frames", "1", "--height", "32", "--width", "32"]


def test_a_step_budget_without_layers_plans_the_real_depth_and_says_none_fits_once(caplog, capsys):
    pytest.importorskip("diffusers")
    with caplog.at_level("WARNING", logger="ac_core"):
        assert main(["plan", "wan", *_WAN_SMALL, "--gpu", "h100", "--memory", "80GiB"]) == 0
    printed = capsys.readouterr().out
    assert "WanTransformer3DModel at wan2.1-1.3b: 30 blocks (wan2.1-1.3b's depth); one frame of 32x32" in printed
    assert "fits 30 blocks, 0 checkpointed" in printed
    said = [r.getMessage() for r in caplog.records if "none's predicted peak" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("ac-core: the step budget 80.00 GiB fits none's predicted peak of ")
    assert said[0].endswith(": the plan checkpoints no block")
    assert not any("is at or above what 'none' holds" in r.getMessage() for r in caplog.records)


def test_layers_overrides_the_real_depth_and_a_held_budget_keeps_the_preset_default(capsys):
    pytest.importorskip("diffusers")
    assert main(["plan", "wan", *_WAN_SMALL, "--layers", "2", "--gpu", "h100", "--memory", "80GiB"]) == 0
    printed = capsys.readouterr().out
    assert "fits 2 blocks" in printed and "depth" not in printed.splitlines()[0]
    assert main(["plan", "wan", *_WAN_SMALL, "--budget", "0.5"]) == 0
    assert "blocks.3 " in capsys.readouterr().out  # the preset's 4 blocks: a held budget counts no model states


def test_the_step_planner_says_none_fits_in_the_step_budgets_terms(caplog):
    from ac_core import StepBudget, plan_activation_checkpointing
    from ac_core.testing import TOY_ADAPTER, toy_wide

    case = toy_wide(layers=2, seq=8)
    with caplog.at_level("WARNING", logger="ac_core"):
        plan_activation_checkpointing(case.model, dict(case.inputs), StepBudget("1GiB"), adapter=TOY_ADAPTER)
    messages = [r.getMessage() for r in caplog.records]
    assert [m for m in messages if "none's predicted peak" in m] == [
        next(m for m in messages if m.startswith("ac-core: the step budget 1.00 GiB fits none's predicted peak of"))
    ]
    assert not any("is at or above" in m for m in messages)
