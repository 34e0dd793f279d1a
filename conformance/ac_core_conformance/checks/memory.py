"""Check 4: bytes held for backward at the end of forward satisfy full < ops < none."""

from __future__ import annotations

from ac_core import apply_activation_checkpointing
from ac_core._containers import resolve_containers
from ac_core.measure import held_for_backward

from ..subjects import Subject
from ..training import build
from .attention import preferred_retainable_backend


def _held(subject: Subject, device: str, backend: str, policy: str | None, n_layer: int) -> int:
    case = build(subject, device, backend=backend)
    if policy is not None:
        apply_activation_checkpointing(case.model, policy, n_layer, adapter=subject.adapter)
    loss, held = held_for_backward(case.run)
    loss.backward()  # frees what forward held before the next measurement
    return held


def check_memory(subject: Subject, device: str = "cpu", *, n_layer: int = 2) -> dict[str, int]:
    """Bytes held for backward by policy (``none``, ``full``, ``ops``, ``block_skip``) on a retainable backend.

    Fails unless full < ops < none, and full <= block_skip < none (strictly above full when some
    container has a block that block_skip leaves unchecked).
    """
    backend = preferred_retainable_backend(subject, device)
    held = {name: _held(subject, device, backend, policy, n_layer) for name, policy in _POLICIES}
    figures = ", ".join(f"{name}={n:,} B" for name, n in held.items())
    what = f"{subject.id} on {device} (backend {backend!r}), held for backward at end of forward: {figures}"
    assert held["full"] < held["ops"] < held["none"], f"{what}: expected full < ops < none"
    assert held["full"] <= held["block_skip"] < held["none"], f"{what}: expected full <= block_skip < none"
    case = build(subject, device)
    containers = resolve_containers(case.model, subject.model.containers, subject.adapter.name)
    if any(len(blocks) > 1 for _, blocks in containers) and n_layer > 1:
        assert held["block_skip"] > held["full"], f"{what}: block_skip leaves blocks unchecked, so holds more"
    return held


_POLICIES = (("none", None), ("full", "full"), ("ops", "ops"), ("block_skip", "block_skip"))

__all__ = ["check_memory"]
