"""``ac-core calibrate``: measure this machine's peak rates for the roofline (``ac_core.budget.devices``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from ..budget.devices import CALIBRATION_ENV, Device, calibrate, calibration_path, save_calibration
from ._common import CLIError, stdout


def format_figures(measured: Device) -> str:
    """The measured figures, one a line, in the units datasheets use."""
    lines = [f"calibrated {measured.name} (torch {torch.__version__}, {torch.get_num_threads()} CPU threads)"]
    lines.append(f"  float32 matmul   {measured.float32 / 1e9:>12.1f} GFLOP/s")
    lines.append(f"  bfloat16 matmul  {measured.bfloat16 / 1e9:>12.1f} GFLOP/s")
    lines.append(f"  copy             {measured.memory_bandwidth / 1e9:>12.2f} GB/s (bytes read + written)")
    if measured.host_link != measured.memory_bandwidth:
        lines.append(f"  host to device   {measured.host_link / 1e9:>12.2f} GB/s (pinned)")
    lines.append(f"  memory           {measured.memory / 2**30:>12.1f} GiB")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        measured = calibrate(args.device, seconds=args.seconds)
    except ValueError as exc:
        raise CLIError(str(exc)) from exc
    path = save_calibration(measured, args.json)
    out = stdout()
    out.print(format_figures(measured), markup=False)
    out.print(f"wrote {path}", markup=False)
    return 0


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "calibrate",
        help="measure this machine's matmul FLOP/s and copy bandwidth, the figures device('cpu') plans with",
        description=(
            "Measure square matmuls in float32 and bfloat16 and a 64 MiB copy on the CPU (or a CUDA device, with "
            "its host-to-device copy), a few seconds in all, print the figures and write them as JSON: "
            f"ac_core.budget.devices.device('cpu') reads them from ${CALIBRATION_ENV} or, unset, "
            "~/.cache/ac-core/calibration.json."
        ),
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="what to measure (default: cpu)")
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="FILE",
        help=f"where to write the figures (default: ${CALIBRATION_ENV}, else {calibration_path()})",
    )
    parser.add_argument("--seconds", type=float, default=0.4, help="time spent on each measurement (default: 0.4)")
    parser.set_defaults(run=run, command_name=parser.prog.split()[-1])
