"""The policy registry: every route (eager, ``ac_core.compile``'s graph pass, bench, the conformance suite) asks it.

The shape of torchao's ``quantize_(model, config)``: a policy is a small frozen config plus what it registers
here with :func:`register_policy`: its eager selection (a handler from :class:`~ac_core.ModelBlocks` to one
:class:`BlockSelection` per checkpointed block), its graph-route decisions (a handler, derived from the
selections by default, or the reason it has none) and its :class:`PolicyTraits`. Callers choose by these,
never by the config's type, so a third party's policy takes every route a built-in one takes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from torch import nn

from ..blocks import Block, ModelBlocks, resolve_blocks
from ..collectives import is_collective
from ..ops import check_op_names
from ..spec import AdapterSpec
from .modes import BlockDecision, BlockMode, CheckpointType, block_mode


class PolicyConfig:
    """Base of every policy config. ``name`` is the string that selects it (``"full"``, ``"ops"`` ...)."""

    name: ClassVar[str]

    def own_containers(self) -> tuple[str, ...] | None:
        """The block containers (FQNs) this config was made for, applied where the caller names neither
        ``adapter=`` nor ``blocks=`` (a plan made with ``blocks=``); None: the adapter's, as for any policy."""
        return None


@dataclass(frozen=True)
class PolicyTraits:
    """What a policy does, for the callers that choose by it.

    ``keeps_attention``: the blocks it checkpoints keep their attention outputs (no attention kernel re-runs in
    backward); ``recomputes_all``: every block it checkpoints is recomputed whole; ``from_name``: its name alone
    builds it (bench rows and the conformance suite run it; a memory budget needs more); ``budgeted``: it plans
    for a memory budget (``ac_core.compile``'s ``solver=`` applies); ``finds_blocks``: its graph decisions need no
    named blocks (the pass finds them in the graph), so a model no adapter serves needs no ``blocks=``.
    ``n_layer_field`` / ``retain_field``: the config fields the seed's ``n_layer`` and ``retain`` knobs set, None
    where it takes no such knob; ``name_defaults``: field values when built from its name (``block_skip``:
    ``every=1``, FastVideo's n_layer).
    """

    keeps_attention: bool = False
    recomputes_all: bool = False
    from_name: bool = True
    budgeted: bool = False
    finds_blocks: bool = False
    n_layer_field: str | None = None
    retain_field: str | None = None
    name_defaults: tuple[tuple[str, object], ...] = ()


@dataclass(frozen=True)
class BlockSelection:
    """One block a policy checkpoints: ``kind`` :class:`BlockMode` ``FULL`` or ``OPS`` (``CheckpointType.FULL`` and
    ``.OPS`` are taken too), and for ``OPS`` the op names whose outputs are kept.

    ``layer`` builds the block's checkpoint layer where the policy needs its own (called with the arguments of
    ``CheckpointLayer``); None installs a CheckpointLayer. ``preserve_rng_state``: keep each call's RNG state for
    recompute (torch's default); False only where the user's config asked for it.
    """

    block: Block
    kind: BlockMode
    retained: frozenset[str] = frozenset()
    layer: Callable[..., Any] | None = None
    preserve_rng_state: bool = True

    def __post_init__(self) -> None:
        kind = block_mode(self.kind, f"selection of block {self.block.path!r}")
        if kind == BlockMode.NONE:
            raise ValueError(
                f"selection of block {self.block.path!r} has mode 'none': a policy leaves a block unchecked by not "
                "selecting it"
            )
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "retained", frozenset(self.retained))


@dataclass(frozen=True)
class GraphRequest:
    """What a policy's graph-route handler is given: the model (eager checkpointing already off it), the
    ``adapter=`` and ``blocks=`` the caller passed, and ``solver`` (who solves a memory budget)."""

    model: nn.Module
    adapter: AdapterSpec | str | None = None
    containers: Sequence[str] | None = None
    solver: str = "ac-core"

    def blocks(self) -> ModelBlocks:
        """The model's blocks, resolved as the eager verb resolves them."""
        return resolve_blocks(self.model, self.adapter, self.containers)


