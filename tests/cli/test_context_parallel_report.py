"""examples/context_parallel_report.py under torchrun (2 CPU ranks, gloo): what each policy re-runs and keeps under
Ulysses and ring attention, from its --json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "context_parallel_report.py"
WORLD, DEPTH, TOKENS, BATCH, DIM = 2, 2, 256, 2, 64
SHARE = BATCH * (TOKENS // WORLD) * DIM * 4  # one all-to-all output on one rank: float32 q, k, v or the output

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")


def _sizes() -> list[str]:
    return ["--depth", str(DEPTH), "--tokens", str(TOKENS), "--batch", str(BATCH), "--dim", str(DIM)]


def test_report_counts_what_each_policy_reruns_and_keeps(tmp_path: Path):
    out = tmp_path / "cp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD), str(EXAMPLE)]
    result = subprocess.run(
        [*cmd, "--steps", "2", *_sizes(), "--json", str(out)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {(r["mode"], r["policy"]): r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == sorted((m, p) for m in ("ulysses", "ring") for p in ("none", "full", "ops", "plan"))
    assert all(r["grads_equal"] for r in rows.values())
    # The table a person reads: one line per row, each whole (ranks share the pipe).
    assert sum(line.startswith(("ulysses ", "ring ")) for line in result.stdout.splitlines()) == 8, result.stdout
    for mode in ("ulysses", "ring"):
        none, full, ops = rows[(mode, "none")], rows[(mode, "full")], rows[(mode, "ops")]
        assert (none["attention_reruns"], none["collective_reruns"], none["collective_bytes_kept"]) == (0, 0, 0)
        assert ops["attention_reruns"] == 0
        # Re-runs are the first step's: full recomputes every block's attention from it on (ring: each of the
        # world's key-value chunks), so no block sits the first call out.
        assert full["attention_reruns"] == DEPTH * (WORLD if mode == "ring" else 1)
        assert full["collective_bytes_kept"] == 0
        # Checkpointing lowers every step's peak, the first included. Steps are not compared with each other: any
        # step's peak, none's too, varies between runs by one or two collective buffers (up to 0.125 MiB).
        for row in (full, ops, rows[(mode, "plan")]):
            assert max(row["first_peak"], row["later_peak"]) < min(none["first_peak"], none["later_peak"]), row
    ulysses = rows[("ulysses", "ops")]
    # Ulysses: full re-runs the four all-to-alls of every attention call; ops keeps them all.
    assert rows[("ulysses", "full")]["collective_reruns"] == 4 * DEPTH
    assert ulysses["collective_reruns"] == 0 and ulysses["collective_bytes_kept"] == 4 * DEPTH * SHARE
    # Ring: ops keeps no collective (none is declared an activation collective), so the key-value gather re-runs.
    assert rows[("ring", "ops")]["collective_reruns"] == DEPTH and rows[("ring", "ops")]["collective_bytes_kept"] == 0
