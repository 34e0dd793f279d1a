"""What each block holds for backward and what recomputing it costs, op occurrence by op occurrence.

One forward of the whole model, unchecked, under :func:`~ac_core.measure.held_for_backward` gives the bytes
``none`` holds and, through a pre-hook on every block, each block's inputs. Then each block is run again alone,
under a ``FlopCounterMode`` (with our CPU SDPA formulas) and a ``TorchDispatchMode`` that notes, per op call, its
name, its occurrence index among calls of that name in the block's forward, the FLOPs it adds and the bytes of the
storages it creates (see :class:`ProfileKey` for why no block reuses another's profile). Everything is a function
of shapes, so it runs on real, ``meta`` or fake tensors alike.

On real tensors these forwards leave no trace (see :mod:`._isolation`): the RNG, the model's parameters, buffers
and ``training`` flags and the example inputs are as they were afterwards, and the user's forward hooks do not
fire. A block that changes its input in place (``x.mul_(0.5)``, legal in the plain model) cannot be checkpointed
(recompute would start from the changed input; ac-core's checkpoint refuses it), so planning refuses it too,
naming the block, the input and the op, and the fixes; a block alone runs on copies of its inputs that are not
leaves, as in the model's forward, so that it gets that far. Any other failure in a planning forward is an error
naming the block (path and class) and the op that raised.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_map

from .. import _chain, _checkpoint
from .._recompute import named_tensors
from ..blocks import Block, ModelBlocks
from ..collectives import (
    CollectiveKeeper,
    agreed,
    block_state,
    group_name,
    group_size,
    is_collective,
    is_keepable_collective,
    settle,
)
from ..measure.flops import GlobalFlopCounter
from ..measure.memory import held_for_backward, live_nbytes, new_storages, plain_tensors, storage_ref
from ..op_names import op_matches
from ..ops import ROUTING_OPS
from ..policies.modes import BlockMode
from ._isolation import CopyOnWrite, isolated, written
from .offload_cost import InputRecorder, SavedInputs
from .roofline import op_time

if TYPE_CHECKING:
    from .devices import Device

# One tensor argument of a block: (argument, shape, dtype). The argument is its position ("0") or keyword name,
# with a pytree path suffix for tensors inside containers ("rotary[1]").
TensorSignature = tuple[str, tuple[int, ...], str]
Signature = tuple[TensorSignature, ...]


def signature(args: tuple, kwargs: dict[str, Any]) -> Signature:
    """The shapes and dtypes of every tensor in a call's arguments, named by position or keyword."""
    return tuple((name, tuple(t.shape), str(t.dtype)) for name, t in named_tensors(args, kwargs))


class ProfileKey(NamedTuple):
    """What one block profile stands for: a block at its first call's input signature. Each block is profiled on its
    own: blocks of one class at the same shapes may still run other ops (a flag set per block, an in-place op on an
    intermediate in one of them, SD3's last block with ``context_pre_only``), so a plan made from another block's
    profile could keep an output this one changes, or recompute what it does not run."""

    path: str
    signature: Signature


def describe_signature(sig: Signature) -> str:
    return ", ".join(f"{name}: {list(shape)} {dtype.removeprefix('torch.')}" for name, shape, dtype in sig) or "none"


@dataclass(frozen=True)
class OpOccurrence:
    """One op call in a block's forward: ``op`` (``"aten::addmm"``), its ``index`` among calls of that op, the
    bytes its output storages take (what keeping it holds for backward) and its FLOPs (what recomputing it costs).

    ``bytes_moved``: the storages it reads (its tensor arguments) plus those it writes (new outputs, in-place
    targets), each storage counted once per side; none for a view. ``dtype``: its first floating output's
    (``"bfloat16"``), ``None`` without one. ``ranks``: for a collective, the ranks its group spans (a
    context-parallel all-to-all: ``cp``), else 1; ``moves_parameters``: a collective that moves the block's
    parameters (an all-gather of a weight shard), which nothing keeps. With the FLOPs they give its roofline time
    (:mod:`.roofline`), a collective's over the interconnect."""

    op: str
    index: int
    nbytes: int
    flops: int
    bytes_moved: int = 0
    dtype: str | None = None
    ranks: int = 1
    moves_parameters: bool = False


