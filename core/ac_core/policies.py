"""Checkpointing policies as small frozen configs, each with one registered handler.

The shape of torchao's ``quantize_(model, config)``: :func:`ac_core.apply_activation_checkpointing`
is the one verb; a policy is a config validated in ``__post_init__`` plus a handler that selects, from a
:class:`~ac_core.plan.BlockPlan`, which blocks to checkpoint and how. A new policy is one config and one
handler registered with :func:`register_policy`; the verb does not change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from .ops import DEFAULT_RETAINED_OPS, check_op_names
from .plan import Block, BlockPlan
from .policy import CheckpointType


class PolicyConfig:
    """Base of every policy config. ``name`` is the string that selects it (``"full"``, ``"ops"`` ...).

    ``by_name`` is False for a policy that cannot be built from its name alone (a memory budget needs the
    budget and example inputs): it is applied as a config only, and :func:`registered_policies` (what bench
    rows and the conformance suite run) leaves it out.
    """

    name: ClassVar[str]
    by_name: ClassVar[bool] = True

    def own_containers(self) -> tuple[str, ...] | None:
        """The block containers (FQNs) this config was made for, applied where the caller names neither
        ``adapter=`` nor ``blocks=`` (a plan made with ``blocks=``); None: the adapter's, as for any policy."""
        return None


