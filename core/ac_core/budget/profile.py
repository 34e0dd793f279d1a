"""What each block holds for backward and what recomputing it costs, op occurrence by op occurrence.

One forward of the whole model, unchecked, under :func:`~ac_core.measure.held_for_backward` gives the bytes
``none`` holds and, through a pre-hook on every block, each block's inputs. Then one block per (block class,
input shapes) is run again alone, under a ``FlopCounterMode`` (with our CPU SDPA formulas) and a
``TorchDispatchMode`` that notes, per op call, its name, its occurrence index among calls of that name in the
block's forward, the FLOPs it adds and the bytes of the storages it creates. The rest of the blocks reuse that
profile. Everything is a function of shapes, so it runs on real, ``meta`` or fake tensors alike.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from .. import _chain, _checkpoint
from ..measure.flops import GlobalFlopCounter
from ..measure.memory import held_for_backward, live_nbytes, new_storages, plain_tensors, storage_ref
from ..plan import BlockPlan
from ..policy import CheckpointType
from .offload import InputRecorder, SavedInputs

# One tensor argument of a block: (argument, shape, dtype). The argument is its position ("0") or keyword name,
# with a pytree path suffix for tensors inside containers ("rotary[1]").
TensorSignature = tuple[str, tuple[int, ...], str]
Signature = tuple[TensorSignature, ...]


def signature(args: tuple, kwargs: dict[str, Any]) -> Signature:
    """The shapes and dtypes of every tensor in a call's arguments, named by position or keyword."""
    found: list[TensorSignature] = []
    for name, value in [*((str(i), a) for i, a in enumerate(args)), *sorted(kwargs.items())]:
        leaves, _ = tree_flatten(value)
        single = len(leaves) == 1
        for index, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                found.append((name if single else f"{name}[{index}]", tuple(leaf.shape), str(leaf.dtype)))
    return tuple(found)


def describe_signature(sig: Signature) -> str:
    return ", ".join(f"{name}: {list(shape)} {dtype.removeprefix('torch.')}" for name, shape, dtype in sig) or "none"


@dataclass(frozen=True)
class OpOccurrence:
    """One op call in a block's forward: ``op`` (``"aten::addmm"``), its ``index`` among calls of that op, the
    bytes its output storages take (what keeping it holds for backward) and its FLOPs (what recomputing it costs)."""

    op: str
    index: int
    nbytes: int
    flops: int


@dataclass(frozen=True)
class BlockProfile:
    """A block class at one input signature: what ``none`` holds, its forward FLOPs, and its keepable ops.

    ``recompute_flops``: what checkpointing it whole recomputes. torch's checkpoint stops recomputing once the
    last tensor the forward saved for backward is recomputed (early stop, on by default), and autograd saves an
    op's inputs before running it, so the ops from the one saving last on are never recomputed (in the toy
    block, the MLP's second matmul). ``candidates`` are the op occurrences worth keeping: recomputed (before
    that point), with FLOPs to save and a new output storage to hold.
    """

    class_name: str
    signature: Signature
    none_bytes: int
    forward_flops: int
    recompute_flops: int
    candidates: tuple[OpOccurrence, ...]
    calls: int = 1  # per forward; the figures above are for all of them

    @property
    def keep_all_bytes(self) -> int:
        return sum(op.nbytes for op in self.candidates)


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

        ``full_bytes`` where measured (one forward with every block checkpointed whole): a block's own profile
        can hold a little more than its part of the whole model's forward (transformers' Llama: a tensor made
        once and shared between blocks), so the rest inferred from it would come short by as much.
        """
        if self.full_bytes is not None:
            return self.full_bytes
        return self.outside_bytes + self.checkpoint_input_bytes

    @property
    def outside_bytes(self) -> int:
        return max(0, self.none_bytes - sum(profile.none_bytes for _, profile in self.blocks))


class _OpRecorder(TorchDispatchMode):
    """Per op call: name, occurrence, FLOPs (read off the flop counter below it) and bytes of new storages."""

    def __init__(self, counter: GlobalFlopCounter) -> None:
        super().__init__()
        self.counter = counter
        self.seen: dict[str, int] = defaultdict(int)
        self.ops: list[OpOccurrence] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        before = self.counter.get_total_flops()
        out = func(*args, **(kwargs or {}))
        name = func.name()
        index = self.seen[name]
        self.seen[name] += 1
        nbytes = sum(live_nbytes(ref) for ref in {ref.cdata: ref for ref in new_storages(func, out)}.values())
        self.ops.append(OpOccurrence(name, index, nbytes, self.counter.get_total_flops() - before))
        return out


def _float_mask(mask: Any, dtype: torch.dtype) -> Any:
    """A boolean mask as torch's SDPA hands it to the CPU kernel: 0 where attended, -inf elsewhere (same ops)."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        return mask
    attend = torch.scalar_tensor(0.0, dtype=dtype, device=mask.device)
    masked = torch.scalar_tensor(-math.inf, dtype=dtype, device=mask.device)
    return torch.where(mask, attend, masked)


