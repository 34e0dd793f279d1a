"""The conformance suite as pytest classes: subclass one, point it at an adapter, and pytest runs the checks.

Every test is parametrized, by :meth:`AdapterTests.pytest_generate_tests`, over what its arguments
name: ``subject`` (adapter x model class), ``policy`` (every policy of :attr:`AdapterTests.policies`),
``recompute_policy`` (those of them that recompute attention: all but ``Ops``), ``device`` (``cuda``
marked and skipped where absent), ``retainable_backend`` / ``unretainable_backend`` (the adapter's
declared backends of that kind) and ``attention_context`` (see ``attention_contexts``).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import pytest
import torch

from ac_core import PolicyConfig

from .checks import (
    AttentionContext,
    check_attention_recomputed,
    check_attention_retained,
    check_budget,
    check_compile,
    check_coverage,
    check_fsdp,
    check_gradients,
    check_gradients_with_dropout,
    check_gradients_with_random_ops,
    check_library_checkpointing,
    check_library_checkpointing_after,
    check_memory,
    check_meta_planning,
    check_names,
    check_not_retainable_backend,
    check_pickle_round_trip,
    check_save_pretrained,
    compile_backend,
    no_context,
    offload_context,
)
from .policies import Policy, as_policy, default_policies, recomputes_attention
from .subjects import AdapterRef, Subject, subjects_of

DEVICES = ("cpu", "cuda")
"""CPU always; CUDA where present (tests marked ``cuda``)."""

_DIMENSIONS = (
    "policy",
    "recompute_policy",
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
    compile_backend: str | None = None
    """torch.compile backend of check 6; None: ``--ac-core-compile-backend``, ``$AC_CORE_COMPILE_BACKEND``,
    else ``aot_eager``."""
    attention_contexts: Mapping[str, AttentionContext] = MappingProxyType(
        {"plain": no_context, "offload": offload_context}
    )
    """Contexts entered around forward and backward of check 3, by id: plain, and with activation offload on
    (retained attention outputs must stay on the compute device). Add one to run the check under it too."""

    def _adapter_refs(self, config: pytest.Config) -> list[AdapterRef]:
        if self.adapter is not None:
            return [self.adapter]
        return list(config.getoption(ADAPTER_OPTION, None) or [])

    def _policies(self) -> tuple[PolicyConfig, ...]:
        return default_policies() if self.policies is None else tuple(map(as_policy, self.policies))

    def _dimension(self, name: str, subject: Subject) -> list[Any]:
        if name in ("policy", "recompute_policy"):
            chosen = [p for p in self._policies() if name == "policy" or recomputes_attention(p)]
            return [pytest.param(p, id=p.name) for p in chosen]
        if name == "device":
            return [_device_param(d) for d in self.devices]
        if name in ("retainable_backend", "unretainable_backend"):
            retainable = name == "retainable_backend"
            return [pytest.param(b.name, id=b.name) for b in subject.adapter.backends if b.retainable == retainable]
        if name == "attention_context":
            return [pytest.param(key, id=key) for key in self.attention_contexts]
        raise KeyError(name)

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


class CoverageTests(AdapterTests):
    """Check 1: exactly the declared blocks are checkpointed; no container of blocks goes unnoticed."""

    def test_coverage(self, subject: Subject, policy: PolicyConfig) -> None:
        check_coverage(subject, policy)


class GradientTests(AdapterTests):
    """Check 2: loss and every gradient equal the plain model's, with dropout too."""

    def test_gradients(self, subject: Subject, policy: PolicyConfig, device: str) -> None:
        check_gradients(subject, policy, device)

    def test_gradients_with_dropout(self, subject: Subject, policy: PolicyConfig, device: str) -> None:
        check_gradients_with_dropout(subject, policy, device)

    def test_gradients_with_random_ops(self, subject: Subject, policy: PolicyConfig, device: str) -> None:
        check_gradients_with_random_ops(subject, policy, device)


