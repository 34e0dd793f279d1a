"""The fixed policies: ``full``, ``ops`` and ``block_skip``, each a config and its registration."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

from ..blocks import ModelBlocks
from ..collectives import ACTIVATION_COLLECTIVES, is_collective
from ..ops import DEFAULT_RETAINED_OPS, ROUTING_OPS, check_op_names
from ..registry import find_adapter, get_adapter
from .modes import BlockMode
from .registry import BlockSelection, GraphDecisions, GraphRequest, PolicyConfig, PolicyTraits, register_policy


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

    Kept: PyTorch's SDPA kernels (:data:`~ac_core.DEFAULT_RETAINED_OPS`), the adapter's attention ops, a
    mixture-of-experts router's decision (:data:`~ac_core.ops.ROUTING_OPS`, so that recompute sends each token
    to the same experts), the collectives that carry activations (the adapter's ``activation_collectives``, by
    default :data:`~ac_core.collectives.ACTIVATION_COLLECTIVES`: Ulysses' all-to-alls) where what they move is no
    parameter of the block, and ``retain`` (more dispatcher op names, e.g. ``{"mylib::attn"}``, functional
    collectives among them). Never a parameter collective (FSDP2's all-gathers). ``collectives=False`` keeps no
    collective: backward then re-runs every collective of the blocks' forward, for less memory held.
    """

    retain: frozenset[str] = frozenset()
    preserve_rng_state: bool = True
    collectives: bool = True
    name: ClassVar[str] = "ops"

    def __post_init__(self) -> None:
        _check_rng_flag(self, self.preserve_rng_state)
        object.__setattr__(self, "retain", check_op_names(self.retain, "Ops(retain=...)"))
        if not isinstance(self.collectives, bool):
            raise TypeError(f"Ops(collectives=...) takes True or False, got {self.collectives!r}")
        named = sorted(op for op in self.retain if is_collective(op))
        if named and not self.collectives:
            raise ValueError(f"Ops(retain={named}, collectives=False) keeps and refuses the same collectives: drop one")


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


def retained_ops(blocks: ModelBlocks, extra: Iterable[str] = (), collectives: bool = True) -> frozenset[str]:
    """Op names ``ops`` keeps in ``blocks``: PyTorch's SDPA kernels, the adapter's attention ops, the MoE routing
    ops, ``extra``, and with ``collectives`` the activation collectives the adapter declares (the default ones
    where no adapter serves the model); a collective among them is kept only where it moves activations."""
    adapter = blocks.adapter
    adapter_ops = adapter.retained_ops() if adapter is not None else frozenset()
    kept = DEFAULT_RETAINED_OPS | ROUTING_OPS | adapter_ops | frozenset(extra)
    if not collectives:
        return kept
    return kept | (frozenset(adapter.activation_collectives) if adapter is not None else ACTIVATION_COLLECTIVES)


@register_policy(Full, traits=PolicyTraits(recomputes_all=True))
def _full(config: Full, blocks: ModelBlocks) -> list[BlockSelection]:
    rng = config.preserve_rng_state
    return [BlockSelection(block, BlockMode.FULL, preserve_rng_state=rng) for block in blocks]


def _ops_on_the_graph(config: Ops, request: GraphRequest) -> GraphDecisions:
    # The pass's own save set (SDPA kernels, the adapter's ops) and its matmul alternation, in every block it finds:
    # blocks need not be named, the pass finds them in the graph. The routing decision is kept there too. The
    # activation collectives (those named in retain, and with collectives=True the adapter's) go apart: the pass
    # keeps them only where they move no parameter.
    named = frozenset(op for op in config.retain if is_collective(op))
    collectives = named | (_activation_collectives(request) if config.collectives else frozenset())
    return GraphDecisions(retain=(config.retain - named) | ROUTING_OPS, activation_collectives=collectives)


def _activation_collectives(request: GraphRequest) -> frozenset[str]:
    """The activation collectives of the adapter serving the request's model (the default ones without one)."""
    adapter = get_adapter(request.adapter) if request.adapter is not None else find_adapter(request.model)
    return frozenset(adapter.activation_collectives) if adapter is not None else ACTIVATION_COLLECTIVES


@register_policy(
    Ops, traits=PolicyTraits(keeps_attention=True, finds_blocks=True, retain_field="retain"), graph=_ops_on_the_graph
)
def _ops(config: Ops, blocks: ModelBlocks) -> list[BlockSelection]:
    kept = retained_ops(blocks, config.retain, config.collectives)
    rng = config.preserve_rng_state
    return [BlockSelection(block, BlockMode.OPS, kept, preserve_rng_state=rng) for block in blocks]


@register_policy(
    BlockSkip, traits=PolicyTraits(recomputes_all=True, n_layer_field="every", name_defaults=(("every", 1),))
)
def _block_skip(config: BlockSkip, blocks: ModelBlocks) -> list[BlockSelection]:
    rng = config.preserve_rng_state
    chosen = [block for block in blocks if block.index % config.every == 0]
    return [BlockSelection(block, BlockMode.FULL, preserve_rng_state=rng) for block in chosen]
