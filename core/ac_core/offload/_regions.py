"""Where in the forward a saved tensor comes from: a no-offload region, or a checkpointed block's inputs.

Per thread, as autograd's saved-tensor hooks are. Entering and leaving does nothing while
torch.compile traces: offload works in eager code only, and a plain counter keeps these
context managers traceable (no graph break) inside compiled models.
"""

from __future__ import annotations

import threading

import torch


class _State(threading.local):
    def __init__(self) -> None:
        self.sessions = 0
        self.no_offload = 0
        self.checkpoint_inputs = 0


_state = _State()


def session_active() -> bool:
    """Whether an offload session is active on this thread."""
    return _state.sessions > 0


def in_no_offload() -> bool:
    return _state.no_offload > 0


def in_checkpoint_inputs() -> bool:
    return _state.checkpoint_inputs > 0


class _Counter:
    __slots__ = ("_attr",)

    def __init__(self, attr: str) -> None:
        self._attr = attr

    def __enter__(self) -> None:
        if not torch.compiler.is_compiling():
            setattr(_state, self._attr, getattr(_state, self._attr) + 1)

    def __exit__(self, *exc: object) -> None:
        if not torch.compiler.is_compiling():
            setattr(_state, self._attr, getattr(_state, self._attr) - 1)


def session_scope() -> _Counter:
    return _Counter("sessions")


def checkpoint_inputs_scope() -> _Counter:
    """Marks a checkpoint call: the only saves that reach offload's hooks there are the block's inputs."""
    return _Counter("checkpoint_inputs")


class no_offload(_Counter):  # a context manager, lower case like torch.no_grad
    """Tensors saved for backward inside this region stay on the device, even under an offload session.

    For tensors used soon after they are made, whose round trip would cost more than it frees:
    e.g. an LLM's output head, whose vocabulary-sized logits feed the loss at once. Nests; does
    nothing where no offload is active. ``OffloadConfig(keep_on_device=("lm_head",))`` does the same
    for a module without touching the model's code.
    """

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__("no_offload")


class lift_no_offload:  # a context manager, lower case like no_offload
    """Saves in this region may move even inside :func:`no_offload` (a ``no_offload`` entered in it still holds).

    For a checkpoint plan with offload: it keeps the whole model on the device and lifts that around the
    checkpoint calls of the blocks it chose, so that their inputs, and nothing else, go to the host.
    """

    __slots__ = ("_outer",)

    def __init__(self) -> None:
        self._outer = 0

    def __enter__(self) -> None:
        if not torch.compiler.is_compiling():
            self._outer, _state.no_offload = _state.no_offload, 0

    def __exit__(self, *exc: object) -> None:
        if not torch.compiler.is_compiling():
            _state.no_offload = self._outer
