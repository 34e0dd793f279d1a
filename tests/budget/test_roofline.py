"""The device table, the roofline of an op occurrence, the bytes the profiler records, and ``ac-core calibrate``."""

from __future__ import annotations

import json
import re

import pytest
import torch

from ac_core.blocks import resolve_blocks
from ac_core.budget import OpOccurrence, profile_model
from ac_core.budget.devices import CALIBRATION_ENV, DEVICES, Device, device, device_for, save_calibration
from ac_core.budget.profile import _OpRecorder
from ac_core.budget.roofline import link_bytes, op_time, transfer_seconds
from ac_core.cli import main
from ac_core.measure.flops import GlobalFlopCounter
from ac_core.testing import toy_case

TABLE = ["h100-sxm", "h100-pcie", "h200", "a100-40gb", "a100-80gb", "b200", "l40s", "rtx4090"]


def test_the_table_has_every_device_with_positive_figures():
    assert sorted(DEVICES) == sorted(TABLE)
    for name, entry in DEVICES.items():
        assert entry.name == name
        assert entry.peak_flops(torch.float32) > 0 and entry.peak_flops(torch.bfloat16) > 0
        assert entry.peak_flops(torch.float16) > 0
        assert entry.memory_bandwidth > 0 and entry.host_link > 0 and entry.memory > 0
        assert entry.bfloat16 >= entry.float32


def test_figures_match_the_datasheets():
    h100 = device("h100")
    assert h100 is DEVICES["h100-sxm"]
    assert h100.peak_flops("bfloat16") == pytest.approx(989e12, rel=0.01)
    assert h100.peak_flops(torch.float8_e4m3fn) == pytest.approx(1979e12, rel=0.01)
    assert h100.memory_bandwidth == pytest.approx(3.35e12)
    assert device("h200").memory_bandwidth == pytest.approx(4.8e12)
    assert device("a100") is DEVICES["a100-80gb"]
    assert device("A100-40GB").memory_bandwidth == pytest.approx(1.555e12)
    assert device("a100").float8 is None
    with pytest.raises(ValueError, match="a100-80gb has no peak rate for float8; it has float32, tf32"):
        device("a100").peak_flops(torch.float8_e5m2)


def test_an_unknown_device_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown device 'h300'") as info:
        device("h300")
    assert all(name in str(info.value) for name in [*TABLE, "h100", "a100", "cpu"])


def test_a_cuda_device_is_found_by_its_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda where=None: "NVIDIA H100 80GB HBM3")
    assert device_for(torch.device("cuda", 0)) is DEVICES["h100-sxm"]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda where=None: "NVIDIA Tesla T4")
    with pytest.raises(ValueError, match=r"'NVIDIA Tesla T4' is not in .*pass a device name .*ac-core calibrate"):
        device_for("cuda")


def test_a_matmul_is_compute_bound_and_an_add_memory_bound_on_h100():
    h100 = device("h100")
    m = k = n = 4096
    matmul = OpOccurrence("aten::mm", 0, 2 * m * n, 2 * m * k * n, 2 * (m * k + k * n + m * n), "bfloat16")
    timed = op_time(matmul, h100)
    assert timed.bound == "compute"
    assert timed.seconds == timed.compute == 2 * m * k * n / 989.4e12
    assert timed.memory == 2 * (m * k + k * n + m * n) / 3.35e12

    elements = 2**24
    add = OpOccurrence("aten::add", 0, 2 * elements, elements, 3 * 2 * elements, "bfloat16")
    timed = op_time(add, h100)
    assert timed.bound == "memory"
    assert timed.seconds == timed.memory == 3 * 2 * elements / 3.35e12
    assert timed.compute == elements / 989.4e12
    assert transfer_seconds(2**30, h100) == 2**30 / 64e9


def test_the_interconnect_is_nvlink_each_way_where_the_card_has_it_else_pcie():
    assert device("h100").interconnect == device("h200").interconnect == 450e9  # NVLink 900 GB/s both ways
    assert device("a100").interconnect == device("a100-40gb").interconnect == 300e9  # NVLink 600 GB/s
    assert device("b200").interconnect == 900e9  # NVLink 1.8 TB/s
    for pcie in ("h100-pcie", "l40s", "rtx4090"):
        assert device(pcie).interconnect == device(pcie).host_link
    # Figures without the field (a calibration file written before it): 10 Gb Ethernet, the CPU's.
    assert Device("old", 1e12, 1e12, None, 1e11, 1e10, 2**30).interconnect == 1.25e9


