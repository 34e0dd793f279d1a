"""A checkpointed block's call as torch's checkpoint makes it: once in forward, again in each recompute.

Three things torch's checkpoint leaves to its caller, kept here so that every route (a policy's layer, a plan's
layer, offload) gets them:

- A forward that changes one of its inputs in place cannot be recomputed: recompute starts from the input as it
  is then, not as it was (torch raises at backward without naming the block, or, where the changed input is not
  saved, recomputes silently from the wrong values). It is refused right after the forward, naming the block.
- Recompute runs the block's code again, so a buffer the forward updates (BatchNorm's running statistics) would
  be updated twice a step. After each recompute the block's buffers are put back as they were before it.
- Where recompute fails (a known torch limit), the error names the block and the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import _StopRecomputationError

# Recompute errors of torch's own checkpoint that name no block, matched by their text (torch 2.13), with the fix.
_KNOWN: tuple[tuple[str, str], ...] = (
    (
        "Trying to backward an extra time",
        "a block under a selective policy ('ops' or a plan keeping op outputs) serves its kept outputs to one backward "
        "only: a second backward (retain_graph=True) through it cannot recompute. Use Full() for a model trained "
        "with retain_graph=True, or run one backward per forward",
    ),
    (
        "encountered during backward but not found in storage",
        "the block's recompute ran other ops than its forward: under a selective policy ('ops' or a plan keeping op "
        "outputs) the kept outputs are matched op by op, so the block must run the same ops again; its code depends "
        "on state that changed between forward and backward (a flag, a counter, a cache). Make its ops depend on "
        "its inputs only, or use Full() for this model",
    ),
    (
        "cached during selective activation checkpoint has been mutated",
        "the block changes a kept op output in place after the op ran (e.g. attn.mul_(...) after attention), so the "
        "kept value is no longer the op's output. Make that change out of place (attn = attn * ...), or use Full() "
        "for this model",
    ),
)


def named_tensors(args: tuple, kwargs: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """Every tensor in a call's arguments, named by position (``"0"``) or keyword, with a pytree path suffix inside
    containers (``"rotary[1]"``); keywords sorted by name."""
    found: list[tuple[str, torch.Tensor]] = []
    for name, value in [*((str(i), a) for i, a in enumerate(args)), *sorted(kwargs.items())]:
        leaves, _ = tree_flatten(value)
        single = len(leaves) == 1
        for index, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                found.append((name if single else f"{name}[{index}]", leaf))
    return found


def is_real(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds values (not meta, not fake): only such tensors are compared and copied back."""
    return tensor.device.type != "meta" and not isinstance(tensor, torch._subclasses.FakeTensor)


def put_back(values: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each saved value back into its tensor where they differ; outside any dispatch mode."""
    with _disable_current_modes(), torch.no_grad():
        for tensor, value in values:
            if not torch.equal(tensor, value):
                # Through .data: no version bump, so a graph that saved the tensor for backward stays valid.
                tensor.data.copy_(value)


class BlockCall:
    """The rest of ``module``'s forward chain, called by torch's checkpoint: first its forward, then recomputes."""

    __slots__ = ("call_next", "forwarded", "module", "path")

    def __init__(self, call_next: Callable[..., Any], module: nn.Module, path: str) -> None:
        self.call_next = call_next
        self.module = module
        self.path = path
        self.forwarded = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.forwarded:
            self.forwarded = True
            return self._forward(args, kwargs)
        return self._recompute(args, kwargs)

    def _forward(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        inputs = named_tensors(args, kwargs)
        versions = [tensor._version for _, tensor in inputs]
        out = self.call_next(*args, **kwargs)
        changed = [
            f"argument {name}" if name[0].isdigit() else name
            for (name, tensor), version in zip(inputs, versions, strict=True)
            if tensor._version != version
        ]
        if changed:
            raise RuntimeError(
                f"ac-core: block {self.path!r} ({type(self.module).__name__}) changes its input ({', '.join(changed)}) "
                "in place in its forward, so backward cannot recompute it from that input (it no longer holds the "
                "values the forward started from). Clone the input first in the block's forward (x = x.clone() "
                "before the in-place op), or leave this block unchecked (name other containers with blocks=[...], "
                "or remove_activation_checkpointing)"
            )
        return out

    def _recompute(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        # Cloned here, in backward, and dropped when the recompute ends: nothing more is held between forward and
        # backward. Compared by value: BatchNorm's kernel updates its running statistics without a version bump.
        # Outside the recompute's dispatch modes: a selective checkpoint matches every op it sees to the forward's.
        with _disable_current_modes():
            buffers = [(b, b.detach().clone()) for b in self.module.buffers() if is_real(b)]
        try:
            return self.call_next(*args, **kwargs)
        except _StopRecomputationError:
            raise  # torch's early stop: every tensor backward needs was recomputed
        except RuntimeError as exc:
            fix = next((fix for text, fix in _KNOWN if text in str(exc)), None)
            if fix is None:
                raise RuntimeError(
                    f"ac-core: recomputing block {self.path!r} ({type(self.module).__name__}) in backward failed: {exc}"
                ) from exc
            raise RuntimeError(
                f"ac-core: recomputing block {self.path!r} ({type(self.module).__name__}) in backward failed: {fix}. "
                f"(torch: {exc})"
            ) from exc
        finally:
            put_back(buffers)
