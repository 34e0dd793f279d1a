"""What keeping the RNG state costs a checkpointed call on this CPU: ``python examples/rng_cost.py``.

Times a checkpointed forward and backward of a tiny block with ``preserve_rng_state`` on and off, in interleaved
pairs (one thread), and the copy of the CPU generator's state alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.checkpoint import checkpoint


def _step(block: torch.nn.Module, x: torch.Tensor, preserve: bool) -> int:
    start = time.perf_counter_ns()
    checkpoint(block, x, use_reentrant=False, preserve_rng_state=preserve).sum().backward()
    return time.perf_counter_ns() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=20000, help="interleaved on/off pairs (default 20000)")
    pairs = parser.parse_args().pairs
    torch.set_num_threads(1)
    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    x = torch.randn(2, 8, requires_grad=True)
    for _ in range(500):  # warm-up
        _step(block, x, True), _step(block, x, False)
    on, off = [], []
    for i in range(pairs):
        first = i % 2 == 0  # alternate which runs first, so drift falls on both
        a, b = _step(block, x, first), _step(block, x, not first)
        on.append(a if first else b)
        off.append(b if first else a)
    diff = statistics.median(a - b for a, b in zip(on, off, strict=True))
    start = time.perf_counter_ns()
    for _ in range(100000):
        torch.set_rng_state(torch.get_rng_state())
    copy = (time.perf_counter_ns() - start) / 100000
    print(
        f"checkpointed step, median of {pairs} pairs: {statistics.median(on) / 1e3:.1f} us with the RNG state kept, "
        f"{statistics.median(off) / 1e3:.1f} us without; paired difference {diff / 1e3:.1f} us a call"
    )
    size = torch.get_rng_state().numel()
    print(f"CPU generator state: {size:,} bytes; copying and restoring it: {copy / 1e3:.2f} us")


if __name__ == "__main__":
    main()
