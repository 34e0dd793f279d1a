"""Selective activation checkpointing decided on torch.compile's joint forward+backward graph.

Importing this package imports neither inductor nor dynamo: :func:`compile` does, when called.
"""

from __future__ import annotations

from .partition import aot_eager_backend, budget_partition, sac_partition
from .route import GraphRoute
from .sac import apply_sac_pass
from .save_ops import DEFAULT_SAC_SAVE_OPS
from .torch_compile import GRAPH_BACKENDS, compile, prepare_graph_route

__all__ = [
    "DEFAULT_SAC_SAVE_OPS",
    "GRAPH_BACKENDS",
    "GraphRoute",
    "aot_eager_backend",
    "apply_sac_pass",
    "budget_partition",
    "compile",
    "prepare_graph_route",
    "sac_partition",
]
