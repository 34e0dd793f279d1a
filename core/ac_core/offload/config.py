"""What activation offload moves, and how far it runs ahead: a frozen, validated config."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

MiB = 1 << 20

TokenCount = Callable[[nn.Module, Mapping[str, Any]], int]


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"OffloadConfig.{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class OffloadConfig:
    """Activation offload settings.

    ``min_tokens``: offload only a forward whose token count reaches it; ``0`` turns offload off.
    ``min_bytes``: saved tensors smaller than this stay on the device (the copy would cost more than it frees).
    ``checkpoint_inputs``: also offload the inputs a checkpointed block keeps for its recompute
    (DeepSpeed's ``cpu_checkpointing``), so that under ``full`` the device holds about one block's activations.
    ``max_host_fraction``: log a warning, once per process, when the pinned host memory held for offload
    passes this fraction of the machine's RAM.
    ``max_inflight_bytes``: device bytes whose copy to the host may still be running; past it, compute waits
    for the oldest copy, so offload bounds device memory rather than racing ahead of the copy engine.
    ``prefetch_bytes``: bytes brought back to the device ahead of their use in backward (at least one
    tensor whenever this is above 0; 0 copies each tensor back only when backward asks for it).
    ``keep_on_device``: dotted module paths (from the model) whose saved tensors stay on the device,
    as under :func:`no_offload`, e.g. ``("lm_head",)``: vocabulary-sized logits are used at once.
    ``token_count(model, inputs)``: the forward's token count from its inputs (bound by name); it
    replaces the adapter's, and is required where no adapter serves the model (``blocks=``).

    Parameters, buffers and the model's own inputs always stay: they are alive anyway, so moving them frees nothing.
    """

    min_tokens: int = 0
    min_bytes: int = MiB
    checkpoint_inputs: bool = True
    max_host_fraction: float = 0.5
    max_inflight_bytes: int = 1024 * MiB
    prefetch_bytes: int = 512 * MiB
    keep_on_device: tuple[str, ...] = ()
    token_count: TokenCount | None = None

    def __post_init__(self) -> None:
        _check_int("min_tokens", self.min_tokens, 0)
        _check_int("min_bytes", self.min_bytes, 0)
        _check_int("max_inflight_bytes", self.max_inflight_bytes, 0)
        _check_int("prefetch_bytes", self.prefetch_bytes, 0)
        if not isinstance(self.checkpoint_inputs, bool):
            raise ValueError(f"OffloadConfig.checkpoint_inputs must be a bool, got {self.checkpoint_inputs!r}")
        fraction = self.max_host_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"OffloadConfig.max_host_fraction must be a number in (0, 1], got {fraction!r}")
        if isinstance(self.keep_on_device, str):
            raise ValueError(f"OffloadConfig.keep_on_device takes a tuple of paths, e.g. ({self.keep_on_device!r},)")
        object.__setattr__(self, "keep_on_device", tuple(self.keep_on_device))
        for path in self.keep_on_device:
            if not isinstance(path, str) or not path:
                raise ValueError(f"OffloadConfig.keep_on_device holds dotted module paths, got {path!r}")
        if self.token_count is not None and not callable(self.token_count):
            raise ValueError(
                f"OffloadConfig.token_count must be callable(model, inputs) -> int, got {self.token_count!r}"
            )

    @property
    def enabled(self) -> bool:
        """Whether this config offloads at all (``min_tokens > 0``)."""
        return self.min_tokens > 0

    def applies_to(self, token_count: int) -> bool:
        """Whether a forward over ``token_count`` tokens is offloaded (grad mode aside)."""
        return self.enabled and token_count >= self.min_tokens
