"""Check 3: under ``ops`` the attention kernel runs once per call in forward and never again in backward.

Also: each block makes the attention calls its adapter declares (counted per block); under every policy
backward reruns exactly the calls its block selections recompute (those of ``full`` blocks, none of blocks
that keep attention or are left unchecked), whatever the policy's class; retained outputs stay on the
compute device; and a backend declared not retainable warns once and still trains correctly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import pytest
import torch
from torch import nn

from ac_core import (
    DEFAULT_RETAINED_OPS,
    AttentionBackend,
    BlockSelection,
    Ops,
    PolicyConfig,
    apply_activation_checkpointing,
    observe_retention,
    op_matches,
    reset_warnings,
)
from ac_core.measure import OpCounter, attribute_ops
from ac_core.offload import OffloadConfig, apply_activation_offload, remove_activation_offload, use_offload_transport
from ac_core.offload.testing import RecordingTransport
from ac_core.ops import is_attention_like

from ..base import AdapterTests
from ..policies import Policy, as_policy, label, reruns, selections
from ..probes import capture_logs
from ..subjects import Subject
from ..training import EAGER_TOLERANCE, assert_same_step, build, plain_step, require_device, require_tiny
from ..training import step as train_step

AttentionContext = Callable[[nn.Module, str], AbstractContextManager]
"""A context entered around forward and backward of check 3 (model, device): e.g. activation offload."""


def no_context(model: nn.Module, device: str) -> AbstractContextManager:
    """The plain run: nothing around forward and backward."""
    return nullcontext()


@contextmanager
def offload_context(model: nn.Module, device: str) -> Iterator[RecordingTransport | None]:
    """Activation offload of every saved tensor, whatever its size, around the step.

    On CUDA it is ac-core's own device path; elsewhere the recording test double stands in for it
    (it copies for real and records what moved), so the check also runs on a machine without a GPU.
    """
    config = OffloadConfig(min_tokens=1, min_bytes=0, token_count=lambda model, inputs: 1)
    transport = None if torch.device(device).type == "cuda" else RecordingTransport(torch.device(device).type)
    with use_offload_transport(transport) if transport is not None else nullcontext():
        apply_activation_offload(model, config)
        try:
            yield transport
        finally:
            remove_activation_offload(model)
    if transport is not None:
        assert not transport.violations, f"activation offload broke its copy contract: {transport.violations}"


@dataclass(frozen=True)
class AttentionCounts:
    """Attention kernel calls: per checkpointable block in a plain forward, and under a policy by phase."""

    per_block: dict[str, int]
    outside_blocks: int
    forward: int
    backward: int


def available_backend(subject: Subject, backend: str, device: str) -> AttentionBackend:
    """The declared backend, or a skip when it cannot run on ``device`` here."""
    declared = subject.adapter.backend(backend)
    require_device(device)
    if not declared.is_available(device):
        pytest.skip(
            f"attention backend {declared.name!r} is not available on {torch.device(device).type} here "
            f"(declared devices {list(declared.devices)}, requires {list(declared.requires)})"
        )
    return declared


def preferred_retainable_backend(subject: Subject, device: str) -> str:
    """The default backend when it is retainable and available, else the first such backend; else a skip."""
    require_device(device)
    candidates = [b for b in subject.adapter.backends if b.retainable and b.is_available(device)]
    for backend in candidates:
        if backend.name == subject.adapter.default_backend:
            return backend.name
    if candidates and subject.adapter.set_backend is not None:
        return candidates[0].name
    if not subject.adapter.backends and subject.adapter.default_backend is None:
        pytest.skip(f"adapter {subject.adapter.name!r} declares no attention backend")
    pytest.skip(
        f"adapter {subject.adapter.name!r} declares no retainable attention backend that runs on "
        f"{torch.device(device).type} here and can be selected"
    )


def _relative(fqn: str, served_path: str) -> str:
    """A block's path in the model its adapter serves (``attention_calls`` names blocks there)."""
    return fqn[len(served_path) + 1 :] if served_path else fqn


