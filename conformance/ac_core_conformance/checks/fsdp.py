"""Check 7: FSDP2 on every block and the root, with each policy, trains like a single plain process."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from ac_core import ModelBlocks, PolicyConfig, op_matches
from ac_core.collectives import is_collective

from ..base import AdapterTests
from ..distributed import fsdp_steps
from ..policies import Policy, as_policy, default_policies, kept_ops, label, selections
from ..subjects import Subject, portable_ref
from ..training import EAGER_TOLERANCE, Step, assert_same_step, build, plain_step, require_tiny

WORLD_SIZE = 2
"""CPU ranks (gloo) the check spawns."""


def _default_backend_ops(subject: Subject) -> tuple[str, ...]:
    """The kernel ops of the default backend where it is retainable and runs on CPU, else none."""
    name = subject.adapter.default_backend
    if name is None:
        return ()
    backend = subject.adapter.backend(name)
    return backend.ops if backend.retainable and backend.is_available("cpu") else ()


def _kept(policy: PolicyConfig, blocks: ModelBlocks) -> frozenset[str] | None:
    """What ``policy``'s ``ops`` blocks keep, as ac-core's policy registry selects them; None: it selects none."""
    chosen = selections(policy, blocks).values()
    return kept_ops(chosen) if any(s.kind.value == "ops" for s in chosen) else None


def check_fsdp(subject: Subject, policies: Sequence[Policy] | None = None) -> dict[str, frozenset[str]]:
    """For each policy (by default every registered one), one step on two gloo ranks equals a single plain
    process; no collective is retained.

    All policies run in one pair of spawned ranks (a spawn costs seconds of imports). A policy retains only
    what its ``ops`` block selections keep (under ``ops``, the adapter's or PyTorch's attention kernels), never
    a collective such as an FSDP all-gather; one that selects no ``ops`` block retains nothing. Returns the op
    names retained, by policy label. A rank that a signal kills before the ranks finish (a native crash, not
    an assertion) is run once more, with a ``RuntimeWarning``.
    """
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not built into this torch")
    require_tiny(subject)
    configs = [as_policy(p) for p in (default_policies() if policies is None else policies)]
    expected = plain_step(subject, "cpu")
    model = subject.adapter.models.index(subject.model)  # an index: an adapter may declare a class twice
    results = fsdp_steps(portable_ref(subject.ref), model, configs, WORLD_SIZE)
    blocks = subject.blocks(build(subject, "cpu").model)
    failures = []
    for policy in configs:
        result = results[policy]
        what = f"{subject.id} under {label(policy)} with FSDP2 on {WORLD_SIZE} gloo ranks vs one plain process"
        try:
            assert_same_step(Step(result.loss, result.grads), expected, EAGER_TOLERANCE, what)
            collectives = sorted(op for op in result.retained_ops if is_collective(op))
            assert not collectives, f"{what}: retained collective outputs {collectives}"
            kept = _kept(policy, blocks)
            if kept is not None:
                unexpected = sorted(op for op in result.retained_ops if not op_matches(op, kept))
                assert not unexpected, f"{what}: retained ops its block selections do not keep: {unexpected}"
                if any(op_matches(op, kept) for op in _default_backend_ops(subject)):
                    assert result.retained_ops, f"{what}: retained nothing on the default backend, which it keeps"
            else:
                assert not result.retained_ops, (
                    f"{what}: retained {sorted(result.retained_ops)} though it selects no 'ops' block"
                )
        except AssertionError as exc:
            failures.append(str(exc))
    if failures:
        raise AssertionError("\n".join(failures))
    return {label(policy): results[policy].retained_ops for policy in configs}


class FSDPTests(AdapterTests):
    """Check 7: FSDP2 on two gloo ranks equals a single plain process, for every policy."""

    def test_fsdp2(self, subject: Subject) -> None:
        check_fsdp(subject, self._policies())


__all__ = ["WORLD_SIZE", "FSDPTests", "check_fsdp"]