class AttentionTests(AdapterTests):
    """Check 3: attention retained under ``ops``, recomputed under the others, declared calls per block."""

    def test_attention_retained(
        self, subject: Subject, retainable_backend: str, device: str, attention_context: str
    ) -> None:
        context = self.attention_contexts[attention_context]
        check_attention_retained(subject, retainable_backend, device, context=context)

    def test_attention_recomputed(self, subject: Subject, recompute_policy: PolicyConfig, device: str) -> None:
        check_attention_recomputed(subject, recompute_policy, device)

    def test_not_retainable_backend_warns_and_trains(
        self, subject: Subject, unretainable_backend: str, device: str
    ) -> None:
        check_not_retainable_backend(subject, unretainable_backend, device)


class MemoryTests(AdapterTests):
    """Check 4: bytes held for backward, full < ops < none; the figures are printed (``-s`` or ``-rA``)."""

    def test_memory(self, subject: Subject, device: str) -> None:
        held = check_memory(subject, device, policies=self._policies())
        figures = "  ".join(f"{policy}={n:,} B" for policy, n in held.items())
        print(f"ac-core held for backward, {subject.id} on {device}: {figures}")

    def test_budget(self, subject: Subject) -> None:
        """The memory-budget plan at half of none: within budget +5%, gradients as plain, JSON round trip (CPU)."""
        report = check_budget(subject, fraction=0.5, device="cpu")
        print(
            f"ac-core budget plan, {subject.id}: budget {report.budget_bytes:,} B, predicted "
            f"{report.predicted_bytes:,} B, measured {report.measured_bytes:,} B (none {report.none_bytes:,} B)"
        )

    def test_budget_on_meta(self, subject: Subject) -> None:
        """Planning on meta tensors gives the plan real tensors give (or the model declares meta_unsupported)."""
        check_meta_planning(subject)


class NameTests(AdapterTests):
    """Check 5: names unchanged; save_pretrained/from_pretrained round trip where the model has them."""

    def test_names(self, subject: Subject, policy: PolicyConfig) -> None:
        check_names(subject, policy)

    def test_save_pretrained_round_trip(self, subject: Subject, policy: PolicyConfig) -> None:
        check_save_pretrained(subject, policy)

    @pytest.mark.parametrize("how", ["torch.save", "deepcopy"])
    def test_pickle_round_trip(self, subject: Subject, policy: PolicyConfig, how: str) -> None:
        check_pickle_round_trip(subject, policy, how)


class CompileTests(AdapterTests):
    """Check 6: torch.compile of the checkpointed model trains like eager."""

    def test_compile(self, subject: Subject, policy: PolicyConfig, device: str, request: pytest.FixtureRequest) -> None:
        backend = compile_backend(self.compile_backend or request.config.getoption(COMPILE_BACKEND_OPTION, None))
        check_compile(subject, policy, device, backend=backend)


class FSDPTests(AdapterTests):
    """Check 7: FSDP2 on two gloo ranks equals a single plain process, for every policy."""

    def test_fsdp2(self, subject: Subject) -> None:
        check_fsdp(subject, self._policies())


class LibraryCheckpointingTests(AdapterTests):
    """Check 8: the library's own gradient checkpointing is turned off with a warning, and training is right."""

    def test_library_checkpointing_taken_over(self, subject: Subject, policy: PolicyConfig) -> None:
        check_library_checkpointing(subject, policy)

    def test_library_checkpointing_switched_on_after(self, subject: Subject, policy: PolicyConfig) -> None:
        check_library_checkpointing_after(subject, policy)


class AdapterConformance(
    CoverageTests,
    GradientTests,
    AttentionTests,
    MemoryTests,
    NameTests,
    CompileTests,
    FSDPTests,
    LibraryCheckpointingTests,
):
    """The whole conformance suite. Subclass it as ``Test...`` and set ``adapter``::

    class TestMyAdapter(AdapterConformance):
        adapter = "my-adapter"  # or the AdapterSpec, or "my_package.adapter:SPEC"
    """


__all__ = [
    "DEVICES",
    "AdapterConformance",
    "AdapterTests",
    "AttentionTests",
    "CompileTests",
    "CoverageTests",
    "FSDPTests",
    "GradientTests",
    "LibraryCheckpointingTests",
    "MemoryTests",
    "NameTests",
]
