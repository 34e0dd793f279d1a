"""``--frames``, ``--height``, ``--width``, ``--cp`` and ``--cp-mode``: the sequence one rank's preset is built
with, from a video as users state it (the model's :class:`~ac_core.spec.VideoGeometry`) or from ``--seq``, split
over context parallelism's ranks."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..spec import AdapterSpec, ModelSpec
from ._common import TINY, CLIError, positive

_SHAPE_FLAGS = ("frames", "height", "width")


@dataclass(frozen=True)
class RankTokens:
    """The tokens of the whole sequence (None: the preset's default), the ``cp`` ranks it is split over, and the
    video's (frames, height, width) and token grid where it was given as a video."""

    tokens: int | None
    cp: int = 1
    shape: tuple[int, int, int] | None = None
    grid: tuple[int, int, int] | None = None

    @property
    def per_rank(self) -> int | None:
        """The tokens one rank's preset is built with."""
        return None if self.tokens is None else self.tokens // self.cp

    @property
    def rank_grid(self) -> tuple[int, int, int] | None:
        """The (frames, height, width) token grid one rank's preset is built with, exactly: the video's grid with
        one axis divided by ``cp`` (see :func:`split_grid`); None where the tokens were not given as a video."""
        return None if self.grid is None else split_grid(self.grid, self.cp)

    def describe(self, *, split: bool = True) -> str | None:
        """One line on where the tokens come from, or None where nothing was given (the preset's default);
        ``split``: with one rank's token grid (False: the model splits the sequence itself)."""
        if self.tokens is None:
            return None
        text = f"{self.tokens:,} tokens"
        if self.shape is not None and self.grid is not None:
            frames, height, width = self.shape
            video = f"{frames} frames of {height}x{width}" if frames > 1 else f"one frame of {height}x{width}"
            text = f"{video}: {' x '.join(map(str, self.grid))} = {text}"
        if self.cp > 1:
            text += f", {self.per_rank:,} per rank over cp {self.cp}"
            if split and self.rank_grid is not None:
                text += f" ({' x '.join(map(str, self.rank_grid))})"
        return text


def split_grid(grid: tuple[int, int, int], cp: int) -> tuple[int, int, int] | None:
    """``grid`` with one axis divided by ``cp``: width where ``cp`` divides it, else height, else frames; None where
    it divides none.

    Context parallelism (Ulysses, ring) shards the flattened sequence: each rank holds ``tokens / cp`` of them, and
    what a block computes and keeps for backward depends on that count, not on which positions they are. So any
    one axis divided exactly gives the rank's planned input (width, height, frames: a fixed order, nothing more).
    """
    for axis in (2, 1, 0):
        if grid[axis] % cp == 0:
            split = list(grid)
            split[axis] //= cp
            return split[0], split[1], split[2]
    return None


def add_geometry_arguments(parser: argparse.ArgumentParser) -> None:
    """``--frames``, ``--height``, ``--width`` (a video or image in pixels), ``--cp`` and ``--cp-mode``."""
    parser.add_argument(
        "--frames", type=positive, default=None, help="video frames (with --height, --width; instead of --seq)"
    )
    parser.add_argument("--height", type=positive, default=None, help="video or image height in pixels")
    parser.add_argument("--width", type=positive, default=None, help="video or image width in pixels")
    parser.add_argument(
        "--cp",
        type=positive,
        default=1,
        help="context-parallel ranks (Ulysses, ring): where the adapter declares context parallelism, rank 0 is "
        "planned with its collectives on stand-in ranks; else one rank at the tokens divided by cp (1)",
    )
    parser.add_argument(
        "--cp-mode",
        default=None,
        metavar="MODE",
        help="the adapter's context-parallel mode planned with --cp (ulysses, ring; default: its first)",
    )


def _divisors(tokens: int, limit: int = 64) -> str:
    return ", ".join(str(n) for n in range(1, limit + 1) if tokens % n == 0)


def rank_tokens(adapter: AdapterSpec, model: ModelSpec, args: argparse.Namespace) -> RankTokens:
    """The sequence ``args`` ask for: ``--frames/--height/--width`` through ``model``'s geometry, or ``--seq``,
    over ``--cp`` ranks; CLIError naming the flag and the fix for anything that does not fit."""
    given = [f"--{name}" for name in _SHAPE_FLAGS if getattr(args, name) is not None]
    shape: tuple[int, int, int] | None = None
    grid: tuple[int, int, int] | None = None
    tokens: int | None = args.seq
    if given:
        if args.preset == TINY:
            raise CLIError(f"{', '.join(given)} size a real-width preset; the tiny preset has a fixed config")
        geometry = model.geometry
        if geometry is None:
            raise CLIError(
                f"{adapter.model_label(model)} ({adapter.name}) takes tokens, not frames: "
                f"{'/'.join(given)} size video and image models; give --seq instead"
            )
        if args.seq is not None:
            raise CLIError("give either --seq or --frames/--height/--width, not both")
        frames: int | None = args.frames if args.frames is not None or geometry.video else 1
        if frames is None or args.height is None or args.width is None:
            values = (frames, args.height, args.width)
            missing = [f"--{name}" for name, value in zip(_SHAPE_FLAGS, values, strict=True) if value is None]
            raise CLIError(f"{', '.join(given)} need {' and '.join(missing)} too: a video is frames x height x width")
        try:
            grid = geometry.token_grid(frames, args.height, args.width)
        except ValueError as exc:
            raise CLIError(f"--frames/--height/--width: {exc}") from None
        shape = (frames, args.height, args.width)
        tokens = grid[0] * grid[1] * grid[2]
    if args.cp > 1:
        if tokens is None:
            raise CLIError(f"--cp {args.cp} splits the tokens over ranks: give --seq or --frames/--height/--width")
        if tokens % args.cp:
            raise CLIError(
                f"--cp {args.cp}: {tokens:,} tokens do not split evenly over {args.cp} ranks; "
                f"cp values that divide them (up to 64): {_divisors(tokens)}"
            )
        if grid is not None and split_grid(grid, args.cp) is None:
            raise CLIError(
                f"--cp {args.cp}: the {' x '.join(map(str, grid))} token grid (frames x height x width) has no axis "
                f"that {args.cp} divides, so one rank's share is no whole grid; cp values that divide an axis (up to "
                f"64): {', '.join(str(n) for n in range(1, 65) if any(size % n == 0 for size in grid))}"
            )
    return RankTokens(tokens, args.cp, shape, grid)
