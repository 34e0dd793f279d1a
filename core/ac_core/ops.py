"""Which dispatcher ops ``ops`` retains, the selective-checkpoint policy that retains them, and what it retained."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy

from ._sac import selective_contexts
from .collectives import WAIT_TENSOR, CollectiveKeeper, block_state, is_collective, is_keepable_collective
from .op_names import op_matches
from .warnings import warn_once

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

# A mixture-of-experts router's decision: which experts each token goes to (top-k indices) and with what weight
# (top-k values). Kept under 'ops' and in every plan, whatever the budget: recomputed, a tie between scores may
# break another way (CUDA's topk does not promise which tied index it returns), the recompute sends tokens to
# other experts, and torch's checkpoint raises "Recomputed values for the following tensors have different
# metadata than during the forward pass" (torchtitan#1117) or trains on gradients of other experts. Indices and
# weights are tokens x k, small beside any activation. What follows the decision (sorting tokens by expert,
# counting them) is integer work on the kept indices, which recomputes the same.
ROUTING_OPS: frozenset[str] = frozenset({"aten::topk"})

# No collective is ever retained. Under FSDP2 each block's parameters are all-gathered when the
# block runs and resharded after; retaining the all-gather output would pin every checkpointed
# block's full weights until backward, undoing the sharding. Its reduce-scatter runs after
# backward, outside any checkpointed region, so retaining it would buy nothing either.


def check_op_names(names: object, where: str) -> frozenset[str]:
    """``names`` as a frozenset of op names, or a TypeError/ValueError naming ``where`` and the fix."""
    if isinstance(names, (str, bytes)):
        raise TypeError(f"{where} takes a collection of op names, e.g. {{{names!r}}}, not a single string")
    if not isinstance(names, Iterable):
        raise TypeError(f"{where} takes a collection of op names such as {{'aten::mm'}}, got {names!r}")
    result = frozenset(names)
    for name in result:
        if not isinstance(name, str) or not name:
            raise TypeError(f"{where}: op names are non-empty strings such as 'aten::mm', got {name!r}")
    refused = sorted(n for n in result if is_collective(n) and not is_keepable_collective(n))
    if refused:
        raise ValueError(
            f"{where}: {refused} cannot be kept: only a functional collective's output ('_c10d_functional::...', "
            "e.g. '_c10d_functional::all_to_all_single') can be, and then its wait goes with it; drop them"
        )
    return result


def is_attention_like(op_name: str) -> bool:
    """An op name that looks like attention: a fused kernel, a custom attention op, or softmax."""
    lowered = op_name.lower()
    return "attention" in lowered or "attn" in lowered or "softmax" in lowered


def draws_random(func: Any, args: tuple | list, kwargs: dict[str, Any]) -> bool:
    """Whether an op call consumes the random generator: tagged ``nondeterministic_seeded`` (dropout, rand,
    bernoulli, the SDPA kernels) and, where it takes a dropout probability, called with one above 0.

    ``args`` may be graph nodes: only a literal probability of 0 counts as no draw.
    """
    if torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):
        return False
    # Every SDPA kernel carries the tag for its dropout_p, which training almost always passes as 0.
    for index, argument in enumerate(func._schema.arguments):
        if argument.name in ("dropout_p", "p"):
            value = kwargs.get(argument.name, args[index] if index < len(args) else argument.default_value)
            return not isinstance(value, (int, float)) or value != 0
    return True


@dataclass(frozen=True)
class RetainedOutput:
    """One op output an ``ops`` policy kept for backward: in which block, which op, where and how big.

    ``storage`` is a weak reference to its storage (None while torch.compile traces fake tensors).
    """

    block: str
    op: str
    device: torch.device
    nbytes: int
    storage: StorageWeakRef | None = field(compare=False)

    @property
    def alive(self) -> bool:
        return self.storage is not None and not self.storage.expired()


@dataclass
class RetentionLog:
    """Every output ``ops`` retained while :func:`observe_retention` was active, in order."""

    outputs: list[RetainedOutput] = field(default_factory=list)

    @property
    def op_names(self) -> frozenset[str]:
        return frozenset(out.op for out in self.outputs)

    def by_block(self) -> dict[str, list[RetainedOutput]]:
        """Block path -> what it retained."""
        result: dict[str, list[RetainedOutput]] = {}
        for out in self.outputs:
            result.setdefault(out.block, []).append(out)
        return result


_observers: list[RetentionLog] = []


@contextmanager
def observe_retention() -> Iterator[RetentionLog]:
    """Record what every ``ops`` block retains while active: block path, op name, device, bytes, storage.

    Sees eager forwards and torch.compile's tracing (fake tensors: no storage). Nests.
    """
    log = RetentionLog()
    _observers.append(log)
    try:
        yield log
    finally:
        _observers.remove(log)


def _notify(block: str, func: Any, ctx: Any) -> None:
    outputs = [t for t in tree_leaves(getattr(ctx, "op_output", None)) if isinstance(t, torch.Tensor)]
    records = []
    for tensor in outputs:
        real = type(tensor) in (torch.Tensor, torch.nn.Parameter)
        storage = StorageWeakRef(tensor.untyped_storage()) if real else None
        records.append(RetainedOutput(block, func.name(), tensor.device, tensor.nbytes, storage))
    if not records:
        records.append(RetainedOutput(block, func.name(), torch.device("meta"), 0, None))
    for log in _observers:
        log.outputs.extend(records)


def _notify_copy(func: Any, copies: list[torch.Tensor]) -> None:
    # A routing output is kept as a copy (routers normalise top-k weights in place): the copy is what is retained.
    for log in _observers:
        tail = log.outputs[-len(copies) :] if copies else []
        if len(tail) == len(copies) and all(r.op == func.name() for r in tail):
            log.outputs[-len(copies) :] = [
                RetainedOutput(r.block, r.op, t.device, t.nbytes, StorageWeakRef(t.untyped_storage()))
                for r, t in zip(tail, copies, strict=True)
            ]


class BlockRetention:
    """What one checkpointed call's forward retained, and the attention-like ops it saw but did not retain.

    ``retained`` leaves out :data:`ROUTING_OPS` and collectives: kept in every MoE or context-parallel block, they
    say nothing of its attention."""

    __slots__ = ("retained", "seen_attention")

    def __init__(self) -> None:
        self.retained: set[str] = set()
        self.seen_attention: set[str] = set()


def collective_decision(
    keeper: CollectiveKeeper | None, wanted: bool, name: str, args: tuple, kwargs: dict[str, Any], out: Any
) -> CheckpointPolicy | None:
    """A collective's or a wait's policy in a checkpointed call (None for any other op): a ``wanted`` functional
    collective is kept where ``keeper`` finds it moves activations, a wait where it waits on a kept output;
    without a keeper (under torch.compile) none is."""
    if not is_collective(name):
        return None
    if keeper is None:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if name.partition(".")[0] == WAIT_TENSOR:
        return CheckpointPolicy.MUST_SAVE if keeper.waits_on_kept(args) else CheckpointPolicy.PREFER_RECOMPUTE
    if wanted and is_keepable_collective(name) and keeper.moves_activations(args, kwargs):
        keeper.kept(out)
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def collective_keeper(retained: Iterable[str], module: nn.Module | None) -> CollectiveKeeper | None:
    """A :class:`~ac_core.collectives.CollectiveKeeper` for one call of ``module`` where ``retained`` names a
    collective it could keep and a process group is up (None where none is, where it names none, or where no
    module is given: under torch.compile). Without a process group no collective runs: nothing to follow."""
    if module is None or not any(is_keepable_collective(name) for name in retained):
        return None
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    return CollectiveKeeper(block_state(module))


def _policy(
    retained: frozenset[str],
    block: str,
    record: BlockRetention | None,
    keeper: CollectiveKeeper | None,
    ctx: Any,
    func: Any,
    *args: Any,
    **kwargs: Any,
) -> CheckpointPolicy:
    name = func.name()  # "aten::mul.Tensor"; a default overload has no suffix
    out = getattr(ctx, "op_output", None)
    wanted = op_matches(name, retained)
    collective = collective_decision(keeper, wanted, name, args, kwargs, out)
    if keeper is not None:
        keeper.saw(args, kwargs, out)
    if collective is not None:
        if collective == CheckpointPolicy.MUST_SAVE and _observers and name.partition(".")[0] != WAIT_TENSOR:
            _notify(block, func, ctx)  # a wait keeps its collective's output: counted there
        return collective
    if wanted:
        if record is not None and not op_matches(name, ROUTING_OPS):
            record.retained.add(name)
        if _observers:
            _notify(block, func, ctx)
        return CheckpointPolicy.MUST_SAVE
    if record is not None and is_attention_like(name):
        record.seen_attention.add(name)
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_context(
    retained: frozenset[str], block: str = "", record: BlockRetention | None = None, module: nn.Module | None = None
) -> Any:
    """``context_fn`` for torch.utils.checkpoint: retain ``retained`` op outputs, recompute the rest. A collective
    in ``retained`` is kept where it moves activations of ``module`` (the block), never its parameters, and with
    no ``module`` (torch.compile's route) never.

    Bound with functools.partial (not a closure) because torch.compile accepts only a plain
    function or a partial of constants as ``context_fn``.
    """
    keeper = collective_keeper(retained, module)
    return selective_contexts(
        functools.partial(_policy, retained, block, record, keeper), copied=ROUTING_OPS, on_copy=_notify_copy
    )


def warn_nothing_retained(block: str, record: BlockRetention) -> None:
    """Log, once per process, that an ``ops`` block retained nothing and so recomputes in full."""
    seen = (
        f"it ran attention through {sorted(record.seen_attention)}, which is not retained"
        if record.seen_attention
        else "it ran no op that looks like attention (a math or Python-level attention decomposes into small ops)"
    )
    warn_once(
        "ops-retained-nothing",
        "ac-core: 'ops' retained nothing in checkpointed block %s, so it recomputes in full, as under 'full': %s. "
        "Switch the model to an attention backend its adapter declares retainable, or name the kernel with "
        "apply_activation_checkpointing(model, ac_core.Ops(retain={'namespace::op'})).",
        block,
        seen,
    )
