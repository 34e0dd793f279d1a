"""diffusers' context parallelism as adapters of diffusers models declare it: Ulysses through the model's own
``enable_parallelism``, for the classes whose ``_cp_plan`` says where their sequence is split and gathered.

Read from diffusers 0.42.1 (``ModelMixin.enable_parallelism``, ``hooks/context_parallel.py``). The model is called
with its whole inputs: diffusers' hooks split them (Wan's first block, its rotary table) and gather the output,
which the hook on the model reads as a tuple, so the inputs ask for ``return_dict=False``. The ring
(``ring_degree``) is not declared: its backward cannot run under any checkpointing, and on CPU it has no backend
(README, "Context parallelism"). Nothing here imports diffusers until a model is switched.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..spec import ContextParallel

MODES = ("ulysses",)


def _unsupported(model: nn.Module) -> str | None:
    if getattr(type(model), "_cp_plan", None):
        return None
    return (
        f"{type(model).__name__} declares no _cp_plan: diffusers' enable_parallelism knows nowhere to split its "
        "sequence"
    )


@contextmanager
def _cpu_as_the_device() -> Iterator[None]:
    """diffusers takes each rank's device as ``rank % torch.accelerator.device_count()``, a division by zero on a
    build without an accelerator: there the CPU is counted as the one device while the model is switched."""
    if torch.accelerator.device_count() > 0:
        yield
        return
    from unittest import mock

    with mock.patch.object(torch.accelerator, "device_count", return_value=1):
        yield


def enable_context_parallel(model: nn.Module, mode: str) -> None:
    """Switch ``model`` to Ulysses over every rank of the default process group (``ContextParallelConfig(
    ulysses_degree=world_size)``); ValueError naming the modes for any other ``mode``, or the reason for a class
    diffusers cannot split."""
    if mode not in MODES:
        raise ValueError(f"diffusers' context parallelism here is {', '.join(MODES)}; got {mode!r}")
    reason = _unsupported(model)
    if reason is not None:
        raise ValueError(reason)
    import torch.distributed as dist
    from diffusers import ContextParallelConfig  # pyright: ignore[reportPrivateImportUsage]  # exported lazily

    with _cpu_as_the_device():
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=dist.get_world_size()))  # type: ignore[operator]


def whole_inputs(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """One rank's inputs under diffusers' context parallelism: all of them (its hooks split them), the output
    asked for as a tuple."""
    return {**inputs, "return_dict": False}


CONTEXT_PARALLEL = ContextParallel(MODES, enable=enable_context_parallel, shard=whole_inputs, unsupported=_unsupported)
"""diffusers' Ulysses, for an ``AdapterSpec(context_parallel=...)`` of diffusers models."""