@dataclass(frozen=True)
class GraphDecisions:
    """A policy's decisions for the graph pass.

    ``blocks``: one :class:`BlockDecision` per block, which the pass follows; None: the pass keeps the outputs of
    its default save set plus ``retain`` in every block and alternates matmuls (``ops``). ``torch_budget``: no
    pass; torch's partitioner solves ``activation_memory_budget`` (a fraction) instead. ``recompute_free``: what
    eager checkpointing holds though recomputing it costs no FLOPs (ops outside the blocks but matmuls,
    convolutions and attention; block inputs summed from kept outputs) is left to the partitioner (True: a memory
    budget's plan, which counts what the compiled step saves) rather than saved (False); ``recompute_outside`` with
    it: nothing outside the blocks is held, the partitioner recomputes there what backward needs, matmuls
    included (cheaper than holding it where a budget is tight: a patch embedding recomputed from the batch);
    ``free_by_torch`` with it: the ops without FLOPs in ``ops`` blocks and outside the blocks carry no tag, kept or
    not, and torch's partitioner recomputes or saves them by its own rules (pointwise ops and views recomputed;
    norms, reductions, concatenations and copies saved), which costs bytes and spares time;
    ``recompute_block_inputs`` with it: values crossing a block boundary are not held as such, and the partitioner
    may recompute the previous block's ops, matmuls included, to make them (fewer bytes, more FLOPs).
    ``activation_collectives``: names of collectives (``"_c10d_functional::all_to_all_single"``) whose outputs the
    pass saves in every block where they move no parameter (told apart by what they move, as in eager); a block
    decision keeps those its ``retain`` names the same way. ``on_compiled``: run on the compiled module (a plan
    refuses inputs of other shapes there).
    """

    blocks: tuple[BlockDecision, ...] | None = None
    retain: frozenset[str] = frozenset()
    torch_budget: float | None = None
    recompute_free: bool = False
    recompute_outside: bool = False
    activation_collectives: frozenset[str] = frozenset()
    free_by_torch: bool = False
    recompute_block_inputs: bool = False
    on_compiled: Callable[[nn.Module], None] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.torch_budget is not None and self.blocks is not None:
            raise ValueError("graph decisions follow per-block decisions or torch's memory budget, not both")
        if self.blocks is not None and self.retain:
            raise ValueError("per-block decisions say what each block keeps; retain= is for decisions by op")
        if self.recompute_outside and not self.recompute_free:
            raise ValueError("recompute_outside=True goes with recompute_free=True (a memory budget's plan)")
        if self.recompute_block_inputs and not self.recompute_free:
            raise ValueError("recompute_block_inputs=True goes with recompute_free=True (a memory budget's plan)")
        if self.free_by_torch and (not self.recompute_free or self.blocks is None):
            raise ValueError("free_by_torch=True goes with recompute_free=True and per-block decisions (a plan's)")


C = TypeVar("C", bound=PolicyConfig)
PolicyHandler = Callable[[Any, ModelBlocks], list[BlockSelection]]
GraphHandler = Callable[[Any, GraphRequest], GraphDecisions]


@dataclass(frozen=True)
class _Entry:
    select: PolicyHandler
    traits: PolicyTraits
    graph: GraphHandler | str | None


_entries: dict[type[PolicyConfig], _Entry] = {}
_by_name: dict[str, type[PolicyConfig]] = {}


def register_policy(
    config_type: type[C], *, traits: PolicyTraits | None = None, graph: GraphHandler | str | None = None
) -> Callable[[Callable[[C, ModelBlocks], list[BlockSelection]]], Any]:
    """Register ``config_type`` (a frozen dataclass subclassing :class:`PolicyConfig`) with its eager handler,
    decorated: the handler takes the config and a :class:`~ac_core.ModelBlocks` and returns the
    :class:`BlockSelection` of each block to checkpoint. ``config_type.name`` becomes a string the verbs accept.

    ``graph``: the decisions ``ac_core.compile``'s graph pass follows; None derives them from the selections
    (each selected block ``FULL`` or ``OPS`` keeping its ``retained`` ops, the rest unchecked); a handler
    ``(config, GraphRequest) -> GraphDecisions`` decides itself; a string says why the policy has no graph route:
    ``ac_core.compile`` then checkpoints it eagerly inside the compiled model.
    """
    if not (isinstance(config_type, type) and issubclass(config_type, PolicyConfig)):
        raise TypeError(f"register_policy takes a PolicyConfig subclass, got {config_type!r}")
    if graph is not None and not (callable(graph) or (isinstance(graph, str) and graph)):
        raise TypeError(f"register_policy(graph=...) takes a handler, a reason (a string) or None, got {graph!r}")

    def register(handler: Callable[[C, ModelBlocks], list[BlockSelection]]) -> Callable[[C, ModelBlocks], Any]:
        _entries[config_type] = _Entry(handler, traits or PolicyTraits(), graph)
        _by_name[config_type.name] = config_type
        return handler

    return register


def unregister_policy(config_type: type[PolicyConfig]) -> None:
    """Remove a policy registered with :func:`register_policy` (mostly for tests); unknown types are ignored."""
    if _entries.pop(config_type, None) is not None:
        _by_name.pop(config_type.name, None)


def _entry(config: PolicyConfig | type[PolicyConfig]) -> _Entry:
    config_type = config if isinstance(config, type) else type(config)
    entry = _entries.get(config_type)
    if entry is None:
        raise TypeError(f"{config_type.__name__} is a PolicyConfig with no registered handler (register_policy)")
    return entry


def registered_policies(*, every: bool = False) -> dict[str, type[PolicyConfig]]:
    """Policy name -> config type of every policy its name builds, in registration order (``full``, ``ops``,
    ``block_skip``, then others); those that need more than a name (``traits.from_name`` False: ``budget``,
    ``plan``) are left out unless ``every``."""
    return {
        name: config_type for name, config_type in _by_name.items() if every or _entries[config_type].traits.from_name
    }


def policy_traits(config: PolicyConfig | type[PolicyConfig]) -> PolicyTraits:
    """The :class:`PolicyTraits` ``config`` (or its type) was registered with."""
    return _entry(config).traits


