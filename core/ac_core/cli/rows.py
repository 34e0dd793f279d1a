"""What a bench row is: the variants measured on each model, and the figures of one row.

The variants are ac-core's registered policies plus two rows that are not ac-core policies: ``none`` (no
checkpointing, the reference every other row is compared with) and ``library`` (the model library's own
checkpointing, as a baseline). ``budget`` rows (not in ``all``) plan the memory-budget policy for each budget
asked for on the row's model and inputs (:mod:`ac_core.budget`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..offload import OffloadConfig
from ..policies import BlockSkip, Full, PolicyConfig, policy_config, registered_policies

NONE, LIBRARY, BUDGET = "none", "library", "budget"


def row_names() -> tuple[str, ...]:
    """What ``--policy`` chooses from, in the order rows run: ``none``, the registered policies, ``library``."""
    return (NONE, *registered_policies(), LIBRARY)


@dataclass(frozen=True)
class Variant:
    """How one row's model is set up: the policy, and whether activations leave the device.

    ``policy`` is a registered policy's config, or :data:`NONE` / :data:`LIBRARY`. ``offload`` is ac-core's
    activation offload (with ``none`` it runs without checkpointing); ``save_on_cpu`` is the synchronous
    baseline: ``full`` with torch's ``save_on_cpu(pin_memory=True)`` around the forward, as trainers that
    wrap it (FastVideo's seed) do.
    """

    policy: PolicyConfig | str
    offload: OffloadConfig | None = None
    save_on_cpu: bool = False
    budget: float | int | str | None = None  # a BUDGET row's memory budget (fraction of none, bytes or size)

    @property
    def name(self) -> str:
        return self.policy if isinstance(self.policy, str) else self.policy.name

    @property
    def label(self) -> str:
        if self.policy == BUDGET:
            return f"{BUDGET}({self.budget})"
        base = f"{self.name}(n={self.policy.every})" if isinstance(self.policy, BlockSkip) else self.name
        return base + ("+offload" if self.offload else "") + ("+save_on_cpu" if self.save_on_cpu else "")


def _config(name: str, n_layer: int) -> PolicyConfig:
    # --n-layer is block_skip's every-n-th block; every other policy takes its defaults.
    return BlockSkip(every=n_layer) if registered_policies()[name] is BlockSkip else policy_config(name)


def variants(
    names: Sequence[str],
    n_layer: int,
    offload: OffloadConfig | None = None,
    budgets: Sequence[float | int | str] = (),
) -> list[Variant]:
    """The rows to measure for each model, ``none`` first (the reference every other row is compared with).

    With ``offload``, each chosen row but ``library`` gets a ``+offload`` row after it, and ``full``
    (when chosen) a synchronous ``+save_on_cpu`` row, the baseline offload is measured against. With
    :data:`BUDGET` in ``names``, one row per budget of ``budgets`` comes last (without offload).
    """
    registered = registered_policies()
    rows: list[Variant] = []
    for name in (NONE, *(n for n in row_names() if n in names and n != NONE)):
        policy = _config(name, n_layer) if name in registered else name
        rows.append(Variant(policy))
        if offload is not None and name != LIBRARY:
            rows.append(Variant(policy, offload=offload))
        if offload is not None and isinstance(policy, Full):
            rows.append(Variant(policy, save_on_cpu=True))
    if BUDGET in names:
        rows.extend(Variant(BUDGET, budget=budget) for budget in budgets)
    return rows


@dataclass
class Row:
    """Every figure of one benchmark row; ``None`` where a figure does not apply (a skipped row)."""

    adapter: str
    model: str  # AdapterSpec.model_label: the class name, told apart where a class is declared twice
    policy: str | None
    label: str | None
    status: str  # "ok", "skipped" or "error"
    reason: str | None = None
    detail: str | None = None
    tokens: int | None = None
    loss: float | None = None
    activation_peak_bytes: int | None = None
    held_for_backward_bytes: int | None = None
    flops: int | None = None
    attention_flops: int | None = None
    recompute_overhead: float | None = None
    attention_forward_calls: int | None = None
    attention_recomputed: int | None = None
    step_time_s: float | None = None
    step_times_s: list[float] | None = None
    time_ratio: float | None = None
    grad_max_abs_diff: float | None = None
    grad_ok: bool | None = None
    # budget rows only: the budget in bytes, and what the plan predicted it holds for backward and recomputes
    budget_bytes: int | None = None
    predicted_held_bytes: int | None = None
    predicted_recompute_flops: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


ROW_FIELDS = tuple(Row.__dataclass_fields__)
