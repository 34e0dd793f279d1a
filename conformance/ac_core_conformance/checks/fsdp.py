"""Check 7: FSDP2 on every block and the root, with each policy, trains like a single plain process."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from ac_core import DEFAULT_RETAINED_OPS, Ops, op_matches
from ac_core.spec import is_collective

from ..distributed import fsdp_steps
from ..policies import Policy, as_policy, default_policies, label
from ..subjects import Subject, portable_ref
from ..training import EAGER_TOLERANCE, Step, assert_same_step, plain_step, require_tiny

WORLD_SIZE = 2
"""CPU ranks (gloo) the check spawns."""


def _default_backend_retains(subject: Subject) -> bool:
    name = subject.adapter.default_backend
    if name is None:
        return False
    backend = subject.adapter.backend(name)
    return backend.retainable and backend.is_available("cpu")


def check_fsdp(subject: Subject, policies: Sequence[Policy] | None = None) -> dict[str, frozenset[str]]:
    """For each policy (by default every registered one), one step on two gloo ranks equals a single plain
    process; ``ops`` retains no collective.

    All policies run in one pair of spawned ranks (a spawn costs seconds of imports). Under ``ops``
    the retained ops are the adapter's or PyTorch's attention kernels, never a collective such as
    an FSDP all-gather. Returns the op names retained, by policy label. A rank that a signal kills before
    the ranks finish (a native crash, not an assertion) is run once more, with a ``RuntimeWarning``.
    """
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not built into this torch")
    require_tiny(subject)
    configs = [as_policy(p) for p in (default_policies() if policies is None else policies)]
    expected = plain_step(subject, "cpu")
    model = subject.adapter.models.index(subject.model)  # an index: an adapter may declare a class twice
    results = fsdp_steps(portable_ref(subject.ref), model, configs, WORLD_SIZE)
    failures = []
    for policy in configs:
        result = results[policy]
        what = f"{subject.id} under {label(policy)} with FSDP2 on {WORLD_SIZE} gloo ranks vs one plain process"
        try:
            assert_same_step(Step(result.loss, result.grads), expected, EAGER_TOLERANCE, what)
            collectives = sorted(op for op in result.retained_ops if is_collective(op))
            assert not collectives, f"{what}: retained collective outputs {collectives}"
            if isinstance(policy, Ops):
                allowed = subject.adapter.retained_ops() | DEFAULT_RETAINED_OPS | policy.retain
                unexpected = sorted(op for op in result.retained_ops if not op_matches(op, allowed))
                assert not unexpected, f"{what}: retained ops that are no attention kernel: {unexpected}"
                if _default_backend_retains(subject):
                    assert result.retained_ops, f"{what}: 'ops' retained nothing on the default backend"
            else:
                assert not result.retained_ops, f"{what}: retained {sorted(result.retained_ops)} without 'ops'"
        except AssertionError as exc:
            failures.append(str(exc))
    if failures:
        raise AssertionError("\n".join(failures))
    return {label(policy): results[policy].retained_ops for policy in configs}


__all__ = ["WORLD_SIZE", "check_fsdp"]
