"""The accelerators a plan can be costed on: peak dense FLOP/s per dtype, memory, host-link and interconnect
bandwidth, memory.

:data:`DEVICES` holds vendor datasheet figures (dense tensor-core rates: a datasheet's 2:4 sparsity figure
halved). ``cpu`` is not in the table: its figures are measured, by ``ac-core calibrate`` (see :func:`calibrate`),
which writes them where :func:`device` reads them (``$AC_CORE_CALIBRATION``, else
``~/.cache/ac-core/calibration.json``). Bandwidths count the bytes an op reads plus those it writes, as the
roofline does (see :mod:`.roofline`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

CALIBRATION_ENV = "AC_CORE_CALIBRATION"
_GiB = 2**30


# 10 Gb Ethernet, one direction: the interconnect of the CPU (gloo between hosts) and of figures that give none (a
# calibration file written before the field): a conservative link, so that a plan keeps a collective's output
# rather than betting on a fast network.
_ETHERNET_10G = 1.25e9


@dataclass(frozen=True)
class Device:
    """One device's peak rates: FLOP/s per dtype (``None``: no such rate, or not measured), memory bandwidth, host
    link and ``interconnect`` (to the other ranks' devices: NVLink where the card has it, else its PCIe link) in
    bytes/s (one direction), memory in bytes."""

    name: str
    float32: float
    bfloat16: float
    float16: float | None
    memory_bandwidth: float
    host_link: float
    memory: int
    tf32: float | None = None
    float8: float | None = None
    interconnect: float = _ETHERNET_10G

    def peak_flops(self, dtype: torch.dtype | str | None) -> float:
        """The peak FLOP/s for ``dtype`` (a torch dtype or its name, ``"tf32"``); ``None``: float32's. A float32
        op gets the float32 rate, as torch's default matmul precision runs it (no TF32)."""
        key = str(dtype).removeprefix("torch.") if dtype is not None else "float32"
        if key.startswith("float8"):
            key = "float8"
        rate = getattr(self, key) if key in _RATES else None
        if rate is None:
            known = [name for name in _RATES if getattr(self, name) is not None]
            raise ValueError(f"{self.name} has no peak rate for {key}; it has {', '.join(known)}")
        return float(rate)


_RATES = ("float32", "tf32", "bfloat16", "float16", "float8")

# Figures: "FP32" is the non-tensor rate; tensor-core rates are dense (a sparsity-only figure halved). Host link:
# a PCIe x16 link each way (datasheets give both directions summed). Memory: a datasheet's GB read as GiB, as
# the cards report it (an 80 GB A100: 81,920 MiB).
_PCIE_GEN5 = 64e9  # H100 and H200 datasheets: PCIe Gen5 128 GB/s, both directions
_PCIE_GEN4 = 32e9  # A100 and L40S datasheets, PCIe Gen4: 64 GB/s both directions
# Interconnect: NVLink each way (datasheets give both directions summed), else the card's PCIe link: the H100 PCIe's
# NVLink bridge (600 GB/s) pairs two cards only, and the L40S and RTX 4090 have no NVLink.
_INTERCONNECTS = {
    "h100-sxm": 450e9,  # H100 datasheet, SXM: NVLink 900 GB/s
    "h100-pcie": _PCIE_GEN5,
    "h200": 450e9,  # H200 datasheet, SXM: NVLink 900 GB/s
    "a100-40gb": 300e9,  # A100 datasheet, SXM: NVLink 600 GB/s
    "a100-80gb": 300e9,
    "b200": 900e9,  # HGX B200 datasheet: fifth-generation NVLink, 1.8 TB/s per GPU
    "l40s": _PCIE_GEN4,
    "rtx4090": _PCIE_GEN4,
}

_DATASHEETS: dict[str, Device] = {
    # NVIDIA H100 Tensor Core GPU datasheet, SXM column: FP32 67 TF; TF32 989, BF16 and FP16 1,979, FP8 3,958 TF
    # with sparsity; HBM3 80 GB at 3.35 TB/s.
    "h100-sxm": Device(
        "h100-sxm", 67e12, 989.4e12, 989.4e12, 3.35e12, _PCIE_GEN5, 80 * _GiB, tf32=494.7e12, float8=1978.9e12
    ),
    # Same datasheet, PCIe column: FP32 51 TF; TF32 756, BF16 and FP16 1,513, FP8 3,026 TF with sparsity; HBM2e
    # 80 GB at 2 TB/s.
    "h100-pcie": Device(
        "h100-pcie", 51e12, 756.5e12, 756.5e12, 2.0e12, _PCIE_GEN5, 80 * _GiB, tf32=378e12, float8=1513e12
    ),
    # NVIDIA H200 Tensor Core GPU datasheet, SXM: Hopper's rates as the H100 SXM's; HBM3e 141 GB at 4.8 TB/s;
    # PCIe Gen5 128 GB/s both directions.
    "h200": Device("h200", 67e12, 989.4e12, 989.4e12, 4.8e12, _PCIE_GEN5, 141 * _GiB, tf32=494.7e12, float8=1978.9e12),
    # NVIDIA A100 Tensor Core GPU datasheet, 40GB SXM column: FP32 19.5 TF; TF32 156, BF16 and FP16 312 TF dense
    # (no FP8); HBM2 at 1,555 GB/s.
    "a100-40gb": Device("a100-40gb", 19.5e12, 312e12, 312e12, 1.555e12, _PCIE_GEN4, 40 * _GiB, tf32=156e12),
    # Same datasheet, 80GB SXM column: the same rates; HBM2e at 2,039 GB/s.
    "a100-80gb": Device("a100-80gb", 19.5e12, 312e12, 312e12, 2.039e12, _PCIE_GEN4, 80 * _GiB, tf32=156e12),
    # NVIDIA HGX B200 datasheet (8 GPUs; per GPU here): TF32 18, BF16 and FP16 36, FP8 72 PF with sparsity for
    # eight; HBM3e 1,440 GB at 64 TB/s for eight. FP32 80 TF: NVIDIA's Blackwell figures for the HGX B200 at
    # 1,000 W. Host link: the HGX board's x86 hosts, PCIe Gen5 x16.
    "b200": Device("b200", 80e12, 2.25e15, 2.25e15, 8.0e12, _PCIE_GEN5, 180 * _GiB, tf32=1.125e15, float8=4.5e15),
    # NVIDIA L40S datasheet: FP32 91.6 TF; dense TF32 183, BF16 and FP16 362.05, FP8 733 TF; GDDR6 48 GB at
    # 864 GB/s; PCIe Gen4 x16 64 GB/s both directions.
    "l40s": Device("l40s", 91.6e12, 362.05e12, 362.05e12, 864e9, _PCIE_GEN4, 48 * _GiB, tf32=183e12, float8=733e12),
    # NVIDIA Ada Lovelace GPU architecture whitepaper, GeForce RTX 4090: FP32 82.6 TF; dense tensor rates with FP32
    # accumulate (what torch's matmuls use): TF32 82.6, BF16 and FP16 165.2, FP8 330.3 TF; GDDR6X 24 GB at
    # 1,008 GB/s; PCIe Gen4 x16.
    "rtx4090": Device(
        "rtx4090", 82.6e12, 165.2e12, 165.2e12, 1.008e12, _PCIE_GEN4, 24 * _GiB, tf32=82.6e12, float8=330.3e12
    ),
}

DEVICES: dict[str, Device] = {
    name: dataclasses.replace(figures, interconnect=_INTERCONNECTS[name]) for name, figures in _DATASHEETS.items()
}

_ALIASES = {"h100": "h100-sxm", "a100": "a100-80gb"}

# torch.cuda.get_device_name() of each table entry (the A100 40GB PCIe card has the 40GB SXM's figures).
_CUDA_NAMES = {
    "NVIDIA H100 80GB HBM3": "h100-sxm",
    "NVIDIA H100 PCIe": "h100-pcie",
    "NVIDIA H200": "h200",
    "NVIDIA A100-SXM4-40GB": "a100-40gb",
    "NVIDIA A100-PCIE-40GB": "a100-40gb",
    "NVIDIA A100-SXM4-80GB": "a100-80gb",
    "NVIDIA B200": "b200",
    "NVIDIA L40S": "l40s",
    "NVIDIA GeForce RTX 4090": "rtx4090",
}


def _known() -> str:
    return ", ".join([*DEVICES, *(f"{alias} (= {name})" for alias, name in _ALIASES.items()), "cpu (calibrated)"])


def device(name: str) -> Device:
    """The :class:`Device` called ``name`` in :data:`DEVICES` (or an alias: ``h100``, ``a100``), or ``"cpu"``:
    the figures ``ac-core calibrate`` wrote, else measured now (once per process)."""
    key = name.strip().lower()
    if key == "cpu":
        return _calibrated_cpu()
    found = DEVICES.get(_ALIASES.get(key, key))
    if found is None:
        raise ValueError(f"unknown device {name!r}; known: {_known()}")
    return found


def device_for(where: torch.device | str) -> Device:
    """The :class:`Device` of a torch device: a CUDA device's table entry by its name, the CPU's calibration."""
    where = torch.device(where)
    if where.type == "cpu":
        return _calibrated_cpu()
    if where.type != "cuda":
        raise ValueError(f"no figures for {where.type} devices; pass a device name ({_known()})")
    gpu = torch.cuda.get_device_name(where)
    name = _CUDA_NAMES.get(gpu.strip())
    if name is None:
        raise ValueError(
            f"{gpu!r} is not in ac-core's device table: pass a device name ({_known()}), or measure it with "
            "`ac-core calibrate --device cuda`"
        )
    return DEVICES[name]


def calibration_path() -> Path:
    """Where :func:`device` reads ``cpu``'s figures: ``$AC_CORE_CALIBRATION``, else the user cache directory."""
    given = os.environ.get(CALIBRATION_ENV)
    if given:
        return Path(given).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "ac-core" / "calibration.json"


def save_calibration(measured: Device, path: Path | None = None) -> Path:
    """Write ``measured`` into the calibration file (``path``, else :func:`calibration_path`) under its name
    (``cpu``, ``cuda``), keeping the others there; returns the path."""
    path = path or calibration_path()
    entries = json.loads(path.read_text()) if path.exists() else {}
    entries[measured.name] = dataclasses.asdict(measured)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entries, indent=2, sort_keys=True) + "\n")
    return path


