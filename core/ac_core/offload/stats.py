"""What one offload session did with the tensors autograd saved."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import Enum


class Kept(str, Enum):
    """Why a saved tensor stayed on its device."""

    PARAMETER = "parameter"  # a parameter, buffer, or a view of one: alive anyway
    MODEL_INPUT = "model_input"  # (a view of) a tensor passed to the model: alive anyway
    SMALL = "small"  # below OffloadConfig.min_bytes
    NO_OFFLOAD = "no_offload"  # saved inside no_offload() or a keep_on_device module
    CHECKPOINT_INPUT = "checkpoint_input"  # a checkpointed block's input, with checkpoint_inputs=False
    OTHER_DEVICE = "other_device"  # on a device no transport serves (e.g. CPU)
    UNSUPPORTED = "unsupported"  # a tensor subclass, a non-strided layout, or an expanded (stride-0) view

    def __str__(self) -> str:
        return self.value


@dataclass
class OffloadStats:
    """Counts and bytes for one session (one forward and its backward).

    ``offloaded``: tensors copied to the host (``checkpoint_inputs`` of them being checkpointed
    blocks' inputs); ``shared``: saves of a tensor already offloaded, served by the same host copy;
    ``kept``/``kept_bytes``: by reason. In backward: ``reused`` unpacks were served by the original
    still on the device (its copy had not finished), ``prefetched`` copies back started ahead of use,
    ``on_demand`` when backward asked; ``throttled``: times compute waited for a copy to host
    (``max_inflight_bytes``).
    """

    offloaded: int = 0
    offloaded_bytes: int = 0
    checkpoint_inputs: int = 0
    checkpoint_input_bytes: int = 0
    shared: int = 0
    kept: Counter[Kept] = field(default_factory=Counter)
    kept_bytes: Counter[Kept] = field(default_factory=Counter)
    reused: int = 0
    prefetched: int = 0
    on_demand: int = 0
    throttled: int = 0
