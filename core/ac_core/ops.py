"""Which dispatcher ops ``ops`` retains, and the selective-checkpoint policy that retains them."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable

from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .spec import is_collective

logger = logging.getLogger("ac_core")

# PyTorch's fused SDPA kernels. The CPU kernel is listed too: without it 'ops' recomputes
# attention on every CPU run. The math fallback decomposes into bmm/softmax before any
# policy sees it, so there is no single op to name for it.
DEFAULT_RETAINED_OPS: frozenset[str] = frozenset(
    {
        "aten::_scaled_dot_product_flash_attention",
        "aten::_scaled_dot_product_efficient_attention",
        "aten::_scaled_dot_product_cudnn_attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_fused_attention_overrideable",
    }
)

# No collective is ever retained. Under FSDP2 each block's parameters are all-gathered when the
# block runs and resharded after; retaining the all-gather output would pin every checkpointed
# block's full weights until backward, undoing the sharding. Its reduce-scatter runs after
# backward, outside any checkpointed region, so retaining it would buy nothing either.


def retained_op_names(*sources: Iterable[str]) -> frozenset[str]:
    """The union of op names to retain, with collectives rejected."""
    names = frozenset(name for source in sources for name in source)
    collectives = sorted(n for n in names if is_collective(n))
    if collectives:
        raise ValueError(
            f"collectives cannot be retained by 'ops': {collectives}. Retaining an FSDP all-gather keeps every "
            "block's unsharded weights alive until backward; drop them from retain_ops."
        )
    return names


def _is_attention_like(name: str) -> bool:
    lowered = name.lower()
    return "attention" in lowered or "attn" in lowered or "softmax" in lowered


class RetentionRecord:
    """What one checkpointed call's forward retained, and the attention-like ops it saw but did not retain."""

    __slots__ = ("retained", "seen_attention")

    def __init__(self) -> None:
        self.retained: set[str] = set()
        self.seen_attention: set[str] = set()


def _policy(retained: frozenset[str], record: RetentionRecord | None, ctx, func, *args, **kwargs) -> CheckpointPolicy:
    name = func.name()  # "aten::mul.Tensor"; a default overload has no suffix
    if name in retained or name.partition(".")[0] in retained:
        if record is not None:
            record.retained.add(name)
        return CheckpointPolicy.MUST_SAVE
    if record is not None and _is_attention_like(name):
        record.seen_attention.add(name)
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_context(retained: frozenset[str], record: RetentionRecord | None = None):
    """``context_fn`` for torch.utils.checkpoint: retain ``retained`` op outputs, recompute the rest.

    Bound with functools.partial (not a closure) because torch.compile accepts only a plain
    function or a partial of constants as ``context_fn``.
    """
    return create_selective_checkpoint_contexts(functools.partial(_policy, retained, record))


_warned_nothing_retained = False


def warn_nothing_retained(block: str, record: RetentionRecord) -> None:
    """Log, once per process, that an ``ops`` block retained nothing and so recomputes in full."""
    global _warned_nothing_retained
    if _warned_nothing_retained:
        return
    _warned_nothing_retained = True
    seen = (
        f"it ran attention through {sorted(record.seen_attention)}, which is not retained"
        if record.seen_attention
        else "it ran no op that looks like attention (a math or Python-level attention decomposes into small ops)"
    )
    logger.warning(
        "ac-core: 'ops' retained nothing in checkpointed block %s, so it recomputes in full, as under 'full': %s. "
        "Switch the model to an attention backend its adapter declares retainable, or name the kernel with "
        "apply_activation_checkpointing(..., retain_ops={'namespace::op'}).",
        block,
        seen,
    )


def _reset_warnings() -> None:
    global _warned_nothing_retained
    _warned_nothing_retained = False