@dataclass(frozen=True)
class BlockProfile:
    """A block class at one input signature: what ``none`` holds, its forward FLOPs, and its keepable ops.

    ``recompute_flops``: what checkpointing it whole recomputes. torch's checkpoint stops recomputing once the
    last tensor the forward saved for backward is recomputed (early stop, on by default), and autograd saves an
    op's inputs before running it, so the ops from the one saving last on are never recomputed (in the toy
    block, the MLP's second matmul). ``candidates`` are the op occurrences worth keeping: recomputed (before
    that point), with FLOPs to save and a new output storage to hold, which no later op of the block changes in
    place (``h.mul_(s)`` after the matmul making ``h``: a kept output must stay the op's output), and which run
    before the block first lets tensor values decide its shapes or control flow (see :class:`_ValueReads`).
    ``routing``: the recomputed occurrences of :data:`~ac_core.ops.ROUTING_OPS`, which every plan keeps.
    ``recomputed``: every occurrence recomputing it whole runs, timed by :meth:`recompute_seconds`.
    ``timed_candidates``: the candidates and the keepable ops without FLOPs (a GELU, a norm: memory-bound; a
    functional collective moving activations, which takes its time on the interconnect), worth keeping where
    recompute is costed in time; a collective moving the block's parameters never is. ``forward``: every op call
    of its forward, in order. ``group``: the process group its collectives ran over (None: none ran over more
    than one rank).
    """

    class_name: str
    signature: Signature
    none_bytes: int
    forward_flops: int
    recompute_flops: int
    candidates: tuple[OpOccurrence, ...]
    calls: int = 1  # per forward; the figures above are for all of them
    routing: tuple[OpOccurrence, ...] = ()
    recomputed: tuple[OpOccurrence, ...] = ()  # every op recompute_flops sums
    timed_candidates: tuple[OpOccurrence, ...] = ()
    forward: tuple[OpOccurrence, ...] = ()
    group: str | None = None

    def recompute_seconds(self, device: Device) -> float:
        """Predicted seconds of checkpointing it whole on ``device``: the roofline times of the ops it recomputes."""
        return sum(op_time(op, device).seconds for op in self.recomputed)

    @property
    def routing_bytes(self) -> int:
        """What keeping the routing decision holds: what the block holds checkpointed, keeping nothing else."""
        return sum(op.nbytes for op in self.routing)

    @property
    def keep_all_bytes(self) -> int:
        return sum(op.nbytes for op in self.candidates) + self.routing_bytes


@dataclass(frozen=True)
class ModelProfile:
    """Every block's profile (by path, in order), what ``none`` holds in all, and what lies outside the blocks.

    ``outside_bytes``: held for backward by everything but the blocks' own ops (block inputs included) under
    ``none``. ``checkpoint_input_bytes``: block inputs made in the forward that ``none`` frees before backward
    (Wan's timestep projection: the block only adds it to a table) but a checkpointed block keeps for its
    recompute. A plan holds ``min_bytes`` (once any block is checkpointed) + what each block holds, less what
    offload moves of ``saved_inputs`` (the blocks' inputs their checkpoints save, see :mod:`.offload`).
    """

    model_class: str
    inputs: Signature
    blocks: tuple[tuple[str, BlockProfile], ...]
    none_bytes: int
    checkpoint_input_bytes: int = 0
    full_bytes: int | None = None
    saved_inputs: SavedInputs = field(default_factory=SavedInputs)

    @property
    def min_bytes(self) -> int:
        """What every plan that checkpoints a block holds besides its blocks' parts: the least any plan holds.

        ``full_bytes`` where known: what the forward holds with every block checkpointed whole, measured by
        :func:`profile_model` (one forward so) and by a profiled step from where its storages were made (see
        :mod:`.step`). The rest inferred from the blocks' own profiles comes short where a block alone holds
        more than its part of the whole forward (a transformers model with its KV cache on: run alone after the
        forward, a block finds the cache full, and the forward's cache holds every block's keys and values).
        """
        if self.full_bytes is not None:
            return self.full_bytes
        return self.outside_bytes + self.checkpoint_input_bytes

    @property
    def routing_bytes(self) -> int:
        """What every block's routing decision holds: part of any plan that checkpoints all blocks."""
        return sum(profile.routing_bytes for _, profile in self.blocks)

    @property
    def outside_bytes(self) -> int:
        return max(0, self.none_bytes - sum(profile.none_bytes for _, profile in self.blocks))

    @property
    def group(self) -> str | None:
        """The process group the blocks' collectives ran over (the first block's that ran any), None where none
        did: every rank of it profiled together."""
        return next((p.group for _, p in self.blocks if p.group is not None), None)


