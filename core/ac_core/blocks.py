"""A model's blocks, resolved once: ``resolve_blocks(model) -> ModelBlocks``.

Every consumer (checkpointing policies, offload, the torch.compile route, the conformance suite,
``ac-core inspect`` and ``bench``) reads blocks from a :class:`ModelBlocks`, so the adapter lookup, the
"does not serve" check and the version check happen in one place.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from torch import nn

from .containers import CONTAINER_TYPES, inner_container, module_lists
from .errors import AdapterError
from .libraries.route import route_source
from .refs import load_ref
from .registry import get_adapter
from .spec import AdapterSpec, ModelSpec, class_path
from .unwrap import unwrap_model
from .versions import check_version


def _containers_of(model: nn.Module) -> str:
    return f"{type(model).__name__}'s block containers are {module_lists(model) or 'none'}"


def _did_you_mean(path: str, model: nn.Module) -> str:
    close = difflib.get_close_matches(path, module_lists(model), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def modules_at(model: nn.Module, path: str) -> list[tuple[str, nn.Module]] | None:
    """The modules a dotted path names, with their FQNs; ``*`` expands over a ModuleDict's children.

    Returns None when some segment is missing.
    """
    found: list[tuple[str, nn.Module]] = [("", model)]
    for segment in path.split("."):
        step: list[tuple[str, nn.Module]] = []
        for prefix, module in found:
            if segment == "*":
                children = list(module.named_children())
            else:
                child = module._modules.get(segment)
                if child is None:
                    return None
                children = [(segment, child)]
            step.extend((f"{prefix}.{name}" if prefix else name, child) for name, child in children)
        found = step
    return found


@dataclass(frozen=True, eq=False)
class Block:
    """One block: its FQN, the module, its position in its container, and whether it is expected to run attention.

    A block of a ModuleDict keeps its key in its FQN (``layers.0``, ``layers.my_key``).

    ``expects_attention`` is False where the adapter declares the block class attention-free (0 calls):
    ``ops`` retains nothing there by design, which is not worth a warning.
    """

    path: str
    module: nn.Module
    index: int
    container: str
    expects_attention: bool = True

    @property
    def class_name(self) -> str:
        return type(self.module).__name__


@dataclass(frozen=True, eq=False)
class Container:
    """A ModuleList, ModuleDict (its values) or Sequential of blocks, by FQN."""

    path: str
    blocks: tuple[Block, ...]


@dataclass(frozen=True, eq=False)
class ExcludedModules:
    """A container the adapter leaves unchecked on purpose, the reason, and the modules found at its path."""

    path: str
    reason: str
    modules: tuple[tuple[str, nn.Module], ...]

    @property
    def found(self) -> bool:
        return bool(self.modules)


@dataclass(frozen=True, eq=False)
class ModelBlocks:
    """A model's blocks as its adapter (or ``blocks=``) declares them, resolved against the model itself.

    ``adapter`` and ``model_spec`` are None where ``blocks=`` named the containers; ``source`` says in
    words who named them (``"adapter 'wan'"``, ``"the diffusers library route"`` for a spec derived from what
    the library declares, or ``"blocks="``), for messages. Every path is an FQN in
    ``model``, the model as passed: for a model inside a wrapper (a peft ``PeftModel``, torch.compile's
    ``OptimizedModule``, DDP) the adapter serves the model at ``served_path`` (``"base_model.model"`` in a
    PeftModel, ``"_orig_mod"``, ``"module"``; ``""``: the model itself), and block paths start with it.
    """

    model: nn.Module
    adapter: AdapterSpec | None
    model_spec: ModelSpec | None
    containers: tuple[Container, ...]
    excluded: tuple[ExcludedModules, ...]
    source: str
    served_path: str = ""

    @property
    def served_model(self) -> nn.Module:
        """The module at ``served_path``: the model the adapter serves (``model`` itself unless wrapped)."""
        return self.model.get_submodule(self.served_path)

    @property
    def blocks(self) -> tuple[Block, ...]:
        """Every block, container by container, in order."""
        return tuple(block for container in self.containers for block in container.blocks)

    @property
    def paths(self) -> frozenset[str]:
        """Every block's FQN."""
        return frozenset(block.path for block in self.blocks)

    def __iter__(self) -> Iterator[Block]:
        return iter(self.blocks)

    def __len__(self) -> int:
        return sum(len(container.blocks) for container in self.containers)


