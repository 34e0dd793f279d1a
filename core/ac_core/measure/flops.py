"""FLOP formulas for the SDPA kernels ``torch.utils.flop_counter.FlopCounterMode`` does not count.

torch 2.13 counts the CUDA SDPA kernels (flash, efficient, cudnn) but nothing for the CPU one
(``aten::_scaled_dot_product_flash_attention_for_cpu``) or the fused "overrideable" one used by
other backends, nor for their backward. Without these formulas the attention share of a step is
invisible on CPU, and ``full`` and ``ops`` look equally expensive there. The counts follow torch's
own convention for the CUDA kernels: two matmuls forward (``4·b·h·s_q·s_k·d``), five backward
(the scores are recomputed), causal masking ignored.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.utils.flop_counter import (
    FlopCounterMode,
    flop_registry,
    register_flop_formula,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

aten = torch.ops.aten


def _sdpa_forward_flop(query_shape, key_shape, value_shape, *args: Any, out_shape=None, **kwargs: Any) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_backward_flop(
    grad_out_shape, query_shape, key_shape, value_shape, *args: Any, out_shape=None, **kwargs: Any
) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


# Both kernels take (query, key, value, ...) forward and (grad_out, query, key, value, ...) backward.
SDPA_FLOP_FORMULAS: Mapping[Any, Any] = {
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_forward_flop,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_backward_flop,
    aten._scaled_dot_product_fused_attention_overrideable: _sdpa_forward_flop,
    aten._scaled_dot_product_fused_attention_overrideable_backward: _sdpa_backward_flop,
}
"""Op packet -> FLOP formula (of shapes) for the SDPA kernels torch's flop counter leaves out."""


def register_sdpa_flop_formulas() -> list[str]:
    """Register :data:`SDPA_FLOP_FORMULAS` with torch's flop counter; returns the op names registered now.

    Idempotent, and skips any op torch itself counts already (a later torch may add them).
    Registration is global: every ``FlopCounterMode`` created afterwards in this process counts them.
    """
    added = []
    for packet, formula in SDPA_FLOP_FORMULAS.items():
        if packet in flop_registry:
            continue
        register_flop_formula(packet)(formula)
        added.append(packet._qualified_op_name)
    return added


class _GlobalOnly:
    """Stands in for FlopCounterMode's ModuleTracker: every op counts under "Global" only."""

    parents = frozenset({"Global"})

    def __enter__(self) -> _GlobalOnly:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class GlobalFlopCounter(FlopCounterMode):
    """``FlopCounterMode`` that counts totals only (``get_flop_counts()["Global"]``), with no module tracking.

    FlopCounterMode's ModuleTracker registers gradient hooks on the tensors of every module call,
    recomputed ones included; under activation checkpointing those hooks keep recomputed activations
    alive until the garbage collector runs, which inflates a memory measurement taken in the same
    step (on the toy stack: 58 MiB peak instead of 25 MiB, and varying from run to run). Without
    the tracker, FLOPs, memory and op counts can be measured in one step. SDPA formulas are registered.
    """

    def __init__(self) -> None:
        register_sdpa_flop_formulas()
        super().__init__(display=False)
        self.mod_tracker = _GlobalOnly()


def op_packet_name(packet: Any) -> str:
    """The dispatcher name (``"aten::mm"``) of a key of ``FlopCounterMode.get_flop_counts()``."""
    return getattr(packet, "_qualified_op_name", str(packet))


def flops_of(counts: Mapping[Any, int], op_names: Iterable[str]) -> int:
    """FLOPs in ``counts`` (one module's dict from ``get_flop_counts()``) of the ops in ``op_names``.

    A name also covers its ``_backward`` kernel, so the attention ops' names give forward and backward.
    """
    wanted = {name.partition(".")[0] for name in op_names}
    wanted |= {f"{name}_backward" for name in wanted}
    return sum(n for packet, n in counts.items() if op_packet_name(packet) in wanted)


__all__ = ["SDPA_FLOP_FORMULAS", "GlobalFlopCounter", "flops_of", "op_packet_name", "register_sdpa_flop_formulas"]