def _decides_shapes(func: Any, args: tuple) -> bool:
    """Whether an op call reads tensor values (``.item()`` inside a kernel) or gives an output whose shape they
    decide (``nonzero``, ``bincount``); indexing decides it only with a boolean mask."""
    tags = getattr(func, "tags", ())
    if torch.Tag.data_dependent_output in tags:
        return True
    if torch.Tag.dynamic_output_shape not in tags:
        return False
    if func is torch.ops.aten.index.Tensor:
        indices = args[1] if len(args) > 1 else ()
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)
    return True


class _OpRecorder(TorchDispatchMode):
    """Per op call: name, occurrence, FLOPs (read off the flop counter below it), bytes of new storages, bytes
    moved and dtype; and which calls' outputs a later op changes in place (``mutated``, by position in ``ops``),
    which a selective checkpoint cannot keep (the kept value would no longer be the op's output); for a functional
    collective, the ranks of its group and whether it moves the block's parameters; and ``values_decide``: the
    position of the first call after which tensor values, not shapes, may decide what the block runs."""

    def __init__(self, counter: GlobalFlopCounter, keeper: CollectiveKeeper | None = None) -> None:
        super().__init__()
        self.counter = counter
        self.keeper = keeper if keeper is not None else CollectiveKeeper(())  # no state: every input an activation
        self.seen: dict[str, int] = defaultdict(int)
        self.ops: list[OpOccurrence] = []
        self.made_by: dict[int, int] = {}  # storage -> position of the op call that made it
        self.mutated: set[int] = set()
        self.values_decide: int | None = None
        self.group: str | None = None  # the process group of the first collective over more than one rank

    def values_read(self) -> None:
        if self.values_decide is None:
            self.values_decide = len(self.ops)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if _decides_shapes(func, args):
            self.values_read()
        for tensor in written(func, args, kwargs):
            made_by = self.made_by.get(storage_ref(tensor).cdata)
            if made_by is not None:
                self.mutated.add(made_by)
        before = self.counter.get_total_flops()
        out = func(*args, **kwargs)
        name = func.name()
        index = self.seen[name]
        self.seen[name] += 1
        made = {ref.cdata: ref for ref in new_storages(func, out)}
        self.made_by |= dict.fromkeys(made, len(self.ops))
        nbytes = sum(live_nbytes(ref) for ref in made.values())
        flops = self.counter.get_total_flops() - before
        moved = _moved(func, args, kwargs, made.values())
        ranks, parameters = 1, False
        if is_keepable_collective(name):
            group = group_name(func, args, kwargs)
            ranks = group_size(group)
            self.group = self.group or (group if ranks > 1 else None)
            parameters = not self.keeper.moves_activations(args, kwargs)
        self.keeper.saw(args, kwargs, out)
        self.ops.append(OpOccurrence(name, index, nbytes, flops, moved, _float_dtype(out), ranks, parameters))
        return out


