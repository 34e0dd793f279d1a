"""Activation offload: saved activations go to pinned host memory in forward and come back ahead of use in backward.

On CUDA, copies run on side streams and overlap compute; what moves follows the checkpointing
policy (``ops``-retained attention outputs stay on the device), a size threshold, and no-offload
regions. Without a CUDA device it does nothing (and says so once, at debug level).
"""

from __future__ import annotations

from ._regions import no_offload
from ._session import OffloadSession
from ._transport import OffloadTransport, use_offload_transport
from .config import OffloadConfig
from .context import activation_offload_context, offload_activations
from .model import apply_activation_offload, last_offload_stats, remove_activation_offload
from .stats import Kept, OffloadStats

__all__ = [
    "Kept",
    "OffloadConfig",
    "OffloadSession",
    "OffloadStats",
    "OffloadTransport",
    "activation_offload_context",
    "apply_activation_offload",
    "last_offload_stats",
    "no_offload",
    "offload_activations",
    "remove_activation_offload",
    "use_offload_transport",
]