def _calls_per_block(subject: Subject, backend: AttentionBackend, device: str) -> tuple[dict[str, int], int]:
    """Kernel calls of ``backend`` per declared block in one plain forward, checked against attention_calls.

    On the default backend the tiny model runs as its factory built it (``set_backend`` is not called):
    the default backend must be what a freshly built model runs.
    """
    default = backend.name == subject.adapter.default_backend
    case = build(subject, device, backend=None if default else backend.name)
    resolved = subject.blocks(case.model)
    blocks = {block.path: block.module for block in resolved}
    # attention_calls' per-index counts are by position in the container (a ModuleDict's keys need not be numbers).
    index = {block.path: block.index for block in resolved}
    with torch.no_grad(), OpCounter() as ran, attribute_ops(blocks, lambda op: op_matches(op, backend.ops)) as counts:
        case.run()
    per_block = {fqn: counts.get(fqn, 0) for fqn in blocks}
    declared_calls = {
        fqn: subject.model.calls_of(type(b).__name__, index[fqn], _relative(fqn, resolved.served_path))
        for fqn, b in blocks.items()
    }
    if not any(per_block.values()) and any(declared_calls.values()):
        # Nothing declared ran at all: the op names are wrong, not the counts (or the switch did not take).
        seen = sorted(op for op in ran.forward if is_attention_like(op))
        raise AssertionError(
            f"{subject.id} on backend {backend.name!r} ({device}): none of its declared ops {list(backend.ops)} ran "
            "in one forward. "
            f"Attention-like ops that did run: {seen or 'none'}. Declare the op that carries the "
            "attention output in AttentionBackend.ops (a dispatcher name, as OpOverload.name() spells it), or "
            + (
                "check that the tiny factory builds the model on its default backend (the default backend is "
                "checked on the tiny model as built, without set_backend)."
                if default
                else "check that set_backend really switches this model to the backend."
            )
        )
    problems = []
    for fqn, block in blocks.items():
        cls = type(block).__name__
        declared = declared_calls[fqn]
        if declared is None and cls in subject.model.attention_calls:
            problems.append(f"attention_calls[{cls!r}] declares nothing for block index {index[fqn]} (at {fqn})")
        elif declared is None:
            problems.append(f"attention_calls declares nothing for block class {cls} (at {fqn})")
        elif per_block[fqn] != declared:
            problems.append(
                f"block {fqn} ({cls}) ran {backend.name!r}'s kernel {per_block[fqn]} times in one forward; "
                f"attention_calls declares {declared}"
            )
    if problems:
        raise AssertionError(
            f"{subject.id} on backend {backend.name!r} ({device}), kernel ops {list(backend.ops)}:\n  - "
            + "\n  - ".join(sorted(set(problems)))
        )
    return per_block, counts.get(None, 0)


