"""The conformance checks, in order: one registration each.

The package's exports, its docstring's numbered list, ``checks``' exports and
:class:`~ac_core_conformance.suite.AdapterConformance` are all derived from :data:`CHECKS`. A new check is
one module ``checks/<name>.py`` (its check functions and its pytest class, a subclass of
:class:`~ac_core_conformance.base.AdapterTests` whose docstring starts ``Check <number>:``) and one
:class:`Check` appended here. This module imports nothing heavy: ``import ac_core_conformance`` reads it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    """One check: ``name`` (its module ``checks/<name>.py``), a one-line ``summary`` for the package docstring,
    ``exports`` (the names of that module the package exports) and ``tests``, the name of its pytest class there."""

    name: str
    summary: str
    exports: tuple[str, ...]
    tests: str

    @property
    def module(self) -> str:
        """The module, relative to the package, that defines the check."""
        return f"checks.{self.name}"


CHECKS: tuple[Check, ...] = (
    Check(
        "coverage",
        "exactly the declared blocks are checkpointed; a container of blocks that is neither declared nor declared "
        "excluded fails by name",
        ("check_coverage",),
        "CoverageTests",
    ),
    Check(
        "gradients",
        "loss and every gradient equal the plain model's (float32, ``EAGER_TOLERANCE``), with dropout active too, "
        "and with ``torch.rand`` masks inside every block (recompute must replay the RNG state)",
        ("check_gradients", "check_gradients_with_dropout", "check_gradients_with_random_ops"),
        "GradientTests",
    ),
    Check(
        "attention",
        "each block runs the attention calls ``attention_calls`` declares; under each policy backward reruns exactly "
        "the kernel calls its block selections recompute (none where a block keeps attention or is unchecked); under "
        "``ops`` a retainable backend's outputs stay on the compute device, also with activation offload on; a "
        "backend declared not retainable warns once and trains correctly",
        (
            "AttentionContext",
            "attention_recomputes",
            "check_attention_recomputed",
            "check_attention_retained",
            "check_not_retainable_backend",
        ),
        "AttentionTests",
    ),
    Check(
        "memory",
        "bytes held for backward satisfy full < ops < none, and full <= each other policy < none (printed)",
        ("check_memory",),
        "MemoryTests",
    ),
    Check(
        "names",
        "parameter, state_dict and module names unchanged; save_pretrained/from_pretrained round trip",
        ("check_names", "check_save_pretrained"),
        "NameTests",
    ),
    Check(
        "compile",
        "torch.compile gives the eager loss and gradients (``aot_eager`` by default)",
        ("check_compile",),
        "CompileTests",
    ),
    Check(
        "fsdp",
        "FSDP2 on two gloo ranks equals one plain process; only what the policy keeps is retained, no collective",
        ("check_fsdp",),
        "FSDPTests",
    ),
    Check(
        "library",
        "the library's own gradient checkpointing is turned off with a warning, also when switched on after ac-core "
        "(found at the next forward, said once), so no block is checkpointed twice, and training is right",
        ("check_library_checkpointing", "check_library_checkpointing_after"),
        "LibraryCheckpointingTests",
    ),
    Check(
        "pickling",
        "``torch.save(model)`` / ``copy.deepcopy`` of a checkpointed model come back checkpointed on the same blocks "
        "and train like the plain model",
        ("check_pickle_round_trip",),
        "PicklingTests",
    ),
    Check(
        "budget",
        "the memory-budget plan at half of none's bytes holds within its budget (+5%), trains like the plain model "
        "and round-trips through JSON; planning on meta tensors gives the plan real tensors give",
        ("check_budget", "check_meta_planning"),
        "BudgetTests",
    ),
    Check(
        "context_parallel",
        "for an adapter that declares ``context_parallel`` (the models it can run so), on two gloo ranks per mode "
        "(Ulysses, ring) and order of setup: training bit-equal to the unchecked parallel run; ``ops`` runs no more "
        "attention kernels and activation collectives in backward than the unchecked backward",
        ("check_context_parallel",),
        "ContextParallelTests",
    ),
)
"""Every check, numbered from 1 in this order."""


def numbered() -> Iterator[tuple[int, Check]]:
    """``(number, check)`` for every check, from 1."""
    return enumerate(CHECKS, start=1)


__all__ = ["CHECKS", "Check", "numbered"]