def _keepable_collective(op: OpOccurrence) -> bool:
    """True for any op but a collective no plan may keep: a wait, c10d's own, one moving parameters."""
    return not is_collective(op.op) or (is_keepable_collective(op.op) and not op.moves_parameters)


def _moved(func: Any, args: tuple, kwargs: dict, made: Iterable[StorageWeakRef]) -> int:
    """Bytes an op call moves: the storages of its tensor arguments (read) plus those it makes or changes in place
    (written), each once per side; a view moves nothing."""
    if getattr(func, "is_view", False):
        return 0
    reads = {storage_ref(t).cdata: t.untyped_storage().nbytes() for t in plain_tensors((args, kwargs))}
    writes = {ref.cdata: live_nbytes(ref) for ref in made}
    writes |= {storage_ref(t).cdata: t.untyped_storage().nbytes() for t in written(func, args, kwargs)}
    return sum(reads.values()) + sum(writes.values())


class _Collectives(TorchDispatchMode):
    """The process groups of the functional collectives run inside it, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.groups: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if is_keepable_collective(func.name()):
            group = group_name(func, args, kwargs)
            if group is not None and group not in self.groups:
                self.groups.append(group)
        return func(*args, **kwargs)


def _settled(run: Callable[[], Any]) -> Callable[[], Any]:
    """``run``, then :func:`~ac_core.collectives.settle` over the groups its collectives ran over, so that what is
    measured alive after it is the same on every run and rank; the barrier outside every mode (no op of the
    block)."""

    def settled() -> Any:
        with _Collectives() as seen:
            out = run()
        if seen.groups:
            with _disable_current_modes():
                settle(seen.groups)
        return out

    return settled


def _float_dtype(out: Any) -> str | None:
    first = next((t for t in plain_tensors(out) if t.is_floating_point()), None)
    return None if first is None else str(first.dtype).removeprefix("torch.")


# Tensor methods that hand a tensor's values to Python (``.tolist()`` reaches no dispatcher op).
_PYTHON_READS = frozenset({"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "__complex__"})


class _ValueReads(TorchFunctionMode):
    """Tells ``recorder`` where the block first hands tensor values to Python. From there on the block may run
    other ops, or as many at other shapes, for other values of the same shapes: an MoE block runs one matmul per
    expert its tokens were routed to (transformers' eager experts), or splits tokens by ``counts.tolist()``
    (DeepSeek-V3's reference code). A plan names an op call by its order among the block's calls of that op
    (``mm#7``), which then names another expert's matmul, at another size, in the next batch: so no candidate
    is taken from there on (measured: a Mixtral plan made at one batch held more than its budget at another)."""

    def __init__(self, recorder: _OpRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if getattr(func, "__name__", None) in _PYTHON_READS:
            self.recorder.values_read()
        return func(*args, **(kwargs or {}))


def _float_mask(mask: Any, dtype: torch.dtype) -> Any:
    """A boolean mask as torch's SDPA hands it to the CPU kernel: 0 where attended, -inf elsewhere (same ops)."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        return mask
    attend = torch.scalar_tensor(0.0, dtype=dtype, device=mask.device)
    masked = torch.scalar_tensor(-math.inf, dtype=dtype, device=mask.device)
    return torch.where(mask, attend, masked)


_SDPA = torch.nn.functional.scaled_dot_product_attention  # torch's own, whatever the name is bound to later


class _CpuAttentionOnMeta(TorchFunctionMode):
    """On ``meta`` tensors SDPA takes its math path (bmm, softmax, bmm), which is not what runs on a real CPU; route
    it to the fused CPU kernel, as on real CPU tensors, so that a meta plan is the plan of the real model."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is _SDPA:
            # Called positionally (torch) or by keyword (diffusers' dispatcher: query=, key=, value=).
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
            options = dict(zip(names, args, strict=False)) | kwargs
            q, k, v = options.get("query"), options.get("key"), options.get("value")
            # The CPU kernel takes grouped key/value heads (enable_gqa) as they are, as it does on real tensors.
            if isinstance(q, torch.Tensor) and q.device.type == "meta" and q.dim() == 4:
                return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q,
                    k,
                    v,
                    options.get("dropout_p", 0.0),
                    options.get("is_causal", False),
                    attn_mask=_float_mask(options.get("attn_mask"), q.dtype),
                    scale=options.get("scale"),
                )[0]
        return func(*args, **kwargs)


def _sdpa_in_backward(*args: Any, **kwargs: Any) -> Any:
    with _CpuAttentionOnMeta():
        return _SDPA(*args, **kwargs)


@contextmanager
def cpu_attention_on_meta_in_backward() -> Iterator[None]:
    """Within the block, ``torch.nn.functional.scaled_dot_product_attention`` routes meta tensors as
    :class:`_CpuAttentionOnMeta` does: for a backward, which runs no function mode of its caller's. A custom
    autograd Function may call SDPA in its backward (diffusers' context-parallel attention recomputes it there),
    and on meta the math path's sequence-squared scores (a planned Wan2.1-14B rank over 2: 1.3 TiB) are made by
    no real kernel. The name is bound back on leaving, on error too."""
    functional = torch.nn.functional
    bound = functional.scaled_dot_product_attention
    functional.scaled_dot_product_attention = _sdpa_in_backward
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = bound


def _detached_copy(value: Any) -> Any:
    def copy(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        return leaf.detach().clone().requires_grad_(leaf.requires_grad)

    return tree_map(copy, value)


def _fed(value: Any) -> Any:
    """Copies of a block's inputs to run it alone on: one that requires grad is made by an op (a clone), not a
    leaf, as in the model's forward, so a block changing its input in place (legal there) runs the same; the
    copies are made before the run, like the inputs of the block in the model, so none of them is counted."""

    def copy(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        alias = leaf.detach()
        return alias.requires_grad_().clone() if leaf.requires_grad else alias.clone()

    return tree_map(copy, value)


@contextmanager
def _unchecked(modules: list[nn.Module]) -> Iterator[None]:
    """Run ``modules`` with their plain forward: ac-core's layers (a plan applied before, its offload on the model)
    set aside, then put back."""
    saved = []
    for module in modules:
        chain = module.__dict__.pop(_chain.CHAIN_ATTR, None)
        if chain is None:
            continue
        forward = module.__dict__.pop("forward", None)
        if chain.previous_forward is not None:
            module.__dict__["forward"] = chain.previous_forward
        saved.append((module, chain, forward))
    try:
        yield
    finally:
        for module, chain, forward in saved:
            module.__dict__[_chain.CHAIN_ATTR] = chain
            module.__dict__.pop("forward", None)
            if forward is not None:
                module.__dict__["forward"] = forward


def _reads_values(exc: BaseException) -> bool:
    from torch._subclasses.fake_tensor import DataDependentOutputException

    if isinstance(exc, DataDependentOutputException):
        return True
    return isinstance(exc, RuntimeError) and "meta tensors" in str(exc)


def _planning_error(model: nn.Module, block: Block | None, op: str | None, exc: BaseException) -> ValueError:
    """What a planning forward that raised ``exc`` (in ``block``, at ``op``, where known) tells the user."""
    at = f" at {op}" if op else ""
    if _reads_values(exc):
        where = f" (in block {block.path!r}, {block.class_name})" if block is not None else ""
        return ValueError(
            f"{type(model).__name__}'s forward reads a tensor's value{where} ({exc}), which meta and fake tensors "
            "do not have, so it cannot be planned from shapes alone: plan it on real tensors (as few blocks as the "
            "memory at hand allows, at the real width and sequence length)"
        )
    if block is not None:
        return ValueError(
            f"planning failed in block {block.path!r} ({block.class_name}){at}: {type(exc).__name__}: {exc}. "
            "Leave that block unchecked (plan without it, e.g. blocks=[...] naming other containers), or, where "
            "it changes its input in place, clone its input first (x = x.clone()) in its forward"
        )
    return ValueError(
        f"planning ran {type(model).__name__}'s forward on example_inputs and it failed outside its blocks{at}: "
        f"{type(exc).__name__}: {exc}. Planning runs the forward alone, outside your training step; where it needs "
        "the step's context (a forward context, a context variable), plan from the step itself: "
        "ac_core.profile_step(model)"
    )


@contextmanager
def _failures_named(resolved: ModelBlocks, guard: CopyOnWrite, block: Block | None = None) -> Iterator[None]:
    """An error in a planning forward becomes :func:`_planning_error`'s, naming ``block``, or else the block the
    forward was in: entered (a pre-hook) and not left (a forward hook, which an exception skips)."""
    inside: list[Block] = []
    handles = []
    if block is None:
        for each in resolved:
            handles.append(each.module.register_forward_pre_hook(functools.partial(_entered, inside, each)))
            handles.append(each.module.register_forward_hook(functools.partial(_left, inside)))
    try:
        yield
    except torch.OutOfMemoryError:
        raise  # not the forward's fault; a training loop may handle it
    except Exception as exc:
        where = block if block is not None else inside[-1] if inside else None
        raise _planning_error(resolved.served_model, where, guard.failed_op(exc), exc) from exc
    finally:
        for handle in handles:
            handle.remove()


def _entered(inside: list[Block], block: Block, module: nn.Module, args: tuple) -> None:
    inside.append(block)


def _left(inside: list[Block], module: nn.Module, args: tuple, output: Any) -> None:
    inside.pop()


def call_model(model: nn.Module, example_inputs: Any) -> Any:
    """``model`` called on one forward's inputs: a dict of keyword arguments, a tuple of positional ones, a tensor."""
    if isinstance(example_inputs, dict):
        return model(**example_inputs)
    if isinstance(example_inputs, tuple):
        return model(*example_inputs)
    return model(example_inputs)


def inputs_signature(example_inputs: Any) -> Signature:
    if isinstance(example_inputs, dict):
        return signature((), example_inputs)
    if isinstance(example_inputs, tuple):
        return signature(example_inputs, {})
    return signature((example_inputs,), {})


def profile_alone(
    resolved: ModelBlocks, block: Block, call: Callable[..., Any], key: ProfileKey, args: tuple, kwargs: dict
) -> BlockProfile:
    """Profile ``block`` alone, ``call`` running it on :func:`_fed` copies of ``args`` and ``kwargs`` (grad
    enabled), :func:`~._isolation.isolated`; refuse a block that changes its input in place, naming the op."""
    with isolated(resolved.model) as guard, _failures_named(resolved, guard, block):
        args, kwargs = _fed(args), _fed(kwargs)
        inputs = named_tensors(args, kwargs)
        guard.watch(tensor for _, tensor in inputs)
        run = functools.partial(call, *args, **kwargs)
        profile = _profile_block(run, block.class_name, key, block_state(block.module))
    changed = [f"{name} by {guard.writers[id(tensor)]}" for name, tensor in inputs if id(tensor) in guard.writers]
    if changed:
        raise ValueError(
            f"block {block.path!r} ({block.class_name}) changes its input in place in its forward "
            f"({', '.join(changed)}): legal unchecked, but a checkpoint's recompute would start from the changed "
            "input, so it cannot be checkpointed. Clone its input first (x = x.clone()) in its forward, or leave "
            "that block unchecked (plan without it, e.g. blocks=[...] naming other containers)"
        )
    return profile


def _profile_block(
    run: Callable[[], Any], class_name: str, key: ProfileKey, state: Iterable[torch.Tensor] = ()
) -> BlockProfile:
    """Profile one call of a block: ``run`` calls it; ``state``: its parameters and buffers."""
    counter = GlobalFlopCounter()
    recorder = _OpRecorder(counter, CollectiveKeeper(state))
    packed_after = [0]  # ops run when the last saved tensor was packed

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        packed_after[0] = len(recorder.ops)
        # The tensor itself, packed, would tie an op's saved output to its own grad_fn: a cycle the garbage
        # collector cannot see, keeping the run's graph (and a fed input's storage) alive for good.
        with _disable_current_modes():
            return tensor.detach()

    reads = _ValueReads(recorder)
    with counter, recorder, reads, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        _, block_bytes = held_for_backward(_settled(run))
    recomputed = recorder.ops[: packed_after[0]]
    routing = [op for op in recomputed if op_matches(op.op, ROUTING_OPS)]
    stable = recomputed[: recorder.values_decide]
    keepable = [
        op
        for i, op in enumerate(stable)
        if i not in recorder.mutated and not op_matches(op.op, ROUTING_OPS) and _keepable_collective(op)
    ]
    return BlockProfile(
        class_name=class_name,
        signature=key.signature,
        none_bytes=block_bytes,
        forward_flops=counter.get_total_flops(),
        recompute_flops=sum(op.flops for op in recomputed),
        candidates=tuple(op for op in keepable if op.flops > 0 and op.nbytes > 0),
        routing=tuple(routing),
        recomputed=tuple(recomputed),
        timed_candidates=tuple(op for op in keepable if op.nbytes > 0),
        forward=tuple(recorder.ops),
        group=recorder.group,
    )


def _never_called(resolved: ModelBlocks, ran: Mapping[str, object]) -> str:
    """The error for blocks the example forward never called (a multimodal model given text only), with the
    ``blocks=[...]`` that leaves their containers out."""
    missing = [b.path for b in resolved if b.path not in ran]
    idle = [c.path for c in resolved.containers if any(b.path not in ran for b in c.blocks)]
    busy = [c.path for c in resolved.containers if c.path not in idle]
    fix = "plan with inputs that run them"
    if busy:
        fix += f", or leave {', '.join(idle)} out of the plan with blocks={busy!r}"
    return f"the forward on example_inputs never called block(s) {missing}; {fix}"


def profile_model(resolved: ModelBlocks, example_inputs: Any) -> ModelProfile:
    """Profile every block of ``resolved`` (from :func:`~ac_core.resolve_blocks`) at ``example_inputs`` (real, meta
    or fake tensors), each block on its own.

    Each of its forwards is :func:`~._isolation.isolated`: the model, the inputs, the RNG are as they were after
    it, and the user's forward hooks do not fire. A forward that fails raises :func:`_planning_error`'s error.
    """
    model = resolved.model
    blocks = list(resolved)
    captured: dict[str, tuple[tuple, dict[str, Any]]] = {}
    block_inputs: dict[int, tuple[StorageWeakRef, int]] = {}
    keys: dict[str, ProfileKey] = {}
    firsts: dict[ProfileKey, str] = {}
    calls: dict[str, int] = defaultdict(int)

    def pre_hook(path: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            for leaf in plain_tensors((args, kwargs)):
                ref = storage_ref(leaf)
                block_inputs.setdefault(ref.cdata, (ref, live_nbytes(ref)))
            calls[path] += 1
            if path in keys:
                return  # a block called again in the forward: profiled at its first call, counted per call
            key = ProfileKey(path, signature(args, kwargs))
            keys[path] = key
            if key not in firsts:
                firsts[key] = path
                with _disable_current_modes():  # the copy is ours, not something the forward holds
                    captured[path] = (_detached_copy(args), _detached_copy(kwargs))

        return hook

    handles = [b.module.register_forward_pre_hook(pre_hook(b.path), with_kwargs=True) for b in blocks]
    try:
        with (
            _unchecked([model, *(b.module for b in blocks)]),
            isolated(model, example_inputs) as guard,
            _failures_named(resolved, guard),
            torch.enable_grad(),
            _CpuAttentionOnMeta(),
        ):
            # Its result is not counted.
            _, none_bytes = held_for_backward(_settled(lambda: call_model(model, example_inputs)))
    finally:
        for handle in handles:
            handle.remove()
    # Alive when the forward began (the caller's inputs, parameters) or still held at its end: not extra. Freed
    # by then: made in the forward and dropped, which a checkpointed block would keep.
    freed_inputs = sum(nbytes for ref, nbytes in block_inputs.values() if ref.expired())
    if any(b.path not in keys for b in blocks):
        raise ValueError(_never_called(resolved, keys))

    profiles: dict[ProfileKey, BlockProfile] = {}
    by_path = {b.path: b for b in blocks}
    for key, path in firsts.items():
        block = by_path[path]
        args, kwargs = captured.pop(path)
        with _unchecked([block.module]), torch.enable_grad(), _CpuAttentionOnMeta():
            profiles[key] = profile_alone(resolved, block, block.module, key, args, kwargs)
    with isolated(model, example_inputs) as guard, _failures_named(resolved, guard):
        full_bytes, saved_inputs = _held_all_full(resolved, example_inputs)
    served = resolved.served_model
    profile = ModelProfile(
        model_class=f"{type(served).__module__}.{type(served).__qualname__}",
        inputs=inputs_signature(example_inputs),
        blocks=tuple((b.path, _per_forward(profiles[keys[b.path]], calls[b.path])) for b in blocks),
        none_bytes=none_bytes,
        checkpoint_input_bytes=freed_inputs,
        full_bytes=full_bytes,
        saved_inputs=saved_inputs,
    )
    # A context-parallel model's ranks measure their own forwards: each takes the first rank's (see agreed).
    return agreed(profile, profile.group)


def _per_forward(profile: BlockProfile, calls: int) -> BlockProfile:
    """``profile`` of one call, for a block called ``calls`` times per forward (a chunked encoder): every call
    holds and recomputes as much, and a kept occurrence is kept in each call."""
    if calls == 1:
        return profile
    return BlockProfile(
        class_name=profile.class_name,
        signature=profile.signature,
        none_bytes=calls * profile.none_bytes,
        forward_flops=calls * profile.forward_flops,
        recompute_flops=calls * profile.recompute_flops,
        candidates=_times(profile.candidates, calls),
        calls=calls,
        routing=_times(profile.routing, calls),
        recomputed=_times(profile.recomputed, calls),
        timed_candidates=_times(profile.timed_candidates, calls),
        forward=_times(profile.forward, calls),
        group=profile.group,
    )


def _times(ops: tuple[OpOccurrence, ...], calls: int) -> tuple[OpOccurrence, ...]:
    return tuple(
        dataclasses.replace(op, nbytes=calls * op.nbytes, flops=calls * op.flops, bytes_moved=calls * op.bytes_moved)
        for op in ops
    )


def _held_all_full(resolved: ModelBlocks, example_inputs: Any) -> tuple[int, SavedInputs]:
    """Bytes the model's forward holds for backward with every block checkpointed whole, as ac-core does it, and
    the inputs those checkpoints save that offload could move (see :class:`.offload.InputRecorder`)."""
    blocks = list(resolved)
    with _unchecked([resolved.model, *(b.module for b in blocks)]):
        for b in blocks:
            layer = _checkpoint.CheckpointLayer(
                BlockMode.FULL, frozenset(), b.path, b.expects_attention, root=resolved.model
            )
            _checkpoint.install(b.module, layer)
        try:
            with torch.enable_grad(), _CpuAttentionOnMeta(), InputRecorder(resolved, example_inputs) as recorder:
                out, held = held_for_backward(_settled(lambda: call_model(resolved.model, example_inputs)))
            saved = recorder.finish()  # while ``out`` keeps the forward's graph alive
            del out
        finally:
            for b in blocks:
                _checkpoint.uninstall(b.module)
    return held, saved
