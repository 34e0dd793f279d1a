"""A checkpoint plan: per block, unchecked, checkpointed whole, or the op occurrences kept; and the budget policy.

``plan_activation_checkpointing(model, example_inputs, memory_budget)`` profiles the model (see
:mod:`.profile`), solves the global knapsack (see :mod:`.solve`) and returns a :class:`CheckpointPlan`: one more
policy config, applied with ``apply_activation_checkpointing(model, plan)``. ``Budget(memory_budget,
example_inputs=...)`` plans and applies in one call. With ``offload=`` the plan also says which checkpointed
blocks' inputs go to host memory (see :mod:`.offload`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn

from ..offload import OffloadConfig
from ..plan import BlockPlan, resolve_blocks
from ..policies import BlockSelection, PolicyConfig, register_policy
from ..policy import CheckpointType
from ..spec import AdapterSpec
from ._layer import PlannedLayer, PlanOffload
from .offload import Moved, OffloadModel, offload_request, recorded
from .profile import ModelProfile, Signature, describe_signature, profile_model
from .solve import FULL, NONE, OPS, Choice, solve

logger = logging.getLogger("ac_core")

_FORMAT = 3  # 2: offload; 3: the containers of a plan made with blocks=; earlier files still load
_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 2**10,
    "m": 10**6, "mb": 10**6, "mib": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30,
    "t": 10**12, "tb": 10**12, "tib": 2**40,
}  # fmt: skip
# What a plan records of its offload settings (OffloadConfig fields); the rest are fixed (see .offload.recorded).
_OFFLOAD_SETTINGS = ("min_bytes", "max_host_fraction", "max_inflight_bytes", "prefetch_bytes")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_budget(memory_budget: object) -> tuple[str, float]:
    """``("fraction", f)`` for a float 0 < f <= 1, ``("bytes", n)`` for an int or a size string (``"40GiB"``)."""
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float, str)):
        raise TypeError(
            "memory_budget is a fraction of what 'none' holds for backward (a float, 0 < f <= 1), bytes (an int) or "
            f"a size string such as '40GiB'; got {memory_budget!r}"
        )
    if isinstance(memory_budget, float):
        if not 0 < memory_budget <= 1:
            raise ValueError(
                f"memory_budget={memory_budget!r}: a float is a fraction of what 'none' holds for backward, "
                "0 < f <= 1; for bytes pass an int or a size string such as '40GiB'"
            )
        return "fraction", memory_budget
    if isinstance(memory_budget, int):
        if memory_budget <= 0:
            raise ValueError(f"memory_budget={memory_budget!r}: bytes must be > 0")
        return "bytes", float(memory_budget)
    match = _SIZE.match(memory_budget)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"memory_budget={memory_budget!r} is not a size: use a number and a unit such as '40GiB', '512MiB', "
            "'1.5GB' (units B, KB/KiB, MB/MiB, GB/GiB, TB/TiB)"
        )
    nbytes = math.floor(float(match.group(1)) * _UNITS[unit])
    if nbytes <= 0:
        raise ValueError(f"memory_budget={memory_budget!r}: bytes must be > 0")
    return "bytes", float(nbytes)


def _human(nbytes: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{int(nbytes)} B"


@dataclass(frozen=True)
class PlannedBlock:
    """One block of a plan: ``mode`` ``"none"``, ``"full"`` or ``"ops"`` (keeping ``keep``: (op name, occurrence)),
    the input signature it was planned at, and the predicted bytes it holds and FLOPs it recomputes; ``offload``:
    whether the inputs its checkpoint saves go to the host, ``host_bytes`` of them (a tensor several blocks save
    counted at the first)."""

    path: str
    class_name: str
    mode: str
    keep: tuple[tuple[str, int], ...]
    inputs: Signature
    held_bytes: int
    recompute_flops: int
    offload: bool = False
    host_bytes: int = 0


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
    name: ClassVar[str] = "plan"
    # Not a fixed policy: it cannot be built from its name alone, so bench rows and the conformance suite skip it.
    by_name: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if not self.blocks:
            raise ValueError(
                "a CheckpointPlan is made by ac_core.plan_activation_checkpointing(model, example_inputs, budget) "
                "or loaded with CheckpointPlan.from_json; to plan and apply at once use ac_core.Budget(...)"
            )
        for block in self.blocks:
            if block.mode not in (NONE, FULL, OPS) or (block.mode == OPS) != bool(block.keep):
                raise ValueError(f"block {block.path!r}: mode {block.mode!r} with keep={block.keep!r} is not a plan")
            if block.offload and (block.mode == NONE or self.offload is None):
                raise ValueError(f"block {block.path!r}: offload needs a checkpointed block and a plan's offload")

    def own_containers(self) -> tuple[str, ...] | None:
        return self.containers

    @property
    def held_bytes(self) -> int:
        """Predicted device bytes held for backward under the plan once offload's copies are done (outside the
        blocks plus each block's part, less what offload moved)."""
        if all(b.mode == NONE for b in self.blocks):
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
                "blocks": [
                    {
                        "path": b.path,
                        "class": b.class_name,
                        "mode": b.mode,
                        "keep": b.keep,
                        "inputs": b.inputs,
                        "held_bytes": b.held_bytes,
                        "recompute_flops": b.recompute_flops,
                        "offload": b.offload,
                        "host_bytes": b.host_bytes,
                    }
                    for b in self.blocks
                ],
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> CheckpointPlan:
        """A plan written by :meth:`to_json`, of this format or an earlier one (1: before offload, 2: before
        containers)."""
        data = json.loads(text)
        if data.get("format") not in range(1, _FORMAT + 1):
            raise ValueError(f"not a checkpoint plan of format 1 to {_FORMAT}: format {data.get('format')!r}")
        containers = data.get("containers")
        offload = data.get("offload")
        plan = cls(
            model_class=data["model_class"],
            blocks=tuple(
                PlannedBlock(
                    b["path"],
                    b["class"],
                    b["mode"],
                    _plain(b["keep"]),
                    _plain(b["inputs"]),
                    b["held_bytes"],
                    b["recompute_flops"],
                    b.get("offload", False),
                    b.get("host_bytes", 0),
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
        )
        if data.get("fingerprint") not in (None, plan.fingerprint):
            raise ValueError("checkpoint plan JSON was edited: its fingerprint does not match its contents")
        return plan

    def __str__(self) -> str:
        offload = self.offload is not None
        rows = [("block", "class", "mode", "kept ops", "held", *(("inputs",) if offload else ()), "recompute FLOPs")]
        for b in self.blocks:
            kept = ", ".join(f"{op.removeprefix('aten::')}#{i}" for op, i in b.keep) or "-"
            inputs = f"host {_human(b.host_bytes)}" if b.offload else "-" if b.mode == NONE else "device"
            cells = (b.path, b.class_name, b.mode, kept, _human(b.held_bytes), *((inputs,) if offload else ()))
            rows.append((*cells, f"{b.recompute_flops:,}"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [
            f"CheckpointPlan {self.fingerprint} for {self.model_class} at ({describe_signature(self.inputs)})",
            f"budget {_human(self.budget_bytes)}; predicted held for backward {_human(self.held_bytes)} "
            f"(none {_human(self.none_bytes)}, least possible {_human(self.min_bytes)}); "
            f"recompute {self.recompute_flops:,} FLOPs",
        ]
        if any(b.offload for b in self.blocks):
            lines.append(
                f"offload: {_human(self.host_bytes)} of block inputs to host memory, {_human(self.freed_bytes)} "
                f"freed on the device; up to {_human(self.window_bytes)} of them on the device at once (copies in "
                f"flight, prefetched), counted in the budget: {_human(self.device_bytes)} in all"
            )
        elif offload:
            lines.append("offload: allowed, not needed at this budget")
        lines += ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        return "\n".join(lines)


@dataclass(frozen=True)
class Budget(PolicyConfig):
    """Plan for ``memory_budget`` at ``example_inputs`` and apply it (see :func:`plan_activation_checkpointing`):
    planning inside ``apply_activation_checkpointing`` leaves the model, the inputs, the RNG and the hooks as they
    were, as planning does."""

    memory_budget: float | int | str | None = None
    example_inputs: Any = field(default=None, compare=False, repr=False)
    offload: bool | OffloadConfig | None = None
    name: ClassVar[str] = "budget"
    by_name: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.memory_budget is None:
            raise ValueError("Budget needs memory_budget: a fraction of 'none' (0.5), bytes, or a size ('40GiB')")
        parse_budget(self.memory_budget)
        if self.example_inputs is None:
            raise ValueError("Budget needs example_inputs=: one forward's inputs (a dict, a tensor or a tuple)")
        offload_request(self.offload)


def _model_class(plan: BlockPlan) -> str:
    served = plan.served_model
    return f"{type(served).__module__}.{type(served).__qualname__}"


def _plan(
    block_plan: BlockPlan, example_inputs: Any, memory_budget: object, offload: bool | OffloadConfig | None
) -> CheckpointPlan:
    parse_budget(memory_budget)  # a bad budget or offload= fails before the model runs
    offload_request(offload)
    profile = profile_model(block_plan, example_inputs)
    return plan_from_profile(profile, memory_budget, offload=offload, containers=named_containers(block_plan))


def named_containers(block_plan: BlockPlan) -> tuple[str, ...] | None:
    """The containers' FQNs a plan records where ``blocks=`` named them (None where the adapter did)."""
    return None if block_plan.model_spec is not None else tuple(c.path for c in block_plan.containers)


def _least(profile: ModelProfile, offload: OffloadModel | None) -> int:
    """What the plan holding least holds: every block checkpointed whole, each offloading where that saves bytes."""
    if offload is None:
        return profile.min_bytes
    return profile.min_bytes - max(0, offload.moved(offload.blocks).gain)


def plan_from_profile(
    profile: ModelProfile,
    memory_budget: object,
    *,
    offload: bool | OffloadConfig | None = None,
    containers: tuple[str, ...] | None = None,
) -> CheckpointPlan:
    """The plan for ``memory_budget`` from a model's profile (:func:`~ac_core.budget.profile_model`): profile
    once, plan at several budgets (what ``ac-core bench --policy budget`` does). ``containers``: those
    ``blocks=`` named (see :func:`named_containers`), recorded in the plan."""
    kind, value = parse_budget(memory_budget)
    config = offload_request(offload)
    model = OffloadModel(profile.saved_inputs, config) if config is not None else None
    budget = math.floor(value * profile.none_bytes) if kind == "fraction" else int(value)
    minimum = _least(profile, model)
    if budget < minimum:
        moved = ", those offload moves on the host" if minimum < profile.min_bytes else ""
        raise ValueError(
            f"memory_budget={memory_budget!r} ({budget} bytes) is below the least any plan holds for backward at "
            f"these inputs: {minimum} bytes ({_human(minimum)}), every block checkpointed and nothing kept but "
            f"block inputs{moved} ('none' holds {profile.none_bytes} bytes)"
        )
    if budget >= profile.none_bytes:
        logger.warning(
            "ac-core: memory_budget=%r (%d bytes) is at or above what 'none' holds for backward (%d bytes): "
            "the plan checkpoints no block",
            memory_budget,
            budget,
            profile.none_bytes,
        )
        choices = [Choice(NONE, (), p.none_bytes, 0) for _, p in profile.blocks]
    else:
        choices = solve(profile, budget, model)
    moved = Moved()
    if model is not None:
        moved = model.moved([path for (path, _), c in zip(profile.blocks, choices, strict=True) if c.offload])
    return CheckpointPlan(
        model_class=profile.model_class,
        blocks=tuple(
            PlannedBlock(
                path,
                p.class_name,
                c.mode,
                c.keep,
                p.signature,
                c.held_bytes,
                c.recompute_flops,
                c.offload,
                moved.host.get(path, 0) if c.offload else 0,
            )
            for (path, p), c in zip(profile.blocks, choices, strict=True)
        ),
        inputs=profile.inputs,
        budget_bytes=budget,
        none_bytes=profile.none_bytes,
        min_bytes=minimum,
        base_bytes=profile.min_bytes,
        offload=recorded(config) if config is not None else None,
        freed_bytes=moved.freed,
        window_bytes=moved.window,
        containers=containers,
    )


def plan_activation_checkpointing(
    model: nn.Module,
    example_inputs: Any,
    memory_budget: float | int | str,
    *,
    adapter: AdapterSpec | str | None = None,
    blocks: Sequence[str] | None = None,
    offload: bool | OffloadConfig | None = None,
) -> CheckpointPlan:
    """The plan with the least recompute FLOPs whose bytes held for backward stay within ``memory_budget``.

    ``example_inputs``: one forward's inputs (a dict of keyword arguments, a tuple of positional ones, or a
    tensor), real, on ``meta`` or fake: the plan is made from shapes, FLOPs and bytes. ``memory_budget``: a
    fraction of what ``none`` holds (a float, 0 < f <= 1), bytes (an int) or a size string (``"40GiB"``). A
    budget below the least possible is an error naming it in bytes; one at or above ``none`` plans no
    checkpointing (and says so). Blocks come from the adapter or ``blocks=``, as for the fixed policies.

    ``offload=True`` (or an :class:`~ac_core.OffloadConfig`, for its ``min_bytes``, ``max_inflight_bytes``,
    ``prefetch_bytes`` and ``keep_on_device``) lets the plan move checkpointed blocks' saved inputs to host memory,
    before it recomputes more; the budget then counts the device bytes offload keeps in flight and prefetched.
    Planning needs no GPU (plan on ``meta`` for a cluster); running an offloading plan needs the model on CUDA,
    and raises otherwise. The rest of the model's saved tensors stay on the device. Such a plan brings its own
    offload: apply it without ``offload=`` (which would replace it and move more than planned).

    Planning runs forwards of its own (the whole model unchecked, each distinct block alone, every block
    checkpointed) and leaves no trace on real tensors: around each, the CPU and CUDA RNG states are taken and put
    back; a dispatch mode copies a parameter or example input the first time an op writes into it and writes the
    copy back; buffers are copied up front and written back where their values changed (BatchNorm's statistics);
    replaced buffers and ``training`` flags are put back; the forward hooks and pre-hooks of user code (on the
    model's modules and global) are silenced, while torch's (FSDP2's unshard), ac-core's and the model
    libraries' run. All of it on error too. A block that changes its input in place is refused (it cannot be
    checkpointed), naming it, the argument and the op; any other failure in a planning forward names the block
    and the op. To plan from your own training step (its forward context, its loss), see
    :func:`~ac_core.profile_step`.
    """
    return _plan(resolve_blocks(model, adapter, blocks), example_inputs, memory_budget, offload)


def _check_layout(plan: CheckpointPlan, block_plan: BlockPlan) -> None:
    here = _model_class(block_plan)
    if here != plan.model_class:
        raise ValueError(f"this checkpoint plan is for {plan.model_class}, not {here}; plan this model instead")
    planned = [(b.path, b.class_name) for b in plan.blocks]
    found = [(b.path, b.class_name) for b in block_plan]
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


def _make_layer(
    keep: tuple[tuple[str, int], ...], planned: Signature, offload: PlanOffload | None, kind: Any, retained: Any,
    path: str, expects_attention: bool = True, *, root: nn.Module | None = None, preserve_rng_state: bool = True,
) -> PlannedLayer:  # fmt: skip
    if offload is not None:
        offload.install()  # built when the verb installs layers: after it took earlier offload off the model
    return PlannedLayer(
        keep, planned, path, expects_attention, root=root, offload=offload is not None,
        preserve_rng_state=preserve_rng_state,
    )  # fmt: skip


@register_policy(CheckpointPlan)
def _plan_selections(config: CheckpointPlan, block_plan: BlockPlan) -> list[BlockSelection]:
    _check_layout(config, block_plan)
    by_path = {b.path: b for b in block_plan}
    offload = PlanOffload(block_plan.model, config.offload) if config.offload is not None else None
    selections = []
    for planned in config.blocks:
        if planned.mode == NONE:
            continue
        # The layer keeps the planned occurrences; the verb installs it in place of a CheckpointLayer.
        factory = functools.partial(_make_layer, planned.keep, planned.inputs, offload if planned.offload else None)
        selections.append(BlockSelection(by_path[planned.path], CheckpointType.FULL, layer=factory))
    return selections


@register_policy(Budget)
def _budget_selections(config: Budget, block_plan: BlockPlan) -> list[BlockSelection]:
    plan = _plan(block_plan, config.example_inputs, config.memory_budget, config.offload)
    logger.info("ac-core: budget plan\n%s", plan)
    return _plan_selections(plan, block_plan)
