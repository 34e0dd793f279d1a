"""The FSDP2 check's rank runner: a native crash before the last barrier is run once more, then fails;
a crash after every rank is done keeps the results; a Python exception fails at once."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from ac_core_conformance.distributed import _RESULT, _done_marker, _mark_done, _run_ranks

WORLD = 2
TIMEOUT = 120.0


def _worker(rank: int, world: int, tmp: str, mode: str, state: str) -> None:
    """Rank 1 aborts (SIGABRT, as gloo's native threads do) where ``mode`` says; ``state`` counts runs."""
    if rank == 0:
        torch.save([{"rank": 0}], os.path.join(tmp, _RESULT))
        _mark_done(tmp, rank)
        return
    runs = Path(state, "runs")
    run = len(runs.read_text()) if runs.exists() else 0
    runs.write_text("x" * (run + 1))
    # Rank 0 finishes first, so a crash of rank 1 is never mistaken for a slow rank 0.
    while not os.path.exists(_done_marker(tmp, 0)):
        time.sleep(0.01)
    if mode == "raise":
        raise ValueError("a wrong number")
    if mode == "after":
        _mark_done(tmp, rank)
    if mode in ("after", "always") or (mode == "first" and run == 0):
        os.abort()
    _mark_done(tmp, rank)


def _runs(state: Path) -> int:
    return len((state / "runs").read_text())


def test_crash_after_every_rank_is_done_keeps_the_results(tmp_path):
    assert _run_ranks(_worker, ("after", str(tmp_path)), WORLD, TIMEOUT) == [{"rank": 0}]
    assert _runs(tmp_path) == 1


def test_one_crash_before_the_end_runs_the_ranks_again(tmp_path):
    with pytest.warns(RuntimeWarning, match="running the ranks once more"):
        assert _run_ranks(_worker, ("first", str(tmp_path)), WORLD, TIMEOUT) == [{"rank": 0}]
    assert _runs(tmp_path) == 2


def test_two_crashes_fail(tmp_path):
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match=r"crashed twice in a row.*SIGABRT"):
        _run_ranks(_worker, ("always", str(tmp_path)), WORLD, TIMEOUT)
    assert _runs(tmp_path) == 2


def test_an_exception_fails_at_once(tmp_path):
    with pytest.raises(mp.ProcessRaisedException, match="a wrong number"):
        _run_ranks(_worker, ("raise", str(tmp_path)), WORLD, TIMEOUT)
    assert _runs(tmp_path) == 1