def _check_rng_flag(config: PolicyConfig, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{type(config).__name__}(preserve_rng_state=...) takes True or False, got {value!r}")


@dataclass(frozen=True)
class Full(PolicyConfig):
    """Checkpoint every block of every container, each on its own; backward recomputes each block.

    ``preserve_rng_state=False`` (likewise on :class:`Ops` and :class:`BlockSkip`) skips keeping and replaying the
    RNG state of each checkpointed call: only for models that draw no random number in their blocks, ever (a
    dropout rate warmed up from 0 draws later); recompute then draws other masks than the forward did.
    """

    preserve_rng_state: bool = True
    name: ClassVar[str] = "full"

    def __post_init__(self) -> None:
        _check_rng_flag(self, self.preserve_rng_state)


@dataclass(frozen=True)
class Ops(PolicyConfig):
    """Checkpoint every block selectively: keep the outputs of attention ops, recompute the rest of the block.

    Kept: PyTorch's SDPA kernels (:data:`~ac_core.DEFAULT_RETAINED_OPS`), the adapter's attention ops, and
    ``retain`` (more dispatcher op names, e.g. ``{"mylib::attn"}``). Never a collective.
    """

    retain: frozenset[str] = frozenset()
    preserve_rng_state: bool = True
    name: ClassVar[str] = "ops"

    def __post_init__(self) -> None:
        _check_rng_flag(self, self.preserve_rng_state)
        object.__setattr__(self, "retain", check_op_names(self.retain, "Ops(retain=...)"))


@dataclass(frozen=True)
class BlockSkip(PolicyConfig):
    """Fully checkpoint the blocks whose index in their container is a multiple of ``every``."""

    every: int = 2
    preserve_rng_state: bool = True
    name: ClassVar[str] = "block_skip"

    def __post_init__(self) -> None:
        _check_rng_flag(self, self.preserve_rng_state)
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(
                f"BlockSkip(every=...) must be an int >= 1 (checkpoint every n-th block), got {self.every!r}"
            )


@dataclass(frozen=True)
class BlockSelection:
    """One block a policy checkpoints: ``kind`` FULL or OPS, and for OPS the op names whose outputs are kept.

    ``layer`` builds the block's checkpoint layer where the policy needs its own (called with the arguments
    of :class:`~ac_core._checkpoint.CheckpointLayer`); None installs a CheckpointLayer.
    ``preserve_rng_state``: keep each call's RNG state for recompute (torch's default); False only where the
    user's config asked for it.
    """

    block: Block
    kind: CheckpointType
    retained: frozenset[str] = frozenset()
    layer: Callable[..., Any] | None = None
    preserve_rng_state: bool = True


C = TypeVar("C", bound=PolicyConfig)
PolicyHandler = Callable[[Any, BlockPlan], list[BlockSelection]]

_handlers: dict[type[PolicyConfig], PolicyHandler] = {}
_by_name: dict[str, type[PolicyConfig]] = {}


def register_policy(config_type: type[C]) -> Callable[[Callable[[C, BlockPlan], list[BlockSelection]]], Any]:
    """Register the handler of ``config_type`` (a frozen dataclass subclassing :class:`PolicyConfig`).

    The handler takes the config and a :class:`BlockPlan` and returns the :class:`BlockSelection` of each
    block to checkpoint. ``config_type.name`` becomes a string the verb accepts.
    """
    if not (isinstance(config_type, type) and issubclass(config_type, PolicyConfig)):
        raise TypeError(f"register_policy takes a PolicyConfig subclass, got {config_type!r}")

    def register(handler: Callable[[C, BlockPlan], list[BlockSelection]]) -> Callable[[C, BlockPlan], Any]:
        _handlers[config_type] = handler
        _by_name[config_type.name] = config_type
        return handler

    return register


def unregister_policy(config_type: type[PolicyConfig]) -> None:
    """Remove a policy registered with :func:`register_policy` (mostly for tests); unknown types are ignored."""
    if _handlers.pop(config_type, None) is not None:
        _by_name.pop(config_type.name, None)


def registered_policies() -> dict[str, type[PolicyConfig]]:
    """Policy name -> config type of every policy a name selects, in registration order (``full``, ``ops``,
    ``block_skip``, then others); policies applied as configs only (``by_name = False``) are left out."""
    return {name: config_type for name, config_type in _by_name.items() if config_type.by_name}


def policy_config(
    policy: str | CheckpointType | PolicyConfig, n_layer: int | None = None, retain: Iterable[str] = ()
) -> PolicyConfig:
    """The config for a policy given as a config, a name or a :class:`CheckpointType`, with the seed's knobs.

    ``n_layer`` is ``block_skip``'s every-n-th (default 1, as in FastVideo); given with a policy that does
    not use it, it is an error (except 1, which means every block anyway). ``retain`` adds kept ops to
    ``ops``. A config passed as is takes its settings from its own fields.
    """
    if isinstance(policy, PolicyConfig):
        if n_layer is not None:
            raise ValueError(
                f"n_layer is set by the config's own fields; drop n_layer={n_layer!r} (e.g. BlockSkip(every={n_layer}))"
            )
        if retain:
            raise ValueError("retain is set by the config's own fields; e.g. Ops(retain={...}) instead")
        if type(policy) not in _handlers:
            raise TypeError(f"{type(policy).__name__} is a PolicyConfig with no registered handler (register_policy)")
        return policy
    name = policy.value if isinstance(policy, CheckpointType) else policy
    if not isinstance(name, str) or name not in registered_policies():
        valid = ", ".join(repr(n) for n in registered_policies())
        raise ValueError(
            f"unknown checkpointing type {policy!r}; valid types are {valid}, or a config such as ac_core.Full()"
        )
    if n_layer is not None and (isinstance(n_layer, bool) or not isinstance(n_layer, int) or n_layer < 1):
        raise ValueError(f"n_layer must be an int >= 1 (checkpoint every n-th block), got {n_layer!r}")
    retain = check_op_names(retain, "retain")
    if name == BlockSkip.name:
        if retain:
            raise ValueError("retain applies to 'ops' only; 'block_skip' recomputes its blocks in full")
        return BlockSkip(every=1 if n_layer is None else n_layer)
    if n_layer not in (None, 1):
        raise ValueError(
            f"n_layer={n_layer} is used by 'block_skip' (every n-th block) only; {name!r} checkpoints every "
            f"block. Use apply_activation_checkpointing(model, 'block_skip', {n_layer}) or drop n_layer."
        )
    if name == Ops.name:
        return Ops(retain=retain)
    if retain:
        raise ValueError(f"retain applies to 'ops' only; {name!r} keeps no op outputs")
    return _by_name[name]()


def containers_for(config: PolicyConfig, adapter: object, blocks: Sequence[str] | None) -> Sequence[str] | None:
    """The ``blocks=`` to resolve ``config`` with: the caller's, else (no adapter named either) the config's own."""
    return config.own_containers() if blocks is None and adapter is None else blocks


def select(config: PolicyConfig, plan: BlockPlan) -> list[BlockSelection]:
    """The blocks ``config``'s handler checkpoints in ``plan``."""
    return _handlers[type(config)](config, plan)


def retained_ops(plan: BlockPlan, extra: Iterable[str] = ()) -> frozenset[str]:
    """Op names ``ops`` keeps for ``plan``: PyTorch's SDPA kernels, the adapter's attention ops, and ``extra``."""
    adapter_ops = plan.adapter.retained_ops() if plan.adapter is not None else frozenset()
    return DEFAULT_RETAINED_OPS | adapter_ops | frozenset(extra)


@register_policy(Full)
def _full(config: Full, plan: BlockPlan) -> list[BlockSelection]:
    rng = config.preserve_rng_state
    return [BlockSelection(block, CheckpointType.FULL, preserve_rng_state=rng) for block in plan]


@register_policy(Ops)
def _ops(config: Ops, plan: BlockPlan) -> list[BlockSelection]:
    kept = retained_ops(plan, config.retain)
    return [
        BlockSelection(block, CheckpointType.OPS, kept, preserve_rng_state=config.preserve_rng_state) for block in plan
    ]


@register_policy(BlockSkip)
def _block_skip(config: BlockSkip, plan: BlockPlan) -> list[BlockSelection]:
    rng = config.preserve_rng_state
    return [
        BlockSelection(block, CheckpointType.FULL, preserve_rng_state=rng)
        for block in plan
        if block.index % config.every == 0
    ]
