"""The base of every check's pytest class: which adapter to check, and how its tests are parametrized.

Every test is parametrized, by :meth:`AdapterTests.pytest_generate_tests`, over what its arguments
name: ``subject`` (adapter x model class), ``policy`` (every policy of :attr:`AdapterTests.policies`),
``device`` (``cuda`` marked and skipped where absent) and ``retainable_backend`` /
``unretainable_backend`` (the adapter's declared backends of that kind). A check's class adds a
dimension of its own by overriding :meth:`AdapterTests._dimension` (check 3's ``attention_context``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from ac_core import PolicyConfig

from .policies import Policy, as_policy, default_policies
from .subjects import AdapterRef, Subject, subjects_of

DEVICES = ("cpu", "cuda")
"""CPU always; CUDA where present (tests marked ``cuda``)."""

# In this order in test ids (``toy-ToyTransformer-cpu-sdpa-plain``).
_DIMENSIONS = (
    "policy",
    "device",
    "retainable_backend",
    "unretainable_backend",
    "attention_context",
)

ADAPTER_OPTION = "ac_core_adapter"
COMPILE_BACKEND_OPTION = "ac_core_compile_backend"


def _device_param(device: str) -> Any:
    if device == "cuda":
        return pytest.param(
            device,
            id=device,
            marks=(pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
        )
    return pytest.param(device, id=device)


class AdapterTests:
    """Base of the check classes: which adapter to check, and how to parametrize over it.

    Set ``adapter`` to an AdapterSpec, a registered adapter name, or ``"module:attr"``; left ``None``,
    the adapters come from ``pytest --ac-core-adapter NAME`` (repeatable).
    """

    adapter: AdapterRef | None = None
    policies: Sequence[Policy] | None = None
    """Policy configs (or registered names) the checks run under; None: every registered policy at its
    defaults (``Full()``, ``Ops()``, ``BlockSkip(every=2)``, then any registered later)."""
    devices: Sequence[str] = DEVICES

    def _adapter_refs(self, config: pytest.Config) -> list[AdapterRef]:
        if self.adapter is not None:
            return [self.adapter]
        return list(config.getoption(ADAPTER_OPTION, None) or [])

    def _policies(self) -> tuple[PolicyConfig, ...]:
        return default_policies() if self.policies is None else tuple(map(as_policy, self.policies))

    def _dimension(self, name: str, subject: Subject) -> list[Any]:
        """The ``pytest.param`` values of dimension ``name`` for ``subject``."""
        if name == "policy":
            return [pytest.param(p, id=p.name) for p in self._policies()]
        if name == "device":
            return [_device_param(d) for d in self.devices]
        if name in ("retainable_backend", "unretainable_backend"):
            retainable = name == "retainable_backend"
            return [pytest.param(b.name, id=b.name) for b in subject.adapter.backends if b.retainable == retainable]
        raise KeyError(f"{type(self).__name__} has no test dimension {name!r}")

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "subject" not in metafunc.fixturenames:
            return
        refs = self._adapter_refs(metafunc.config)
        dims = [name for name in _DIMENSIONS if name in metafunc.fixturenames]
        argnames = ["subject", *dims]
        if not refs:
            reason = "no adapter to check: set `adapter` on the test class, or pass --ac-core-adapter NAME|module:attr"
            values = [pytest.param(*([None] * len(argnames)), id="no-adapter", marks=pytest.mark.skip(reason=reason))]
            metafunc.parametrize(argnames, values)
            return
        values = []
        for subject in (s for ref in refs for s in subjects_of(ref)):
            for combo in itertools.product(*(self._dimension(d, subject) for d in dims)):
                marks = [m for p in combo for m in p.marks]
                ids = [subject.id, *(p.id for p in combo)]
                values.append(pytest.param(subject, *(p.values[0] for p in combo), id="-".join(ids), marks=marks))
        metafunc.parametrize(argnames, values)


__all__ = ["ADAPTER_OPTION", "COMPILE_BACKEND_OPTION", "DEVICES", "AdapterTests"]
