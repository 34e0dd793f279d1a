"""A whole training step's memory as the budget: what one rank's device holds at the step's peak, not only the
bytes held for backward (see :mod:`.predict` for how the peak is predicted)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, NamedTuple

import torch

from ..units import human_bytes
from .memory_budget import MemoryBudget


class OptimizerState(NamedTuple):
    """What an optimizer keeps per trainable parameter: ``states`` tensors of the state dtype (the master
    dtype, else the parameter's), or ``state_bytes`` bytes each where fixed (8-bit Adam). Its update's
    temporaries, in state-sized copies: ``per_tensor`` of the largest parameter at once (torch's single-tensor
    path, the default on the CPU), ``foreach`` of every parameter of the rank at once (the default on CUDA)."""

    states: int
    state_bytes: int | None = None
    per_tensor: int = 0
    foreach: int = 0


# torch's Adam/AdamW keep exp_avg and exp_avg_sq (their 0-dim step counters stay on the host). The single-tensor
# update makes sqrt(exp_avg_sq) and its quotient at once, the foreach one sqrt of all, divided in place. SGD with
# momentum keeps one buffer, updated in place; plain SGD none.
OPTIMIZERS: dict[str, OptimizerState] = {
    "adamw": OptimizerState(2, per_tensor=2, foreach=1),
    "adam": OptimizerState(2, per_tensor=2, foreach=1),
    "adamw-8bit": OptimizerState(2, state_bytes=1),
    "sgd-momentum": OptimizerState(1),
    "sgd": OptimizerState(0),
    "none": OptimizerState(0),
}


def _dtype(name: str, value: object) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    found = getattr(torch, str(value).removeprefix("torch."), None) if isinstance(value, str) else None
    if not isinstance(found, torch.dtype) or not found.is_floating_point:
        raise ValueError(f"StepBudget({name}={value!r}): a floating torch dtype, e.g. torch.bfloat16 or 'bfloat16'")
    return found


def _count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"StepBudget({name}={value!r}): the number of ranks, an int >= 1 (1: not sharded)")
    return value


@dataclass(frozen=True)
class StepBudget:
    """The memory of one rank for a whole training step: the plan keeps the step's predicted peak (see
    :func:`~ac_core.predict_step`) within ``memory``.

    ``memory``: bytes (an int) or a size (``"80GiB"``); None takes ``device``'s memory. ``device``: a name in
    :data:`~ac_core.budget.devices.DEVICES` (``"h100"``), ``"cpu"`` or a torch device; it gives the memory when
    ``memory`` is None and tells how the optimizer updates (per tensor on the CPU, all tensors at once on an
    accelerator); None: the model's parameters' device. ``fsdp``: ranks the parameters, gradients and optimizer
    state are sharded over (FSDP's all-gathered block is then counted). ``cp``: context-parallel ranks, recorded
    only: ``example_inputs`` are one rank's, already divided (``ac-core plan`` divides the tokens it builds by
    ``cp``). ``optimizer``: one of :data:`OPTIMIZERS`. ``param_dtype``/``grad_dtype``: the parameters' and
    gradients' dtypes on the device (None: each parameter's own; gradients: the parameters'). ``master_dtype``:
    a full-precision copy of the parameters the optimizer updates, in its state dtype (None: none, the state in
    the parameters' dtype). ``margin``: a fraction of ``memory`` kept free (the allocator's fragmentation, the
    CUDA context, what no planning forward sees). ``loss``: the step's loss on the model's output, run to count
    what it holds (an LLM's log-softmax over its vocabulary); not compared, not saved with a plan.
    """

    memory: int | str | None
    _: KW_ONLY
    device: str | torch.device | None = None
    fsdp: int = 1
    cp: int = 1
    optimizer: str = "adamw"
    param_dtype: torch.dtype | str | None = None
    grad_dtype: torch.dtype | str | None = None
    master_dtype: torch.dtype | str | None = None
    margin: float = 0.05
    loss: Callable[[Any], torch.Tensor] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.device, torch.device):
            object.__setattr__(self, "device", self.device.type if self.device.type == "cpu" else str(self.device))
        if self.device is not None and not isinstance(self.device, str):
            raise TypeError(f"StepBudget(device={self.device!r}): a device name ('h100', 'cpu') or a torch.device")
        if self.memory is None and self.device is None:
            raise ValueError("StepBudget needs memory (bytes or a size such as '80GiB') or device= to take it from")
        if self.memory is not None:
            if isinstance(self.memory, float) or not isinstance(self.memory, int | str):
                raise TypeError(
                    f"StepBudget(memory={self.memory!r}): one rank's memory as bytes (an int) or a size such as "
                    "'80GiB'; a fraction of 'none' is a memory_budget of its own, not a step budget"
                )
            MemoryBudget.of(self.memory)  # a bad size fails here, naming the units
        if self.device is not None and self.device != "cpu" and not self.device.startswith("cuda"):
            from .devices import device

            device(self.device)  # an unknown name fails here, naming the known ones
        _count("fsdp", self.fsdp)
        _count("cp", self.cp)
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"StepBudget(optimizer={self.optimizer!r}): choose one of {', '.join(OPTIMIZERS)}")
        for name in ("param_dtype", "grad_dtype", "master_dtype"):
            object.__setattr__(self, name, _dtype(name, getattr(self, name)))
        if isinstance(self.margin, bool) or not isinstance(self.margin, int | float) or not 0 <= self.margin < 1:
            raise ValueError(f"StepBudget(margin={self.margin!r}): a fraction of memory kept free, 0 <= margin < 1")
        if self.loss is not None and not callable(self.loss):
            raise TypeError(f"StepBudget(loss={self.loss!r}): a callable taking the model's output")

    @property
    def nbytes(self) -> int:
        """One rank's memory in bytes."""
        if self.memory is None:
            return self._device_memory()
        parsed = MemoryBudget.of(self.memory)
        assert parsed.nbytes is not None  # an int or a size, checked in __post_init__
        return parsed.nbytes

    @property
    def margin_bytes(self) -> int:
        return math.ceil(self.margin * self.nbytes)

    @property
    def state(self) -> OptimizerState:
        return OPTIMIZERS[self.optimizer]

    def _device_memory(self) -> int:
        name = str(self.device)  # a name since __post_init__
        if name == "cpu":
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        from .devices import device, device_for

        return (device_for(name) if name.startswith("cuda") else device(name)).memory

    def describe(self) -> str:
        """What the budget is, for messages: ``StepBudget(80 GiB, fsdp=8, adamw)``."""
        return f"StepBudget({human_bytes(self.nbytes, digits=2)}, fsdp={self.fsdp}, {self.optimizer})"

    def to_dict(self) -> dict[str, Any]:
        """Its fields as JSON values (dtypes by name; ``loss`` is code and is left out)."""
        return {
            "memory": self.memory,
            "device": self.device,
            "fsdp": self.fsdp,
            "cp": self.cp,
            "optimizer": self.optimizer,
            "param_dtype": _name(self.param_dtype),
            "grad_dtype": _name(self.grad_dtype),
            "master_dtype": _name(self.master_dtype),
            "margin": self.margin,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepBudget:
        return cls(data["memory"], **{k: v for k, v in data.items() if k != "memory"})


def refuse_step_offload(offload: object) -> None:
    # The step's peak counts what the device holds; offload's copies in flight and prefetches are not modelled.
    if offload is not None and offload is not False:
        raise ValueError(
            "a StepBudget plans without offload: the step's predicted peak does not model offload's copies in "
            "flight; plan offload with a memory_budget of bytes held for backward (an int or '40GiB')"
        )


def _name(dtype: torch.dtype | str | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


__all__ = ["OPTIMIZERS", "OptimizerState", "StepBudget", "refuse_step_offload"]
