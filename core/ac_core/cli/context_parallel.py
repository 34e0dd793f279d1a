"""``ac-core plan --cp``: one rank of a context-parallel model, planned in this one process.

Where the adapter declares how its models run context parallel (``AdapterSpec.context_parallel``), the model is
built at the whole sequence, switched to the mode (``--cp-mode``) inside a stand-in process group of ``cp``
ranks, and given rank 0's inputs: the planner then profiles the forward as a rank runs it, the sequence split,
attention over its share, and the collectives themselves, whose outputs a plan may keep (an activation
collective's bytes held against its time on the link). torch's fake process group stands in: every collective
returns at once with an output of the right shape and moves nothing, so a plan on ``meta`` costs no more than
one without ranks. Rank 0 stands for every rank: Ulysses' and the ring's ranks all run the same shapes.

Elsewhere (no declaration, or a model class the declaration excludes) one rank is planned at the tokens divided
by ``cp``, without its collectives, and the plan says so.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ..spec import AdapterSpec, ModelCase
from ._common import CLIError


@dataclass(frozen=True)
class PlannedRank:
    """The case one rank is planned on, and in words how it stands for a rank (None: no context parallelism)."""

    case: ModelCase
    words: str | None
    parallel: bool = False  # switched to a mode on the stand-in ranks, its collectives planned


def cp_mode(adapter: AdapterSpec, args: argparse.Namespace) -> str | None:
    """The mode ``--cp-mode`` names (default: the adapter's first), None where no mode is planned; CLIError
    naming the fix for a mode without ranks or one the adapter does not declare."""
    parallel = adapter.context_parallel
    if args.cp == 1:
        if args.cp_mode is not None:
            raise CLIError(f"--cp-mode {args.cp_mode}: a mode of context parallelism needs ranks: give --cp 2 or more")
        return None
    if parallel is None:
        if args.cp_mode is not None:
            raise CLIError(
                f"--cp-mode {args.cp_mode}: adapter {adapter.name} declares no context parallelism; leave --cp-mode "
                "out to plan one rank at the tokens divided by --cp"
            )
        return None
    mode = args.cp_mode or parallel.modes[0]
    if mode not in parallel.modes:
        raise CLIError(f"--cp-mode {mode}: adapter {adapter.name} runs context parallel as {', '.join(parallel.modes)}")
    return mode


@contextmanager
def stand_in_ranks(world: int) -> Iterator[None]:
    """Within the block, the default process group is torch's fake one of ``world`` ranks, this process rank 0;
    destroyed on leaving, on error too. CLIError where a group exists already (it is not ours to replace)."""
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        raise CLIError(f"--cp: torch {torch.__version__} is built without torch.distributed; plan with --cp 1")
    if dist.is_initialized():
        raise CLIError(
            "--cp plans on a stand-in process group of its own, and this process has one already: run ac-core plan "
            "outside torch.distributed"
        )
    try:
        # torch's own test double, registered as the "fake" backend on import.
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as exc:
        raise CLIError(f"--cp: torch {torch.__version__} has no fake process group to plan ranks on ({exc})") from None
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextmanager
def planned_rank(
    adapter: AdapterSpec, mode: str | None, cp: int, build: Callable[[bool], ModelCase]
) -> Iterator[PlannedRank]:
    """The case to plan one rank on, the stand-in ranks open while it is planned where ``mode`` is given.
    ``build(whole)``: the preset at the whole sequence (True) or at one rank's share of it (False)."""
    parallel = adapter.context_parallel
    if mode is None or parallel is None:
        words = None
        if cp > 1:
            words = (
                f"adapter {adapter.name} declares no context parallelism: one rank planned at the tokens divided, "
                "without its collectives"
            )
        yield PlannedRank(build(False), words)
        return
    case = build(True)
    reason = parallel.reason(case.model)
    if reason is not None:
        del case
        yield PlannedRank(build(False), f"{reason}: one rank planned at the tokens divided, without its collectives")
        return
    with stand_in_ranks(cp):
        try:
            parallel.enable(case.model, mode)
        except (ValueError, RuntimeError) as exc:
            raise CLIError(f"--cp {cp} --cp-mode {mode}: {adapter.name} could not switch the model: {exc}") from None
        case.inputs = dict(parallel.shard(case.inputs))
        words = (
            f"rank 0 of {cp} planned under {mode} on stand-in ranks (torch's fake process group), its collectives too"
        )
        yield PlannedRank(case, words, parallel=True)