def check_attention_retained(
    subject: Subject, backend: str, device: str = "cpu", *, context: AttentionContext = no_context
) -> AttentionCounts:
    """Under ``ops`` on a retainable ``backend``: its kernel runs once per attention call in forward, zero in backward.

    The calls per block must equal ``attention_calls``; every retained output must still be alive
    and on the compute device when forward ends (also under ``context``, e.g. activation offload).
    """
    require_tiny(subject)
    declared = available_backend(subject, backend, device)
    if not declared.retainable:
        raise ValueError(f"backend {backend!r} is declared not retainable; use check_not_retainable_backend")
    per_block, outside = _calls_per_block(subject, declared, device)
    case = build(subject, device, backend=declared.name)
    apply_activation_checkpointing(case.model, Ops(), adapter=subject.adapter)
    compute = torch.device(device).type
    with observe_retention() as retained, OpCounter() as counter, context(case.model, device) as around:
        loss = case.run()
        dead = [out.op for out in retained.outputs if not out.alive]
        elsewhere = sorted({f"{out.op} on {out.device}" for out in retained.outputs if out.device.type != compute})
        # A context that moves tensors off the device (offload's test double) says what it moved. A moved
        # storage still alive now is the same storage as a retained output exactly when their cdata match
        # (addresses of freed storages are reused, so data pointers would not do).
        offloaded = getattr(around, "offloaded", None)
        if offloaded is not None:
            assert offloaded, f"{subject.id}: the offload context moved nothing, so it proves nothing"
            moved = {r.source.cdata for r in offloaded if r.source is not None and not r.source.expired()}
            elsewhere += sorted(
                {
                    f"{out.op} offloaded"
                    for out in retained.outputs
                    if out.alive and out.storage is not None and out.storage.cdata in moved
                }
            )
        loss.backward()
    counts = AttentionCounts(
        per_block, outside, counter.count(declared.ops, "forward"), counter.count(declared.ops, "backward")
    )
    total = sum(per_block.values()) + outside
    what = f"{subject.id} under ops on backend {declared.name!r} ({device})"
    assert counts.forward == total, (
        f"{what}: the attention kernel ran {counts.forward} times in forward, expected once per attention call "
        f"({total})"
    )
    assert counts.backward == 0, (
        f"{what}: the attention kernel ran {counts.backward} times in backward; 'ops' should have retained its "
        f"output (declared ops {list(declared.ops)} are not what this backend runs?)"
    )
    kept = [op for op in retained.op_names if op_matches(op, declared.ops)]
    assert kept, f"{what}: 'ops' retained none of the backend's ops; it retained {sorted(retained.op_names)}"
    assert not dead, f"{what}: retained outputs of {sorted(set(dead))} were freed before forward ended"
    assert not elsewhere, f"{what}: retained outputs left the compute device ({compute}): {elsewhere}"
    return counts


def _reruns_kernel(kernel_ops: Iterable[str], selection: BlockSelection, op: str) -> bool:
    return op_matches(op, kernel_ops) and reruns(selection, op)


def attention_recomputes(
    subject: Subject, policy: Policy, device: str = "cpu", *, backend: str | None = None
) -> dict[str, int]:
    """Per declared block, the attention kernel calls backward reruns under ``policy``, by the blocks ac-core's
    policy registry selects: a block selected ``full`` reruns every call of its forward, one selected ``ops`` the
    calls of kernel ops it does not keep (none where it keeps attention); an unselected block is not checkpointed
    and reruns none.

    Counted in one plain forward on ``backend`` (None: the backend check 3 recomputes on,
    :func:`preferred_retainable_backend`).
    """
    config = as_policy(policy)
    declared = available_backend(subject, backend or preferred_retainable_backend(subject, device), device)
    case = build(subject, device, backend=declared.name)
    blocks = subject.blocks(case.model)
    chosen = selections(config, blocks)
    modules = {block.path: block.module for block in blocks}
    # One counter per distinct way of checkpointing a block (one or two for most policies), not one per block.
    ways = {(s.kind, s.retained): s for s in chosen.values()}
    with torch.no_grad(), ExitStack() as stack:
        counts = {
            way: stack.enter_context(attribute_ops(modules, functools.partial(_reruns_kernel, declared.ops, selection)))
            for way, selection in ways.items()
        }
        case.run()
    expected = dict.fromkeys(modules, 0)
    for path, s in chosen.items():
        expected[path] = counts[(s.kind, s.retained)][path]
    return expected


def check_attention_recomputed(subject: Subject, policy: Policy, device: str = "cpu") -> int:
    """Under any policy: backward reruns exactly the attention kernel calls :func:`attention_recomputes` expects of
    its block selections (all of a ``full`` block's; none of a block that keeps attention, as ``ops`` blocks do,
    or that is left unchecked).

    Returns the number of kernel calls recomputed.
    """
    config = as_policy(policy)
    backend = available_backend(subject, preferred_retainable_backend(subject, device), device)
    per_block, outside = _calls_per_block(subject, backend, device)
    expected = attention_recomputes(subject, config, device, backend=backend.name)
    case = build(subject, device, backend=backend.name)
    apply_activation_checkpointing(case.model, config, adapter=subject.adapter)
    with OpCounter() as counter:
        case.run().backward()
    forward, backward = counter.count(backend.ops, "forward"), counter.count(backend.ops, "backward")
    what = f"{subject.id} under {label(config)} on backend {backend.name!r} ({device})"
    assert forward == sum(per_block.values()) + outside, f"{what}: {forward} kernel calls in forward"
    rerun = {path: n for path, n in expected.items() if n}
    assert backward == sum(rerun.values()), (
        f"{what}: backward recomputed the attention kernel {backward} times; the policy's block selections rerun "
        f"{sum(rerun.values())} calls ({rerun or 'no block reruns attention'}; blocks that keep attention or are "
        "unchecked rerun none)"
    )
    return backward


