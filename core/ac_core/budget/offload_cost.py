"""What a plan's activation offload moves to the host, and what it leaves on the device.

A plan that offloads keeps the whole model's saved tensors on the device (a ``no_offload`` region over its
forward) and lifts that around the checkpoint calls of the blocks it chose: ac-core's offload session then moves
those blocks' saved inputs (what torch's checkpoint keeps for the recompute) and nothing else. Which of them
move is offload's own rule (:func:`ac_core.offload.seam.kept_reason`: not parameters, buffers, the model's
inputs, expanded views, nor tensors under ``OffloadConfig.min_bytes``), and a tensor several blocks save (Wan's
text states) moves once. Unchecked blocks, kept op outputs and everything outside the blocks stay.

Profiling (:class:`InputRecorder`, in the forward with every block checkpointed whole) notes every saved input
offload could move, holds it aside instead of the checkpoint, then lets them all go: a storage then freed is what
moving its saves frees on the device; one still alive is held by something else too, and frees nothing.

The device still holds some offloaded bytes at times: copies to the host still running when the forward ends
(up to ``max_inflight_bytes``) and copies back started ahead of use in backward (``prefetch_bytes``, at least one
tensor). That window is counted against the budget; ``held_bytes`` is what stays once the copies are done.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef

from ..blocks import ModelBlocks
from ..measure.memory import live_nbytes, plain_tensors, storage_ref
from ..offload import OffloadConfig
from ..offload import seam as offload_seam
from ..offload.stats import Kept


@dataclass(frozen=True)
class SavedInput:
    """A tensor block ``block``'s checkpoint saves that offload could move (its size aside).

    ``tensor`` and ``storage`` number the distinct tensors and storages saved; ``nbytes``: what goes to the host.
    """

    block: str
    tensor: int
    storage: int
    nbytes: int


@dataclass(frozen=True)
class SavedInputs:
    """Every block's movable saved inputs, in forward order, and per storage the device bytes freed once all its
    saves move (0 where something else holds it)."""

    inputs: tuple[SavedInput, ...] = ()
    freed: tuple[int, ...] = ()


class _Parked:
    """What the checkpoint holds instead of an input set aside: the profile runs no backward to unpack it."""

    __slots__ = ()


_PARKED = _Parked()


class InputRecorder:
    """Notes the inputs blocks' checkpoints save that offload could move, holding them aside (a context manager
    around a forward with every block checkpointed); :meth:`finish` lets them go and sees what that frees."""

    def __init__(self, resolved: ModelBlocks, example_inputs: Any) -> None:
        self.resolved = resolved
        self.alive: dict[int, Kept] = {storage_ref(t).cdata: Kept.PARAMETER for t in resolved.model.buffers()}
        self.alive |= {storage_ref(t).cdata: Kept.MODEL_INPUT for t in plain_tensors(example_inputs)}
        self.block = ""
        self.saved: list[tuple[str, tuple, StorageWeakRef, int]] = []
        self.parked: list[torch.Tensor] = []
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda packed: packed)
        self.scope = offload_seam.session_scope()  # checkpoint calls then save their inputs through our hooks
        self.handles: list[Any] = []

    def __enter__(self) -> InputRecorder:
        for block in self.resolved:
            self.handles.append(block.module.register_forward_pre_hook(self._entering(block.path)))
        self.scope.__enter__()
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.hooks.__exit__(*exc)
        self.scope.__exit__()
        for handle in self.handles:
            handle.remove()

    def _entering(self, path: str) -> Any:
        def hook(module: nn.Module, args: tuple) -> None:
            self.block = path

        return hook

    def _movable(self, t: torch.Tensor) -> bool:
        # A fake tensor stands for the plain one a real run has.
        plain = type(t) in (torch.Tensor, nn.Parameter) or isinstance(t, FakeTensor)
        return plain and offload_seam.kept_reason(t, 0, lambda t: self.alive.get(storage_ref(t).cdata)) is None

    def _pack(self, t: torch.Tensor) -> Any:
        if not offload_seam.in_checkpoint_inputs() or not self._movable(t):
            return t
        ref = storage_ref(t)
        view = (ref.cdata, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        self.saved.append((self.block, view, ref, t.numel() * t.element_size()))
        self.parked.append(t)
        return _PARKED

    def finish(self) -> SavedInputs:
        """Let the inputs set aside go (while the forward's graph is alive) and number what was saved."""
        tensors: dict[tuple, int] = {}
        storages: dict[int, int] = {}
        refs: list[tuple[StorageWeakRef, int]] = []
        inputs = []
        for block, view, ref, nbytes in self.saved:
            if ref.cdata not in storages:
                storages[ref.cdata] = len(refs)
                refs.append((ref, live_nbytes(ref)))
            tensor = tensors.setdefault(view, len(tensors))
            inputs.append(SavedInput(block, tensor, storages[ref.cdata], nbytes))
        self.saved.clear()
        self.parked.clear()
        return SavedInputs(tuple(inputs), tuple(nbytes if ref.expired() else 0 for ref, nbytes in refs))


def offload_request(offload: bool | OffloadConfig | None) -> OffloadConfig | None:
    """The planner's ``offload=`` checked: None for no offload, else the config to plan with."""
    if offload is None or offload is False:
        return None
    config = OffloadConfig() if offload is True else offload
    if not isinstance(config, OffloadConfig):
        raise TypeError(f"offload takes True, False, None or an OffloadConfig; got {offload!r}")
    if not config.checkpoint_inputs:
        raise ValueError(
            "a plan's offload moves checkpointed blocks' inputs, which OffloadConfig(checkpoint_inputs=False) "
            "keeps on the device: pass checkpoint_inputs=True, or offload=None"
        )
    return config


def recorded(config: OffloadConfig) -> OffloadConfig:
    """The settings a plan records and applies: its byte settings, offloading every training forward.

    A plan is made for its inputs' shapes, so ``min_tokens`` and ``token_count`` play no part; ``keep_on_device``
    is honoured while planning (no block under those paths offloads) and lives on in the blocks' choices.
    """
    return OffloadConfig(
        min_tokens=1,
        min_bytes=config.min_bytes,
        max_host_fraction=config.max_host_fraction,
        max_inflight_bytes=config.max_inflight_bytes,
        prefetch_bytes=config.prefetch_bytes,
    )


@dataclass(frozen=True)
class Moved:
    """What moving the saved inputs of some blocks does: device bytes ``freed``, bytes sent to the host per block
    (a tensor several blocks save at the first of them), and the ``window`` of those on the device at times."""

    freed: int = 0
    host: dict[str, int] = dataclasses.field(default_factory=dict)
    window: int = 0

    @property
    def gain(self) -> int:
        """Device bytes it saves, the window counted."""
        return self.freed - self.window


class OffloadCost:
    """Offload's effect on the device, for any set of offloaded blocks, under ``config``."""

    def __init__(self, saved: SavedInputs, config: OffloadConfig) -> None:
        self.config = config
        self.freed = saved.freed
        self.moving = [
            s for s in saved.inputs if s.nbytes >= config.min_bytes and not _under(s.block, config.keep_on_device)
        ]
        moving = {id(s) for s in self.moving}
        # A storage frees its bytes once every block saving it offloads; a save of it that stays keeps it.
        self.savers: dict[int, set[str | None]] = {}
        for s in saved.inputs:
            self.savers.setdefault(s.storage, set()).add(s.block if id(s) in moving else None)
        self.blocks = list(dict.fromkeys(s.block for s in self.moving))

    def moved(self, offloaded: Collection[str]) -> Moved:
        """What offloading the inputs of the blocks ``offloaded`` does."""
        chosen = set(offloaded)
        if not chosen:
            return Moved()
        host: dict[str, int] = {}
        sent: set[int] = set()
        largest = 0
        for s in self.moving:
            if s.block in chosen and s.tensor not in sent:
                sent.add(s.tensor)
                host[s.block] = host.get(s.block, 0) + s.nbytes
                largest = max(largest, s.nbytes)
        freed = sum(nbytes for storage, nbytes in enumerate(self.freed) if self.savers[storage] <= chosen)
        config = self.config
        ahead = max(config.prefetch_bytes, largest) if config.prefetch_bytes else 0
        return Moved(freed, host, min(sum(host.values()), config.max_inflight_bytes + ahead))


def _under(path: str, prefixes: tuple[str, ...]) -> bool:
    return any(path == p or path.startswith(p + ".") for p in prefixes)
