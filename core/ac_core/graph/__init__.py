"""Selective activation checkpointing decided on torch.compile's joint forward+backward graph.

Importing this package imports neither inductor nor dynamo: :func:`compile` does, when called.
"""

from __future__ import annotations

from .sac import apply_sac_pass
from .save_ops import DEFAULT_SAC_SAVE_OPS
from .torch_compile import (
    GraphRoute,
    aot_eager_backend,
    compile,
    prepare_graph_route,
    sac_aot_eager,
    sac_inductor_options,
    sac_partition,
)

__all__ = [
    "DEFAULT_SAC_SAVE_OPS",
    "GraphRoute",
    "aot_eager_backend",
    "apply_sac_pass",
    "compile",
    "prepare_graph_route",
    "sac_aot_eager",
    "sac_inductor_options",
    "sac_partition",
]