def _full_path(model_spec: ModelSpec) -> str:
    """The served class's module path as defined (``diffusers.WanTransformer3DModel`` is defined deeper), or
    ``cls`` as declared where it does not import."""
    head, _, tail = model_spec.cls.rpartition(".")
    try:
        served = load_ref(f"{head}:{tail}", what="served class")
    except Exception:  # not installed, or a lazy module that fails to resolve the name: keep the declared path
        return model_spec.cls
    return class_path(served) if isinstance(served, type) else model_spec.cls


def _same_name(adapter: AdapterSpec, model: nn.Module) -> str | None:
    """Both full paths, where a served class has the name of the model's class (or of a class it wraps)."""
    for path, inner in unwrap_model(model):
        cls = type(inner)
        model_spec = next((m for m in adapter.models if m.class_name == cls.__name__), None)
        if model_spec is not None:
            which = f"the model it wraps at {path!r}" if path else "this model"
            return (
                f"{which} is {class_path(cls)}; adapter {adapter.name!r} serves {_full_path(model_spec)}, a "
                "different class of the same name"
            )
    return None


def _not_served(adapter: AdapterSpec, model: nn.Module) -> AdapterError:
    served = ", ".join(m.class_name for m in adapter.models)
    wrapped = "".join(f", wrapping {type(inner).__name__} at {path!r}" for path, inner in unwrap_model(model)[1:])
    same = _same_name(adapter, model)
    why = f": {same};" if same else f" (it serves {served});"
    return AdapterError(
        f"adapter {adapter.name!r} does not serve {type(model).__name__}{wrapped}{why} pass the right adapter, or "
        f"name the containers with blocks=[...] (FQNs in the model you pass; {_containers_of(model)})"
    )


def _served(spec: AdapterSpec, model: nn.Module) -> tuple[str, nn.Module, ModelSpec]:
    """The (FQN, module, model spec) of the first of ``model`` and the models it wraps that ``spec`` serves."""
    for path, inner in unwrap_model(model):
        model_spec = spec.model_spec(inner)
        if model_spec is not None:
            return path, inner, model_spec
    raise _not_served(spec, model)


def _prefixed(prefix: str, path: str) -> str:
    return f"{prefix}.{path}" if prefix else path


def _resolve_path(model: nn.Module, path: str, served_path: str | None) -> list[tuple[str, nn.Module]] | None:
    """The modules ``path`` names, as FQNs in ``model``: under the served model (an adapter's containers), or
    where ``served_path`` is None (``blocks=``), in ``model`` itself and else in the first model it wraps that
    has them (``blocks=["model.layers"]`` on a PeftModel)."""
    if served_path is not None:
        found = modules_at(model.get_submodule(served_path), path)
        return None if found is None else [(_prefixed(served_path, fqn), m) for fqn, m in found]
    for prefix, inner in unwrap_model(model):
        found = modules_at(inner, path)
        if found is not None:
            return [(_prefixed(prefix, fqn), m) for fqn, m in found]
    return None


def _containers(
    model: nn.Module, paths: Sequence[str], source: str, attention_free: frozenset[str], served_path: str | None
) -> list[Container]:
    result = []
    for path in paths:
        resolved = _resolve_path(model, path, served_path)
        if resolved is None:
            raise AdapterError(
                f"{source} names block container {path!r}, which {type(model).__name__} does not have; "
                f"{_containers_of(model)}.{_did_you_mean(path, model)}"
            )
        for fqn, container in resolved:
            if not isinstance(container, CONTAINER_TYPES):
                # "layers.*" over a ModuleDict of blocks expands into the blocks themselves.
                whole = f"; name {path[:-2]!r} for the blocks in it" if path.endswith(".*") else ""
                raise AdapterError(
                    f"{source} names {fqn!r} as a block container, but it is a {type(container).__name__}, not a "
                    f"ModuleList, ModuleDict or Sequential{whole}; {_containers_of(model)}"
                )
            inner = inner_container(container)
            if inner is not None:
                raise AdapterError(
                    f"{source} names {fqn!r} as a block container, but its item {inner!r} is a "
                    f"{type(container.get_submodule(inner)).__name__}, a container rather than a block; name "
                    f"{path + '.*'!r} for the blocks of each of its containers"
                )
            blocks = tuple(
                Block(f"{fqn}.{name}", block, index, fqn, type(block).__name__ not in attention_free)
                for index, (name, block) in enumerate(container.named_children())
            )
            result.append(Container(fqn, blocks))
    return result


