"""A checkpoint plan's data: per block, unchecked, checkpointed whole, or the op occurrences kept; and its JSON.

Made by :func:`~ac_core.plan_activation_checkpointing` (see :mod:`.policy`), applied like any policy config;
its table is :mod:`.plan_table`'s.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, ClassVar

from ..blocks import ModelBlocks
from ..offload import OffloadConfig
from ..policies import BlockDecision, BlockMode, PolicyConfig
from .plan_table import plan_table
from .profile import Signature
from .step_budget import StepBudget

_FORMAT = 4  # 2: offload; 3: the containers of a plan made with blocks=; 4: its compiled layout; earlier files load
# How ac_core.compile lays a plan out (see CheckpointPlan): the code outside the blocks, and the ops without FLOPs.
COMPILE_OUTSIDE = ("held", "recomputed")
COMPILE_FREE = ("fewest_bytes", "torch_rules")
COMPILE_BLOCK_INPUTS = ("held", "recomputable")
# The fields that name a plan's layout, each with its choices; the first choice is the default.
_COMPILE_FIELDS = {
    "compile_outside": COMPILE_OUTSIDE,
    "compile_free": COMPILE_FREE,
    "compile_block_inputs": COMPILE_BLOCK_INPUTS,
}
# What a plan records of its offload settings (OffloadConfig fields); the rest are fixed (see .offload_cost.recorded).
_OFFLOAD_SETTINGS = ("min_bytes", "max_host_fraction", "max_inflight_bytes", "prefetch_bytes")


@dataclass(frozen=True, kw_only=True)
class PlannedBlock(BlockDecision):
    """One block of a plan: its :class:`~ac_core.BlockDecision` (``mode`` and, for ``ops``, ``keep``: (op name,
    occurrence) pairs), its class, the input signature it was planned at, and the predicted bytes it holds and
    FLOPs it recomputes; ``offload``: whether the inputs its checkpoint saves go to the host, ``host_bytes`` of
    them (a tensor several blocks save counted at the first). On the plan's device (None: planned without one),
    ``recompute_seconds``: its recompute's predicted time, and ``offload_seconds``: its offload's exposed host-link
    time (see :func:`~ac_core.budget.solve.offload_seconds`)."""

    class_name: str
    inputs: Signature
    held_bytes: int
    recompute_flops: int
    offload: bool = False
    host_bytes: int = 0
    recompute_seconds: float | None = None
    offload_seconds: float = 0.0


def _plain(value: Any) -> Any:
    """JSON lists back into the tuples a plan holds."""
    return tuple(_plain(v) for v in value) if isinstance(value, list) else value


@dataclass(frozen=True)
class CheckpointPlan(PolicyConfig):
    """A per-block checkpointing plan, made by :func:`plan_activation_checkpointing` (or loaded with ``from_json``).

    Applying it to a model of another class or block layout is refused, naming the difference; a checkpointed
    block called with other input shapes than planned raises, naming the block and both shapes.

    ``base_bytes``: what any plan that checkpoints a block holds besides its blocks' parts, before offload.
    ``offload``: the settings offload was planned with (None: not allowed); then ``freed_bytes`` leave the
    device and up to ``window_bytes`` of them are back on it at times (copies in flight, prefetched).
    ``containers``: the block containers' FQNs where ``blocks=`` named them (None: the adapter's), so that
    ``apply_activation_checkpointing(model, plan)`` and ``ac_core.compile(model, plan)`` need no ``blocks=``.
    ``cost``: what the knapsack minimised (``"time"`` or ``"flops"``); ``device``: the device name its seconds
    are predicted on (None: none known); ``none_seconds``: the predicted forward and backward time of the blocks
    unchecked (see :func:`~ac_core.budget.solve.none_step_seconds`).

    On :func:`ac_core.compile`'s graph route (the eager route has no partitioner to tell): ``compile_outside``,
    whether the code outside the blocks keeps its matmuls, convolutions and attention (``"held"``) or is recomputed
    whole (``"recomputed"``); ``compile_free``, who decides the ops without FLOPs in the blocks the plan keeps ops
    of and outside them: the partitioner's fewest bytes (``"fewest_bytes"``), or torch's own recompute rules
    (``"torch_rules"``: pointwise ops recomputed, norms and copies saved; more bytes, less time);
    ``compile_block_inputs``, whether each block's inputs are held as eager checkpointing holds them (``"held"``)
    or the partitioner's to save or recompute (``"recomputable"``: a block's recompute may run the previous
    block's matmuls; fewer bytes, more FLOPs). ``ac-core compare --frontier`` picks them per point; see
    :class:`~ac_core.GraphDecisions`.
    """

    model_class: str = ""
    blocks: tuple[PlannedBlock, ...] = ()
    inputs: Signature = ()
    budget_bytes: int = 0
    none_bytes: int = 0
    min_bytes: int = 0
    base_bytes: int = 0
    offload: OffloadConfig | None = None
    freed_bytes: int = 0
    window_bytes: int = 0
    containers: tuple[str, ...] | None = None
    cost: str = "flops"
    device: str | None = None
    none_seconds: float | None = None
    step_budget: StepBudget | None = None  # planned for a whole step's peak (see ac_core.predict_step)
    compile_outside: str = COMPILE_OUTSIDE[0]
    compile_free: str = COMPILE_FREE[0]
    compile_block_inputs: str = COMPILE_BLOCK_INPUTS[0]
    name: ClassVar[str] = "plan"

    def __post_init__(self) -> None:
        if not self.blocks:
            raise ValueError(
                "a CheckpointPlan is made by ac_core.plan_activation_checkpointing(model, example_inputs, budget) "
                "or loaded with CheckpointPlan.from_json; to plan and apply at once use ac_core.Budget(...)"
            )
        for field, allowed in _COMPILE_FIELDS.items():
            if (value := getattr(self, field)) not in allowed:
                raise ValueError(f"{field}={value!r}: choose one of {', '.join(map(repr, allowed))}")
        for block in self.blocks:
            if block.retain:
                raise ValueError(f"block {block.path!r}: a plan keeps op occurrences (keep=), not op names (retain=)")
            if block.offload and (block.mode == BlockMode.NONE or self.offload is None):
                raise ValueError(f"block {block.path!r}: offload needs a checkpointed block and a plan's offload")

    def check_fits(self, blocks: ModelBlocks) -> None:
        """Refuse a model of another class or block layout than planned, naming the difference."""
        served = blocks.served_model
        here = f"{type(served).__module__}.{type(served).__qualname__}"
        if here != self.model_class:
            raise ValueError(f"this checkpoint plan is for {self.model_class}, not {here}; plan this model instead")
        planned = [(b.path, b.class_name) for b in self.blocks]
        found = [(b.path, b.class_name) for b in blocks]
        if planned == found:
            return
        if len(planned) != len(found):
            raise ValueError(
                f"this checkpoint plan is for {len(planned)} blocks and the model has {len(found)} "
                f"(missing here: {sorted(set(planned) - set(found))[:3]}, "
                f"not planned: {sorted(set(found) - set(planned))[:3]})"
            )
        (want, got) = next((a, b) for a, b in zip(planned, found, strict=True) if a != b)
        raise ValueError(
            f"this checkpoint plan has block {want[0]!r} ({want[1]}) where the model has {got[0]!r} ({got[1]})"
        )

    @property
    def default_layout(self) -> bool:
        """Whether the plan compiles in the default layout (each ``compile_*`` field at its first choice)."""
        return all(getattr(self, field) == allowed[0] for field, allowed in _COMPILE_FIELDS.items())

    def own_containers(self) -> tuple[str, ...] | None:
        return self.containers

    @property
    def held_bytes(self) -> int:
        """Predicted device bytes held for backward under the plan once offload's copies are done (outside the
        blocks plus each block's part, less what offload moved)."""
        if all(b.mode == BlockMode.NONE for b in self.blocks):
            return self.none_bytes
        return self.base_bytes - self.freed_bytes + sum(b.held_bytes for b in self.blocks)

    @property
    def device_bytes(self) -> int:
        """The most the device holds for backward: ``held_bytes`` and offload's window; within the budget."""
        return self.held_bytes + self.window_bytes

    @property
    def host_bytes(self) -> int:
        """Bytes offload moves to host memory per forward."""
        return sum(b.host_bytes for b in self.blocks)

    @property
    def recompute_flops(self) -> int:
        return sum(b.recompute_flops for b in self.blocks)

    @property
    def recompute_seconds(self) -> float | None:
        """Predicted seconds of the plan's recompute on its device (None: planned without one)."""
        if self.device is None:
            return None
        return sum(b.recompute_seconds or 0.0 for b in self.blocks)

    @property
    def offload_seconds(self) -> float:
        """Predicted host-link seconds offload leaves exposed."""
        return sum(b.offload_seconds for b in self.blocks)

    @property
    def overhead(self) -> float | None:
        """Predicted step-time overhead over ``none``: the seconds recompute and offload add, over
        ``none_seconds``."""
        recompute = self.recompute_seconds
        if recompute is None or not self.none_seconds:
            return None
        return (recompute + self.offload_seconds) / self.none_seconds

    @property
    def fingerprint(self) -> str:
        """A short hash of the model class, block layout and input shapes the plan is for."""
        key = json.dumps([self.model_class, [(b.path, b.class_name, b.inputs) for b in self.blocks], self.inputs])
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def to_json(self) -> str:
        offload = self.offload
        return json.dumps(
            {
                "format": _FORMAT,
                "fingerprint": self.fingerprint,
                "model_class": self.model_class,
                "inputs": self.inputs,
                "budget_bytes": self.budget_bytes,
                "none_bytes": self.none_bytes,
                "min_bytes": self.min_bytes,
                "base_bytes": self.base_bytes,
                "offload": None if offload is None else {name: getattr(offload, name) for name in _OFFLOAD_SETTINGS},
                "freed_bytes": self.freed_bytes,
                "window_bytes": self.window_bytes,
                "containers": self.containers,
                "cost": self.cost,
                "device": self.device,
                "none_seconds": self.none_seconds,
                "step_budget": None if self.step_budget is None else self.step_budget.to_dict(),
                **{field: getattr(self, field) for field in _COMPILE_FIELDS},
                "blocks": [
                    {
                        "path": b.path,
                        "class": b.class_name,
                        "mode": b.mode.value,
                        "keep": b.keep,
                        "inputs": b.inputs,
                        "held_bytes": b.held_bytes,
                        "recompute_flops": b.recompute_flops,
                        "offload": b.offload,
                        "host_bytes": b.host_bytes,
                        "recompute_seconds": b.recompute_seconds,
                        "offload_seconds": b.offload_seconds,
                    }
                    for b in self.blocks
                ],
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> CheckpointPlan:
        """A plan written by :meth:`to_json`, of this format or an earlier one (1: before offload, 2: before
        containers, 3: before the compiled layout)."""
        data = json.loads(text)
        if data.get("format") not in range(1, _FORMAT + 1):
            raise ValueError(f"not a checkpoint plan of format 1 to {_FORMAT}: format {data.get('format')!r}")
        containers = data.get("containers")
        offload = data.get("offload")
        plan = cls(
            model_class=data["model_class"],
            blocks=tuple(
                PlannedBlock(
                    path=b["path"],
                    mode=b["mode"],
                    keep=_plain(b["keep"]),
                    class_name=b["class"],
                    inputs=_plain(b["inputs"]),
                    held_bytes=b["held_bytes"],
                    recompute_flops=b["recompute_flops"],
                    offload=b.get("offload", False),
                    host_bytes=b.get("host_bytes", 0),
                    recompute_seconds=b.get("recompute_seconds"),
                    offload_seconds=b.get("offload_seconds", 0.0),
                )
                for b in data["blocks"]
            ),
            inputs=_plain(data["inputs"]),
            budget_bytes=data["budget_bytes"],
            none_bytes=data["none_bytes"],
            min_bytes=data["min_bytes"],
            base_bytes=data.get("base_bytes", data["min_bytes"]),
            offload=None if offload is None else OffloadConfig(min_tokens=1, **offload),
            freed_bytes=data.get("freed_bytes", 0),
            window_bytes=data.get("window_bytes", 0),
            containers=None if containers is None else tuple(containers),
            cost=data.get("cost", "flops"),
            device=data.get("device"),
            none_seconds=data.get("none_seconds"),
            step_budget=None if data.get("step_budget") is None else StepBudget.from_dict(data["step_budget"]),
            **{field: data[field] for field in _COMPILE_FIELDS if field in data},  # format 3 and before: defaults
        )
        if data.get("fingerprint") not in (None, plan.fingerprint):
            raise ValueError("checkpoint plan JSON was edited: its fingerprint does not match its contents")
        return plan

    def __str__(self) -> str:
        return plan_table(self)
