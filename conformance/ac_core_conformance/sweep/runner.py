"""Run the sweep: each target in a process of its own, a few at a time, each within a time limit.

A process per class keeps one model's crash, hang or leaked state (a patched global, a registered hook) from
reaching the next; forked from a parent that has imported the library already, each starts in milliseconds.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import time
import traceback
import warnings
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection, wait
from typing import Any

from ac_core.libraries.class_builds import class_build

from .catalog import Target
from .checks import run_checks
from .results import CRASHED, FAILED, NOT_BUILT, PROVEN, REFUSED, TIMED_OUT, ClassResult
from .subject import NotBuilt, Refused, tiny_subject

TIME_LIMIT = 120.0
"""Seconds one class may take before the sweep stops it and records it as timed out."""

MEMORY_LIMIT = 8 * 2**30
"""Bytes of address space one class's process may take."""


def sweep_one(target: Target) -> ClassResult:
    """Build ``target`` tiny and run the light conformance on it, in this process."""
    start = time.perf_counter()
    row = ClassResult(target.library, target.name, target.class_name, PROVEN)
    build = class_build(target.load())
    row.declared = build.why if build is not None else ""
    try:
        subject = tiny_subject(target)
    except NotBuilt as exc:
        row.result, row.reason = NOT_BUILT, str(exc)
    except Refused as exc:
        row.result, row.reason = REFUSED, str(exc)
    else:
        row.served_by = subject.adapter.name
        row.attention = {cls: n if isinstance(n, int) else dict(n) for cls, n in subject.model.attention_calls.items()}
        resolved = subject.blocks(subject.model.build_tiny().model)
        row.containers = {c.path: len(c.blocks) for c in resolved.containers}
        row.checks = run_checks(subject)
        failed = next((o for o in row.checks if o.status == "failed"), None)
        if failed is not None:
            row.result, row.reason = FAILED, f"{failed.check}: {failed.detail}"
    row.seconds = round(time.perf_counter() - start, 2)
    return row


def _isolate() -> None:
    # A model's prints and warnings are not the sweep's output; one thread each, as the pool runs side by side.
    import resource

    import torch

    # A backstop for a model the size check could not count: it fails with MemoryError, the machine lives on.
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)


def _child(target: Target, conn: Connection) -> None:
    _isolate()
    try:
        row = sweep_one(target)
    except BaseException as exc:  # anything the checks did not catch ends as this row, never as a lost result
        last = traceback.extract_tb(exc.__traceback__)[-1:]
        where = f" at {last[0].filename}:{last[0].lineno}" if last else ""
        row = ClassResult(target.library, target.name, target.class_name, CRASHED, f"{exc!r}{where}")
    conn.send(row.to_json())
    conn.close()


def _lost(target: Target, result: str, reason: str, seconds: float) -> ClassResult:
    return ClassResult(target.library, target.name, target.class_name, result, reason, seconds=round(seconds, 2))


def sweep(
    targets: Iterable[Target],
    *,
    jobs: int | None = None,
    time_limit: float = TIME_LIMIT,
    on_result: Callable[[ClassResult], Any] | None = None,
) -> list[ClassResult]:
    """Sweep ``targets`` with ``jobs`` processes at a time (default: one per CPU); rows in the targets' order.

    ``on_result`` is called with each row as it finishes (for progress).
    """
    context = multiprocessing.get_context("fork")
    pending = list(targets)
    order = {t: i for i, t in enumerate(pending)}
    width = max(1, jobs or os.cpu_count() or 1)
    running: dict[Connection, tuple[Target, Any, float]] = {}
    rows: dict[Target, ClassResult] = {}

    def finish(target: Target, row: ClassResult) -> None:
        rows[target] = row
        if on_result is not None:
            on_result(row)

    while pending or running:
        while pending and len(running) < width:
            target = pending.pop(0)
            receive, send = context.Pipe(duplex=False)
            process = context.Process(target=_child, args=(target, send), daemon=True)
            process.start()
            send.close()
            running[receive] = (target, process, time.perf_counter())
        ready = wait(list(running), timeout=1.0)
        for conn in ready:
            assert isinstance(conn, Connection)
            target, process, started = running.pop(conn)
            try:
                row = ClassResult.from_json(conn.recv())
            except EOFError:
                process.join()
                row = _lost(target, CRASHED, f"the process died (exit code {process.exitcode})", 0.0)
            process.join()
            finish(target, row)
        now = time.perf_counter()
        for conn, (target, process, started) in list(running.items()):
            if now - started > time_limit:
                process.kill()
                process.join()
                del running[conn]
                with contextlib.suppress(OSError):
                    conn.close()
                finish(target, _lost(target, TIMED_OUT, f"stopped after {time_limit:.0f} s", now - started))
    return [rows[t] for t in order]