def resolve_blocks(
    model: nn.Module,
    adapter: AdapterSpec | str | None = None,
    blocks: Sequence[str] | None = None,
    *,
    check_versions: bool = True,
) -> ModelBlocks:
    """Resolve ``model``'s blocks once: find the adapter, check it serves the model and the library version,
    and find every container and block; raises an error naming the fix before anything changes.

    The adapter is found from the model's class (``adapter=None``; for a diffusers or transformers model no
    registered adapter serves, the library route derives one from what the class declares), named (a
    registered name or ``"module:attr"``), or given as an :class:`AdapterSpec`. ``blocks=["layers"]`` names
    the containers instead (no adapter needed; with ``adapter=`` too, the adapter still supplies its attention
    ops).
    ``check_versions=False`` skips the library-version check (``ac-core inspect`` reports it instead).

    A model inside a peft ``PeftModel``, torch.compile's ``OptimizedModule`` or DDP (as accelerate's
    ``prepare`` gives it) is served by its own adapter, and every path in the result is an FQN in the model as
    passed (``base_model.model.model.layers.0`` for a PeftModel of a LlamaForCausalLM). ``blocks=`` paths
    are FQNs in the model as passed, or else paths in the model it wraps (``blocks=["model.layers"]``).
    """
    if blocks is not None and isinstance(blocks, str):
        raise TypeError(f"blocks takes a list of container paths, e.g. blocks=[{blocks!r}]")
    spec = get_adapter(model if adapter is None else adapter) if adapter is not None or blocks is None else None
    model_spec = None
    served_path = ""
    if blocks is not None:
        paths, source, excluded_specs = tuple(blocks), "blocks=", ()
        if spec is not None:  # adapter= with blocks=: it need not serve the model, but where it does, say where
            served_path = next((path for path, inner in unwrap_model(model) if spec.serves(inner)), "")
    else:
        assert spec is not None
        served_path, _, model_spec = _served(spec, model)
        if check_versions:
            check_version(spec, model_spec)
        source = route_source(spec) or f"adapter {spec.name!r}"
        paths, excluded_specs = model_spec.containers, model_spec.excluded
    attention_free = (
        frozenset(name for name, calls in model_spec.attention_calls.items() if calls == 0)
        if model_spec is not None
        else frozenset()
    )
    containers = _containers(model, paths, source, attention_free, None if model_spec is None else served_path)
    if not any(container.blocks for container in containers):
        raise AdapterError(
            f"{source} matched no block in {type(model).__name__} (containers {list(paths)} are empty); "
            f"{_containers_of(model)}"
        )
    excluded = tuple(
        ExcludedModules(
            _prefixed(served_path, e.path), e.reason, tuple(_resolve_path(model, e.path, served_path) or ())
        )
        for e in excluded_specs
    )
    return ModelBlocks(model, spec, model_spec, tuple(containers), excluded, source, served_path)


def model_blocks(
    model: nn.Module, *, adapter: AdapterSpec | str | None = None, blocks: Sequence[str] | None = None
) -> list[tuple[str, nn.Module]]:
    """(FQN, block) for every block of ``model``, in order: :func:`resolve_blocks` as pairs.

    Under FSDP2 these are the modules to ``fully_shard`` one by one before sharding the root.
    """
    return [(block.path, block.module) for block in resolve_blocks(model, adapter, blocks)]
