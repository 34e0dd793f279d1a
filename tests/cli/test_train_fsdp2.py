"""examples/train_fsdp2.py under torchrun (2 CPU ranks, gloo) trains like one plain process."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_fsdp2.py"
FLAGS = ["--adapter", "toy", "--policy", "ops", "--steps", "2", "--device", "cpu"]
LINE = re.compile(r"^rank (\d) step (\d) loss (\S+) peak (\S+) MiB$", re.MULTILINE)

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")


def _losses(cmd: list[str], ranks: int) -> dict[tuple[int, int], tuple[float, float]]:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    found = {(int(r), int(s)): (float(loss), float(peak)) for r, s, loss, peak in LINE.findall(result.stdout)}
    # Ranks share one pipe: each line must arrive whole (the example writes it in one call).
    assert sorted(found) == [(rank, step) for rank in range(ranks) for step in (1, 2)], result.stdout
    return found


def test_two_ranks_match_one_process():
    single = _losses([sys.executable, str(EXAMPLE), *FLAGS], ranks=1)
    sharded = _losses(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(EXAMPLE), *FLAGS],
        ranks=2,
    )
    for (rank, step), (loss, peak) in sharded.items():
        # Every rank sees the same batch, so averaged gradients equal the single process's: float32
        # reduction order is the only difference allowed.
        assert loss == pytest.approx(single[(0, step)][0], rel=1e-6, abs=0), (rank, step)
        assert peak > 0
    assert single[(0, 2)][0] < single[(0, 1)][0]  # the optimizer stepped
