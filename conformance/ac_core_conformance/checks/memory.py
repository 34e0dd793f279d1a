"""Check 4: bytes held for backward at the end of forward satisfy full < ops < none."""

from __future__ import annotations

from collections.abc import Sequence

from ac_core import Full, Ops, PolicyConfig, apply_activation_checkpointing, select
from ac_core.measure import held_for_backward

from ..base import AdapterTests
from ..policies import Policy, as_policy, default_policies, label
from ..subjects import Subject
from ..training import build
from .attention import preferred_retainable_backend


def _held(subject: Subject, device: str, backend: str, policy: PolicyConfig | None) -> int:
    case = build(subject, device, backend=backend)
    if policy is not None:
        apply_activation_checkpointing(case.model, policy, adapter=subject.adapter)
    loss, held = held_for_backward(case.run)
    loss.backward()  # frees what forward held before the next measurement
    return held


def _leaves_blocks_unchecked(subject: Subject, device: str, policy: PolicyConfig) -> bool:
    resolved = subject.blocks(build(subject, device).model)
    return len(select(policy, resolved)) < len(resolved)


def check_memory(subject: Subject, device: str = "cpu", *, policies: Sequence[Policy] | None = None) -> dict[str, int]:
    """Bytes held for backward without checkpointing (``none``), under ``full``, ``ops`` and each other policy
    (by default every registered one), on a retainable backend.

    Fails unless full < ops < none, and full <= other < none for each other policy (strictly above full
    where it leaves some block unchecked, as ``block_skip`` does).
    """
    backend = preferred_retainable_backend(subject, device)
    # full and ops at their defaults are the yardsticks; every other config, whatever its class, is measured too.
    yardsticks = (Full(), Ops())
    others = [
        config
        for config in map(as_policy, default_policies() if policies is None else policies)
        if config not in yardsticks
    ]
    none, full, ops = (_held(subject, device, backend, config) for config in (None, *yardsticks))
    held = {"none": none, Full.name: full, Ops.name: ops}
    held.update((label(config), _held(subject, device, backend, config)) for config in others)
    figures = ", ".join(f"{name}={n:,} B" for name, n in held.items())
    what = f"{subject.id} on {device} (backend {backend!r}), held for backward at end of forward: {figures}"
    assert full < ops < none, f"{what}: expected full < ops < none"
    for config in others:
        name = label(config)
        assert full <= held[name] < none, f"{what}: expected full <= {name} < none"
        if _leaves_blocks_unchecked(subject, device, config):
            assert held[name] > full, f"{what}: {name} leaves blocks unchecked, so holds more than full"
    return held


class MemoryTests(AdapterTests):
    """Check 4: bytes held for backward, full < ops < none; the figures are printed (``-s`` or ``-rA``)."""

    def test_memory(self, subject: Subject, device: str) -> None:
        held = check_memory(subject, device, policies=self._policies())
        figures = "  ".join(f"{policy}={n:,} B" for policy, n in held.items())
        print(f"ac-core held for backward, {subject.id} on {device}: {figures}")


__all__ = ["MemoryTests", "check_memory"]