def select(config: PolicyConfig, blocks: ModelBlocks) -> list[BlockSelection]:
    """The blocks ``config``'s handler checkpoints among ``blocks``."""
    return _entry(config).select(config, blocks)


def graph_route_refusal(config: PolicyConfig) -> str | None:
    """Why ``config``'s policy has no graph route (as registered), or None where it has one."""
    graph = _entry(config).graph
    return graph if isinstance(graph, str) else None


def graph_decisions(config: PolicyConfig, request: GraphRequest) -> GraphDecisions:
    """``config``'s decisions for the graph pass on ``request.model`` (see :func:`register_policy`)."""
    graph = _entry(config).graph
    if isinstance(graph, str):
        raise ValueError(f"policy {config.name!r} has no graph route: {graph}")
    if graph is not None:
        return graph(config, request)
    return GraphDecisions(blocks=_derived(config, request.blocks()))


def _derived(config: PolicyConfig, blocks: ModelBlocks) -> tuple[BlockDecision, ...]:
    chosen = {s.block.path: s for s in select(config, blocks)}
    custom = next((s for s in chosen.values() if s.layer is not None), None)
    if custom is not None:
        raise ValueError(
            f"policy {config.name!r} installs a layer of its own on block {custom.block.path!r}, which the graph pass "
            f"cannot follow: register_policy({type(config).__name__}, graph=...) with its decisions, or with a "
            "reason (a string) to checkpoint it eagerly inside the compiled model"
        )
    decisions = []
    for block in blocks:
        selection = chosen.get(block.path)
        if selection is None:
            decisions.append(BlockDecision(block.path, BlockMode.NONE))
        elif selection.kind == BlockMode.OPS:
            # A collective retained is kept where it moves activations only (the pass's save_collectives.py).
            retain = frozenset(selection.retained)
            kept = any(not is_collective(op) for op in retain)
            decisions.append(BlockDecision(block.path, BlockMode.OPS if kept else BlockMode.FULL, retain=retain))
        else:
            decisions.append(BlockDecision(block.path, BlockMode.FULL))
    return tuple(decisions)


def _name_of(policy: object) -> str | None:
    return policy.value if isinstance(policy, CheckpointType) else policy if isinstance(policy, str) else None


def policy_config(
    policy: str | CheckpointType | PolicyConfig, n_layer: int | None = None, retain: Iterable[str] = ()
) -> PolicyConfig:
    """The config for a policy given as a config, a name or a :class:`CheckpointType`, with the seed's knobs.

    ``n_layer`` sets the field its traits name (``block_skip``'s every-n-th, default 1 as in FastVideo); given
    with a policy that takes none it is an error (except 1, which means every block anyway). ``retain`` adds kept
    ops where the traits name a field for it (``ops``). A config passed as is takes its settings from its fields.
    """
    if isinstance(policy, PolicyConfig):
        if n_layer is not None:
            raise ValueError(
                f"n_layer is set by the config's own fields; drop n_layer={n_layer!r} (e.g. BlockSkip(every={n_layer}))"
            )
        if retain:
            raise ValueError("retain is set by the config's own fields; e.g. Ops(retain={...}) instead")
        _entry(policy)
        return policy
    name = _name_of(policy)
    if name is None or name not in registered_policies():
        valid = ", ".join(repr(n) for n in registered_policies())
        raise ValueError(
            f"unknown checkpointing type {policy!r}; valid types are {valid}, or a config such as ac_core.Full()"
        )
    if n_layer is not None and (isinstance(n_layer, bool) or not isinstance(n_layer, int) or n_layer < 1):
        raise ValueError(f"n_layer must be an int >= 1 (checkpoint every n-th block), got {n_layer!r}")
    retain = check_op_names(retain, "retain")
    config_type = _by_name[name]
    traits = policy_traits(config_type)
    fields: dict[str, object] = dict(traits.name_defaults)
    if traits.n_layer_field is not None:
        if n_layer is not None:
            fields[traits.n_layer_field] = n_layer
    elif n_layer not in (None, 1):
        users = [n for n, t in registered_policies().items() if policy_traits(t).n_layer_field is not None]
        raise ValueError(
            f"n_layer={n_layer} is used by {', '.join(map(repr, users))} (every n-th block) only; {name!r} "
            f"checkpoints every block. Use apply_activation_checkpointing(model, 'block_skip', {n_layer}) or drop "
            "n_layer."
        )
    if retain:
        if traits.retain_field is None:
            keeps = "recomputes its blocks in full" if traits.recomputes_all else "keeps no op outputs"
            raise ValueError(f"retain applies to 'ops' only; {name!r} {keeps}")
        fields[traits.retain_field] = retain
    return config_type(**fields)


def containers_for(config: PolicyConfig, adapter: object, blocks: Sequence[str] | None) -> Sequence[str] | None:
    """The ``blocks=`` to resolve ``config`` with: the caller's, else (no adapter named either) the config's own."""
    return config.own_containers() if blocks is None and adapter is None else blocks