def test_a_collective_takes_what_one_rank_sends_or_receives_over_the_interconnect():
    h100 = device("h100")
    n = 2**20  # output bytes
    all_to_all = OpOccurrence("_c10d_functional::all_to_all_single", 0, n, 0, 2 * n, "bfloat16", ranks=4)
    gather = OpOccurrence("_c10d_functional::all_gather_into_tensor", 0, n, 0, n + n // 4, "bfloat16", ranks=4)
    scatter = OpOccurrence("_c10d_functional::reduce_scatter_tensor", 0, n, 0, n + 4 * n, "bfloat16", ranks=4)
    wait = OpOccurrence("_c10d_functional::wait_tensor", 0, 0, 0, n, "bfloat16")
    assert [link_bytes(op) for op in (all_to_all, gather, scatter, wait)] == [3 * n // 4, 3 * n // 4, 3 * n, 0]
    timed = op_time(all_to_all, h100)
    assert (timed.bound, timed.seconds, timed.compute, timed.memory) == ("link", 3 * n / 4 / 450e9, 0.0, 0.0)
    assert op_time(wait, h100).seconds == 0.0
    alone = OpOccurrence("_c10d_functional::all_to_all_single", 0, n, 0, 2 * n, "bfloat16", ranks=1)
    assert op_time(alone, h100).seconds == 0.0  # a group of one moves nothing


def _recorded(run) -> list[OpOccurrence]:
    counter = GlobalFlopCounter()
    recorder = _OpRecorder(counter)
    with counter, recorder:
        run()
    return recorder.ops


def test_bytes_moved_and_dtype_are_recorded():
    n = 1000
    a, b = torch.randn(n), torch.randn(n)
    [add] = _recorded(lambda: torch.add(a, b))
    assert (add.op, add.bytes_moved, add.dtype, add.nbytes) == ("aten::add.Tensor", 3 * 4 * n, "float32", 4 * n)

    m, k, n = 8, 16, 32
    x, w = torch.randn(m, k), torch.randn(k, n)
    [mm] = _recorded(lambda: x @ w)
    assert (mm.bytes_moved, mm.flops, mm.dtype) == (4 * (m * k + k * n + m * n), 2 * m * k * n, "float32")

    h = torch.randn(n, dtype=torch.bfloat16)
    view, inplace, count = _recorded(lambda: (h.view(2, -1).mul_(2), torch.argmax(h)))
    assert view.bytes_moved == 0  # an alias reads and writes nothing
    assert (inplace.bytes_moved, inplace.dtype) == (2 * 2 * n, "bfloat16")  # read once, written once
    assert count.dtype is None


def test_a_block_predicts_the_seconds_of_what_it_recomputes():
    case = toy_case()
    profile = profile_model(resolve_blocks(case.model, None, ["layers"]), case.inputs)
    h100 = device("h100")
    for _, block in profile.blocks:
        assert block.recomputed and sum(op.flops for op in block.recomputed) == block.recompute_flops
        assert block.recompute_seconds(h100) == sum(op_time(op, h100).seconds for op in block.recomputed) > 0
        assert {op.dtype for op in block.recomputed if op.flops} == {"float32"}


CPU = Device("cpu", 1e11, 2e11, None, 1e10, 1e10, 2**34)


def test_the_calibration_round_trips_through_device_cpu(tmp_path, monkeypatch):
    path = tmp_path / "calibration.json"
    monkeypatch.setenv(CALIBRATION_ENV, str(path))
    with pytest.raises(ValueError, match=f"{CALIBRATION_ENV}=.* does not exist"):
        device("cpu")
    assert save_calibration(CPU) == path
    assert device("cpu") == CPU
    with pytest.raises(ValueError, match="cpu has no peak rate for float16; it has float32, bfloat16"):
        device("cpu").peak_flops(torch.float16)


def test_calibrate_prints_and_writes_the_figures(tmp_path, monkeypatch, capsys):
    path = tmp_path / "figures.json"
    monkeypatch.setenv(CALIBRATION_ENV, str(path))
    assert main(["calibrate", "--seconds", "0"]) == 0
    out = capsys.readouterr().out
    for figure in ("float32 matmul", "bfloat16 matmul", "copy"):
        assert re.search(rf"{figure} +\d+\.\d+ G", out), out
    assert f"wrote {path}" in out
    measured = device("cpu")
    assert measured.float32 > 0 and measured.bfloat16 > 0 and measured.memory_bandwidth > 0
    assert json.loads(path.read_text())["cpu"]["float32"] == measured.float32