class _CpuAttentionOnMeta(TorchFunctionMode):
    """On ``meta`` tensors SDPA takes its math path (bmm, softmax, bmm), which is not what runs on a real CPU; route
    it to the fused CPU kernel, as on real CPU tensors, so that a meta plan is the plan of the real model."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
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


def _detached_copy(value: Any) -> Any:
    def copy(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        return leaf.detach().clone().requires_grad_(leaf.requires_grad)

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


@contextmanager
def _values_needed(model: nn.Module) -> Iterator[None]:
    """Name the fix where the model's forward reads a tensor's value, which meta and fake tensors do not have."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    try:
        yield
    except (RuntimeError, DataDependentOutputException) as exc:
        if not isinstance(exc, DataDependentOutputException) and "meta tensors" not in str(exc):
            raise
        raise ValueError(
            f"{type(model).__name__}'s forward reads a tensor's value ({exc}), which meta and fake tensors do not "
            "have, so it cannot be planned from shapes alone: plan it on real tensors (as few blocks as the "
            "memory at hand allows, at the real width and sequence length)"
        ) from exc


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


def profile_model(plan: BlockPlan, example_inputs: Any) -> ModelProfile:
    """Profile every block of ``plan`` at ``example_inputs`` (real, meta or fake tensors), once per class and shapes."""
    model = plan.model
    blocks = list(plan)
    captured: dict[str, tuple[tuple, dict[str, Any]]] = {}
    block_inputs: dict[int, tuple[StorageWeakRef, int]] = {}
    keys: dict[str, tuple[str, Signature]] = {}
    firsts: dict[tuple[str, Signature], str] = {}
    calls: dict[str, int] = defaultdict(int)

    def pre_hook(path: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            for leaf in plain_tensors((args, kwargs)):
                ref = storage_ref(leaf)
                block_inputs.setdefault(ref.cdata, (ref, live_nbytes(ref)))
            calls[path] += 1
            if path in keys:
                return  # a block called again in the forward: profiled at its first call, counted per call
            key = (type(module).__qualname__, signature(args, kwargs))
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
            torch.enable_grad(),
            _CpuAttentionOnMeta(),
            _values_needed(plan.served_model),
        ):
            _, none_bytes = held_for_backward(lambda: call_model(model, example_inputs))  # its result is not counted
    finally:
        for handle in handles:
            handle.remove()
    # Alive when the forward began (the caller's inputs, parameters) or still held at its end: not extra. Freed
    # by then: made in the forward and dropped, which a checkpointed block would keep.
    freed_inputs = sum(nbytes for ref, nbytes in block_inputs.values() if ref.expired())
    missing = [b.path for b in blocks if b.path not in keys]
    if missing:
        raise ValueError(
            f"the forward on example_inputs never called block(s) {missing}; plan with inputs that run them"
        )

    profiles: dict[tuple[str, Signature], BlockProfile] = {}
    by_path = {b.path: b.module for b in blocks}
    for key, path in firsts.items():
        args, kwargs = captured[path]
        with _unchecked([by_path[path]]), torch.enable_grad(), _CpuAttentionOnMeta():
            counter = GlobalFlopCounter()
            recorder = _OpRecorder(counter)
            packed_after = [0]  # ops run when the last saved tensor was packed

            def pack(tensor: torch.Tensor) -> torch.Tensor:
                packed_after[0] = len(recorder.ops)  # noqa: B023
                return tensor

            with counter, recorder, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                _, block_bytes = held_for_backward(lambda: by_path[path](*args, **kwargs))  # noqa: B023
        recomputed = recorder.ops[: packed_after[0]]
        profiles[key] = BlockProfile(
            class_name=type(by_path[path]).__name__,
            signature=key[1],
            none_bytes=block_bytes,
            forward_flops=counter.get_total_flops(),
            recompute_flops=sum(op.flops for op in recomputed),
            candidates=tuple(op for op in recomputed if op.flops > 0 and op.nbytes > 0),
        )
    full_bytes, saved_inputs = _held_all_full(plan, example_inputs)
    served = plan.served_model
    return ModelProfile(
        model_class=f"{type(served).__module__}.{type(served).__qualname__}",
        inputs=inputs_signature(example_inputs),
        blocks=tuple((b.path, _per_forward(profiles[keys[b.path]], calls[b.path])) for b in blocks),
        none_bytes=none_bytes,
        checkpoint_input_bytes=freed_inputs,
        full_bytes=full_bytes,
        saved_inputs=saved_inputs,
    )


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
        candidates=tuple(
            OpOccurrence(op.op, op.index, calls * op.nbytes, calls * op.flops) for op in profile.candidates
        ),
        calls=calls,
    )


def _held_all_full(plan: BlockPlan, example_inputs: Any) -> tuple[int, SavedInputs]:
    """Bytes the model's forward holds for backward with every block checkpointed whole, as ac-core does it, and
    the inputs those checkpoints save that offload could move (see :class:`.offload.InputRecorder`)."""
    blocks = list(plan)
    with _unchecked([plan.model, *(b.module for b in blocks)]):
        for b in blocks:
            layer = _checkpoint.CheckpointLayer(
                CheckpointType.FULL, frozenset(), b.path, b.expects_attention, root=plan.model
            )
            _checkpoint.install(b.module, layer)
        try:
            with torch.enable_grad(), _CpuAttentionOnMeta(), InputRecorder(plan, example_inputs) as recorder:
                out, held = held_for_backward(lambda: call_model(plan.model, example_inputs))
            saved = recorder.finish()  # while ``out`` keeps the forward's graph alive
            del out
        finally:
            for b in blocks:
                _checkpoint.uninstall(b.module)
    return held, saved
