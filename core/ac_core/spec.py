"""The adapter contract: what an adapter declares about a model family, as frozen data.

An adapter imports nothing of its library when it is loaded: served classes are import
strings, and the callables it names import their library only when called.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, cast

import torch
from torch import nn

from .collectives import is_collective
from .errors import AdapterError
from .refs import is_ref, load_ref


def _tupled(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, tuple(value))


@dataclass(frozen=True)
class AttentionBackend:
    """An attention implementation a model can run, and which dispatcher ops carry its output.

    ``ops`` are dispatcher op names (``OpOverload.name()``, e.g. ``"aten::_scaled_dot_product_flash_attention"``);
    names, not op objects, so that a backend's custom op can be named before its library registers it.
    A backend whose attention decomposes into many small ops sets ``not_retainable`` to the reason instead.
    ``devices`` are the device types it runs on; ``requires`` the importable modules it needs.
    """

    name: str
    ops: tuple[str, ...] = ()
    not_retainable: str | None = None
    devices: tuple[str, ...] = ("cpu", "cuda")
    requires: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for attr in ("ops", "devices", "requires"):
            _tupled(self, attr, getattr(self, attr))
        if not self.name:
            raise AdapterError("AttentionBackend.name must be a non-empty string")
        if bool(self.ops) == bool(self.not_retainable):
            raise AdapterError(
                f"attention backend {self.name!r}: give either ops (the dispatcher op names that carry the "
                "attention output) or not_retainable (the reason none can be retained), not both or neither"
            )
        for op in self.ops:
            if not isinstance(op, str) or not op:
                raise AdapterError(f"attention backend {self.name!r}: op names must be non-empty strings, got {op!r}")
            if is_collective(op):
                raise AdapterError(
                    f"attention backend {self.name!r} names the collective {op!r}; collectives are never "
                    "retained (under FSDP2 that would keep every block's unsharded weights alive)"
                )

    @property
    def retainable(self) -> bool:
        return bool(self.ops)

    def is_available(self, device: str | torch.device) -> bool:
        """Whether this backend can run on ``device`` here: the device type is declared and its modules import."""
        device_type = torch.device(device).type
        if device_type not in self.devices:
            return False
        return all(importlib.util.find_spec(module) is not None for module in self.requires)


@dataclass(frozen=True)
class ExcludedContainer:
    """A container of blocks deliberately left unchecked, with the reason (e.g. a refiner over few tokens)."""

    path: str
    reason: str

    def __post_init__(self) -> None:
        if not self.path or not self.reason:
            raise AdapterError("ExcludedContainer needs both a path and a reason")


@dataclass
class ModelCase:
    """A built model with inputs and a loss: what an adapter's factories return for tests and benchmarks."""

    model: nn.Module
    inputs: Mapping[str, Any]
    loss: Callable[[Any], torch.Tensor]

    def run(self) -> torch.Tensor:
        """One forward pass and the scalar loss."""
        return self.loss(self.model(**self.inputs))

    def to(self, device: str | torch.device, dtype: torch.dtype | None = None) -> ModelCase:
        """Move the model and every floating tensor input (and ``dtype`` when given); returns self."""
        # No dtype argument unless one is given: diffusers warns about its fp32 modules on any dtype passed.
        if dtype is None:
            self.model.to(device)
        else:
            self.model.to(device, dtype)

        def move(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                cast = dtype if dtype is not None and value.is_floating_point() else None
                return value.to(device=device, dtype=cast)
            if isinstance(value, (list, tuple)):
                return type(value)(move(v) for v in value)
            if isinstance(value, dict):
                return {k: move(v) for k, v in value.items()}
            return value

        self.inputs = {k: move(v) for k, v in self.inputs.items()}
        return self


Factory = Callable[..., ModelCase] | str
"""A model factory as a spec declares it: the callable, or ``"module:attr"`` naming it (imported when used)."""


def _check_factory(value: object, where: str) -> None:
    if not (callable(value) or is_ref(value)):
        raise AdapterError(f"{where} must be a callable or a 'package.module:attribute' string, got {value!r}")


def _load_factory(value: Factory, what: str) -> Callable[..., ModelCase]:
    if not isinstance(value, str):
        return value
    factory = load_ref(value, what=what)
    if not callable(factory):
        raise AdapterError(f"{what} {value!r} is a {type(factory).__name__}, not a callable")
    return cast("Callable[..., ModelCase]", factory)


def class_path(cls: type) -> str:
    """``module.QualName`` of a class, as adapters spell served classes."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _path_names_class(import_path: str, cls: type) -> bool:
    # "diffusers.FluxTransformer2DModel" names the class defined deeper in diffusers too.
    if import_path == class_path(cls):
        return True
    head, _, tail = import_path.rpartition(".")
    return tail == cls.__qualname__ and head.split(".")[0] == cls.__module__.split(".")[0]


@dataclass(frozen=True)
class ModelSpec:
    """One model class an adapter serves.

    ``cls`` is an import string (``"diffusers.FluxTransformer2DModel"`` or the full module path).
    ``containers`` are dotted paths from the model to ModuleLists, ModuleDicts (torchtitan's ``layers``)
    or Sequentials of blocks; a ``*`` segment stands for every child of a ModuleDict of such containers
    (``"mode_blocks.*"``). A block's index is its position in its container. ``attention_calls`` maps each
    block class name to the attention calls one forward of it makes: an int, or, where blocks of one
    class make different numbers of calls (SD3.5's ``dual_attention_layers``), a mapping from the
    block's index in its container to its calls, as the tiny model lays them out (``{0: 2, 1: 1}``;
    ``ac-core inspect module:Class --draft`` prints it). A class with 0 calls is a block without
    attention (ac-core never looks for attention in it). ``versions`` is a
    requirement string (``"diffusers>=0.42"``) for the library versions whose layout this declares.
    ``tiny`` builds a tiny :class:`ModelCase` from a config in code, with no download; it seeds torch
    itself, so every call builds the same weights and inputs. It and the ``presets`` are given as
    callables or as ``"module:attr"`` strings, imported only when :meth:`build_tiny` or :meth:`preset`
    needs them (so a spec reads as data and imports no factory code).
    ``compile_unsupported`` says why torch.compile cannot train this model even without ac-core (an
    upstream failure); the conformance suite checks that claim on the plain model instead of compiling ours.
    ``meta_unsupported`` says why the model cannot run on ``meta`` tensors (its forward reads a tensor's value),
    so memory-budget plans are made on real tensors only; the conformance suite checks that claim too.
    ``presets`` map a preset name (e.g. ``"wan2.1-1.3b"``) to a factory taking keyword options
    (``layers``, ``seq``) that builds a few blocks at the real model's width.
    """

    cls: str
    containers: tuple[str, ...]
    excluded: tuple[ExcludedContainer, ...] = ()
    attention_calls: Mapping[str, int | Mapping[int, int]] = field(default_factory=dict)
    versions: str | None = None
    tiny: Factory | None = None
    presets: Mapping[str, Factory] = field(default_factory=dict)
    compile_unsupported: str | None = None
    meta_unsupported: str | None = None

    def __post_init__(self) -> None:
        _tupled(self, "containers", self.containers)
        _tupled(self, "excluded", self.excluded)
        object.__setattr__(
            self,
            "attention_calls",
            MappingProxyType(
                {
                    block: calls if isinstance(calls, int) else MappingProxyType(dict(calls))
                    for block, calls in self.attention_calls.items()
                }
            ),
        )
        object.__setattr__(self, "presets", MappingProxyType(dict(self.presets)))
        if "." not in self.cls:
            raise AdapterError(f"ModelSpec.cls must be an import string like 'pkg.Class', got {self.cls!r}")
        if not self.containers:
            raise AdapterError(f"ModelSpec for {self.cls} declares no block containers")
        overlap = set(self.containers) & {e.path for e in self.excluded}
        if overlap:
            raise AdapterError(f"ModelSpec for {self.cls}: {sorted(overlap)} both checkpointed and excluded")
        for block, calls in self.attention_calls.items():
            per_index = calls.items() if isinstance(calls, Mapping) else [(0, calls)]
            if isinstance(calls, bool) or not all(
                type(i) is int and i >= 0 and type(n) is int and n >= 0 for i, n in per_index
            ):
                got = dict(calls) if isinstance(calls, Mapping) else calls
                raise AdapterError(
                    f"ModelSpec for {self.cls}: attention_calls[{block!r}] must be an int >= 0, or a mapping "
                    f"of block index (int >= 0) to an int >= 0; got {got!r}"
                )
        if self.tiny is not None:
            _check_factory(self.tiny, f"ModelSpec for {self.cls}: tiny")
        for name, factory in self.presets.items():
            _check_factory(factory, f"ModelSpec for {self.cls}: presets[{name!r}]")

    @property
    def class_name(self) -> str:
        return self.cls.rpartition(".")[2]

    def calls_of(self, block_class: str, index: int | None = None) -> int | None:
        """The attention calls ``attention_calls`` declares for one block of ``block_class``, the ``index``-th
        of its container; None where it declares nothing for that class (or, for a per-index count, that index)."""
        calls = self.attention_calls.get(block_class)
        if calls is None or isinstance(calls, int):
            return calls
        return None if index is None else calls.get(index)

    @property
    def tiny_name(self) -> str | None:
        """The tiny factory's name (``"tiny_wan"``): the callable's, or the attribute its reference names."""
        if self.tiny is None:
            return None
        if isinstance(self.tiny, str):
            return self.tiny.rpartition(":")[2].rpartition(".")[2]
        return getattr(self.tiny, "__name__", "tiny")

    def build_tiny(self) -> ModelCase:
        """A tiny :class:`ModelCase` from the ``tiny`` factory (imported first where it is a reference)."""
        if self.tiny is None:
            raise AdapterError(f"ModelSpec for {self.cls} declares no tiny factory")
        return _load_factory(self.tiny, f"tiny factory of {self.class_name}")()

    def preset(self, name: str) -> Callable[..., ModelCase]:
        """The factory of preset ``name`` (imported first where it is a reference); call it with ``layers``/``seq``."""
        if name not in self.presets:
            raise AdapterError(f"{self.class_name} has no preset {name!r}; its presets are {sorted(self.presets)}")
        return _load_factory(self.presets[name], f"preset {name!r} of {self.class_name}")

    def matches(self, cls: type) -> bool:
        """Whether this spec serves ``cls`` or one of its bases."""
        return any(_path_names_class(self.cls, base) for base in cls.__mro__)


@dataclass(frozen=True)
class AdapterSpec:
    """Everything ac-core needs to know about one model family.

    ``library`` is the distribution the family comes from and ``extra`` the ac-core extra that installs it.
    ``requirements`` say in words what training under checkpointing needs; ``prepare(model)`` arranges
    them (and logs what it changed). ``set_backend(model, name)`` switches the model's attention backend;
    ``token_count(model, inputs)`` gives the tokens one forward's main attention processes, over the whole
    batch (Llama: batch x sequence; Wan: latent patches; Flux: image plus text tokens).

    ``backends`` are the attention implementations the served models can run, each with the dispatcher
    ops that carry its output (what ``Ops()`` retains) or the reason none can be retained. ``default_backend``
    names the one a freshly built model runs: the tiny model built by each ``ModelSpec.tiny`` must run it
    as built (the conformance suite checks that the default backend's ops run in its forward), because a
    backend other than the default is reached only through ``set_backend``; without ``set_backend`` only
    the default is tested.

    For a diffusers model whose attention processors go through diffusers' attention dispatcher
    (``dispatch_attention_fn``: Flux, Chroma, Wan, HunyuanVideo), declare
    ``backends=ac_core.libraries.diffusers.attention_backends()``, ``default_backend="native"`` and
    ``set_backend=ac_core.libraries.diffusers.set_attention_backend``. Where the processor calls
    ``torch.nn.functional.scaled_dot_product_attention`` itself (SD3's ``JointAttnProcessor2_0``,
    CogVideoX's), diffusers' backend setting never reaches it: declare one backend with
    ``ops=tuple(sorted(DEFAULT_RETAINED_OPS))`` as the default, and switch processors in your own
    ``set_backend`` if you declare more. ``ac-core inspect module:Class`` says which of the two a model is.
    """

    name: str
    models: tuple[ModelSpec, ...]
    backends: tuple[AttentionBackend, ...] = ()
    default_backend: str | None = None
    library: str | None = None
    extra: str | None = None
    requirements: tuple[str, ...] = ()
    prepare: Callable[[nn.Module], None] | None = None
    set_backend: Callable[[nn.Module, str], None] | None = None
    token_count: Callable[[nn.Module, Mapping[str, Any]], int] | None = None

    def __post_init__(self) -> None:
        for attr in ("models", "backends", "requirements"):
            _tupled(self, attr, getattr(self, attr))
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise AdapterError(f"adapter name must be a non-empty word (letters, digits, '-', '_'): {self.name!r}")
        if not self.models:
            raise AdapterError(f"adapter {self.name!r} serves no model class")
        names = [b.name for b in self.backends]
        if len(set(names)) != len(names):
            raise AdapterError(f"adapter {self.name!r} declares an attention backend twice: {names}")
        if self.default_backend is not None and self.default_backend not in names:
            raise AdapterError(
                f"adapter {self.name!r}: default_backend {self.default_backend!r} is not among its backends {names}"
            )

    def model_spec(self, model: nn.Module | type) -> ModelSpec | None:
        """The ModelSpec serving ``model`` (an instance or a class), or None."""
        cls = model if isinstance(model, type) else type(model)
        return next((m for m in self.models if m.matches(cls)), None)

    def serves(self, model: nn.Module | type) -> bool:
        return self.model_spec(model) is not None

    def model_label(self, model: ModelSpec) -> str:
        """``ModelClass``, or ``ModelClass-tiny_factory`` where this adapter declares the class more than
        once (one spec per block variant), so that reports and test ids tell the variants apart."""
        if sum(m.cls == model.cls for m in self.models) > 1 and model.tiny is not None:
            return f"{model.class_name}-{model.tiny_name}"
        return model.class_name

    def backend(self, name: str) -> AttentionBackend:
        for backend in self.backends:
            if backend.name == name:
                return backend
        raise AdapterError(
            f"adapter {self.name!r} has no attention backend {name!r}; it declares {[b.name for b in self.backends]}"
        )

    def retained_ops(self) -> frozenset[str]:
        """Every op name that carries attention output in one of this adapter's retainable backends."""
        return frozenset(op for b in self.backends for op in b.ops)

    @property
    def install_hint(self) -> str:
        return f"pip install 'ac-core[{self.extra}]'" if self.extra else f"pip install {self.library or self.name}"