def _calibrated_cpu() -> Device:
    path = calibration_path()
    if path.exists():
        entries = json.loads(path.read_text())
        if "cpu" not in entries:
            raise ValueError(f"{path} has no cpu figures ({', '.join(entries)}); run `ac-core calibrate`")
        return Device(**entries["cpu"])
    if os.environ.get(CALIBRATION_ENV):
        raise ValueError(f"{CALIBRATION_ENV}={path} does not exist; write it with `ac-core calibrate --json {path}`")
    return _measured_cpu()


@functools.cache
def _measured_cpu() -> Device:
    return calibrate("cpu")


def calibrate(where: torch.device | str = "cpu", *, seconds: float = 0.4) -> Device:
    """Measure ``where`` (the CPU or a CUDA device): square matmuls in float32 and bfloat16 (FLOP/s) and a copy
    (bytes read plus written per second), each for about ``seconds``; for CUDA also the host-to-device copy of
    pinned memory (the host link, taken as its interconnect too). On the CPU the host link is its copy bandwidth
    and its interconnect 10 Gb Ethernet (1.25 GB/s, not measured: gloo between hosts)."""
    where = torch.device(where)
    if where.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("no CUDA device here: calibrate the cpu, or run on a machine with one")
    if where.type not in ("cpu", "cuda"):
        raise ValueError(f"calibrate measures the cpu or a cuda device, not {where.type}")
    float32 = _matmul_rate(where, torch.float32, seconds)
    bfloat16 = _matmul_rate(where, torch.bfloat16, seconds)
    nbytes = 64 * 2**20  # past every cache
    src = torch.empty(nbytes, dtype=torch.uint8, device=where)
    dst = torch.empty_like(src)
    bandwidth = 2 * nbytes / _best_seconds(lambda: dst.copy_(src), where, seconds)
    if where.type == "cpu":
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return Device("cpu", float32, bfloat16, None, bandwidth, bandwidth, total)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    link = nbytes / _best_seconds(lambda: dst.copy_(host, non_blocking=True), where, seconds)
    total = torch.cuda.get_device_properties(where).total_memory
    # No other rank to measure against: the host link, which peer traffic without NVLink crosses too.
    return Device("cuda", float32, bfloat16, None, bandwidth, link, total, interconnect=link)


def _matmul_rate(where: torch.device, dtype: torch.dtype, seconds: float) -> float:
    """FLOP/s of an n x n matmul, n doubled from 1024 until one call takes 20 ms (or n is 8192): a small one
    measures call overhead and, on a shared CPU, the scheduler."""
    n = 1024
    while True:
        a = torch.randn(n, n, device=where).to(dtype)
        b = torch.randn(n, n, device=where).to(dtype)
        if n >= 8192 or _best_seconds(functools.partial(torch.mm, a, b), where, 0.0) > 0.02:
            return 2 * n**3 / _best_seconds(functools.partial(torch.mm, a, b), where, seconds)
        n *= 2


def _best_seconds(run: Callable[[], object], where: torch.device, seconds: float) -> float:
    """The fastest of repeated calls of ``run`` over about ``seconds`` (at least three, after one warm-up)."""
    sync = torch.cuda.synchronize if where.type == "cuda" else (lambda: None)
    run()
    sync()
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(times) < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


__all__ = [
    "CALIBRATION_ENV",
    "DEVICES",
    "Device",
    "calibrate",
    "calibration_path",
    "device",
    "device_for",
    "save_calibration",
]