def check_not_retainable_backend(subject: Subject, backend: str, device: str = "cpu") -> str:
    """A backend declared not retainable: ``ops`` logs the "retained nothing" warning once, and trains like plain.

    Returns the warning's message.
    """
    require_tiny(subject)
    declared = available_backend(subject, backend, device)
    if declared.retainable:
        raise ValueError(f"backend {backend!r} is declared retainable; use check_attention_retained")
    expected = plain_step(subject, device, backend=declared.name)
    case = build(subject, device, backend=declared.name)
    apply_activation_checkpointing(case.model, Ops(), adapter=subject.adapter)
    reset_warnings()  # once per process: start as a fresh process would
    with capture_logs() as records:
        got = train_step(case)
        for parameter in case.model.parameters():
            parameter.grad = None
        case.run().backward()
    warnings = [r.getMessage() for r in records if "retained nothing" in r.getMessage()]
    what = f"{subject.id} under ops on backend {declared.name!r} ({device}), declared not retainable"
    if not warnings:
        with torch.no_grad(), OpCounter() as ran:
            case.run()
        kept = sorted(op for op in ran.forward if op_matches(op, DEFAULT_RETAINED_OPS | subject.adapter.retained_ops()))
        raise AssertionError(
            f"{what}: no 'retained nothing' warning over two steps, so 'ops' retained something: the model ran "
            f"{kept or 'no retainable op'}. The backend was probably not switched (a processor that calls SDPA "
            "itself ignores the library's backend setting): make set_backend reach it, or declare the backend "
            "retainable with the ops it reaches."
        )
    assert len(warnings) == 1, f"{what}: expected one 'retained nothing' warning over two steps, got {len(warnings)}"
    assert_same_step(got, expected, EAGER_TOLERANCE, what)
    return warnings[0]


class AttentionTests(AdapterTests):
    """Check 3: declared calls per block; attention retained under ``ops``, rerun in backward exactly where the
    policy's block selections recompute it."""

    attention_contexts: Mapping[str, AttentionContext] = MappingProxyType(
        {"plain": no_context, "offload": offload_context}
    )
    """Contexts entered around forward and backward of the ``ops`` check, by id: plain, and with activation offload
    on (retained attention outputs must stay on the compute device). Add one to run the check under it too."""

    def _dimension(self, name: str, subject: Subject) -> list[Any]:
        if name == "attention_context":
            return [pytest.param(key, id=key) for key in self.attention_contexts]
        return super()._dimension(name, subject)

    def test_attention_retained(
        self, subject: Subject, retainable_backend: str, device: str, attention_context: str
    ) -> None:
        context = self.attention_contexts[attention_context]
        check_attention_retained(subject, retainable_backend, device, context=context)

    def test_attention_recomputed(self, subject: Subject, policy: PolicyConfig, device: str) -> None:
        check_attention_recomputed(subject, policy, device)

    def test_not_retainable_backend_warns_and_trains(
        self, subject: Subject, unretainable_backend: str, device: str
    ) -> None:
        check_not_retainable_backend(subject, unretainable_backend, device)


__all__ = [
    "AttentionContext",
    "AttentionCounts",
    "AttentionTests",
    "attention_recomputes",
    "available_backend",
    "check_attention_recomputed",
    "check_attention_retained",
    "check_not_retainable_backend",
    "no_context",
    "offload_context",
    "preferred_retainable_backend",
]
