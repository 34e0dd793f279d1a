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

from .collectives import ACTIVATION_COLLECTIVES, check_activation_collectives, is_collective
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
                    f"attention backend {self.name!r} names the collective {op!r} among its attention ops; a "
                    "collective that carries activations goes in AdapterSpec.activation_collectives (kept where "
                    "it moves no parameter: an FSDP2 all-gather kept would hold every block's unsharded weights)"
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


def _nearest(size: int, first: int, step: int) -> int:
    """The value of ``first + k * step`` (k >= 0) nearest ``size``."""
    return first + max(0, round((size - first) / step)) * step


@dataclass(frozen=True)
class VideoGeometry:
    """How a model's inputs as users state them (frames, height and width in pixels) become its tokens.

    The VAE encodes the first frame alone and each ``vae_temporal`` frames after it into one latent frame (``F``
    frames: ``(F - 1) / vae_temporal + 1`` latent frames) and ``vae_spatial`` pixels each way into one latent;
    the transformer turns each ``patch`` (frames, height, width) of latents into one token. An image model sets
    ``video=False``: one frame, with its packing (Flux's 2x2) as the patch. Wan2.1's ``(4, 8, (1, 2, 2))`` turns
    81 frames of 720x1280 into 21 x 45 x 80 = 75,600 tokens.
    """

    vae_temporal: int
    vae_spatial: int
    patch: tuple[int, int, int]
    video: bool = True

    def __post_init__(self) -> None:
        _tupled(self, "patch", self.patch)
        sizes = (self.vae_temporal, self.vae_spatial, *self.patch)
        if len(self.patch) != 3 or not all(type(n) is int and n >= 1 for n in sizes):
            raise AdapterError(
                "VideoGeometry needs ints >= 1: vae_temporal, vae_spatial and a (frames, height, width) patch; "
                f"got {self.vae_temporal!r}, {self.vae_spatial!r}, {self.patch!r}"
            )

    def _frame_rule(self) -> tuple[int, int, str]:
        """(first, step, words) of the valid frame counts ``first + k * step``."""
        if not self.video:
            return 1, 1, "1 frame (an image model)"
        # Latent frames come in patches of patch[0]: the first patch holds the lone first frame.
        first = (self.patch[0] - 1) * self.vae_temporal + 1
        step = self.vae_temporal * self.patch[0]
        return first, step, f"{step}k + {first} frames"

    def latent_shape(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        """(frames, height, width) of the latents the VAE makes of the video; ValueError for a shape the VAE and
        the patches do not divide, naming it and the nearest valid shape."""
        sizes = (frames, height, width)
        if not all(type(n) is int and n >= 1 for n in sizes):
            raise ValueError(f"frames, height and width must be ints >= 1, got {frames!r} x {height!r} x {width!r}")
        first, step, frame_words = self._frame_rule()
        spatial = (self.vae_spatial * self.patch[1], self.vae_spatial * self.patch[2])
        valid_frames = (frames - first) % step == 0 and frames >= first and (self.video or frames == 1)
        if not valid_frames or height % spatial[0] or width % spatial[1]:
            nearest_frames = _nearest(frames, first, step) if self.video else 1
            nearest = (nearest_frames, *(_nearest(n, s, s) for n, s in zip(sizes[1:], spatial, strict=True)))
            raise ValueError(
                f"{frames} x {height} x {width} (frames x height x width) does not divide into tokens: the model "
                f"takes {frame_words}, height a multiple of {spatial[0]} and width of {spatial[1]} (the "
                f"VAE's {self.vae_spatial}x, then {self.patch[1]}x{self.patch[2]} patches); nearest valid: "
                f"{' x '.join(map(str, nearest))}"
            )
        latent_frames = (frames - 1) // self.vae_temporal + 1 if self.video else 1
        return latent_frames, height // self.vae_spatial, width // self.vae_spatial

    def token_grid(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        """(frames, height, width) in tokens: the latents over the patch."""
        latents = self.latent_shape(frames, height, width)
        return latents[0] // self.patch[0], latents[1] // self.patch[1], latents[2] // self.patch[2]

    def tokens(self, frames: int, height: int, width: int) -> int:
        """The video's tokens (one sample; text and other streams not counted)."""
        grid = self.token_grid(frames, height, width)
        return grid[0] * grid[1] * grid[2]


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
    ``ac-core inspect module:Class --draft`` prints it), or, where one class sits in several containers whose
    blocks at one index differ, from the block's path (``{"noise_refiner.0": 1, "layers.0": 2}``). A class with
    0 calls is a block without attention (ac-core never looks for attention in it). ``versions`` is a
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
    (``layers``, ``seq``) that builds a few blocks at the real model's width. A video or image preset also takes
    ``grid``, (frames, height, width) in tokens, built exactly and used instead of ``seq`` (which lays its tokens
    out as whole frames of the preset's own size); a two-stream one takes ``single_layers`` (default ``layers``).
    ``depths`` map a preset name to the keyword options that build the real model's whole depth
    (``{"layers": 40}`` for Wan2.1-14B, ``{"layers": 20, "single_layers": 40}`` for HunyuanVideo), and whatever
    else the preset cuts (Llama-3-8B's ``vocab``): what ``ac-core plan`` builds for a step budget where
    ``--layers`` is not given.
    ``geometry`` turns a video's frames and resolution into the ``seq`` tokens its presets take (the VAE and patch
    factors, a :class:`VideoGeometry`); None for a model that takes tokens (an LLM).
    """

    cls: str
    containers: tuple[str, ...]
    excluded: tuple[ExcludedContainer, ...] = ()
    attention_calls: Mapping[str, int | Mapping[int, int] | Mapping[str, int]] = field(default_factory=dict)
    versions: str | None = None
    tiny: Factory | None = None
    presets: Mapping[str, Factory] = field(default_factory=dict)
    compile_unsupported: str | None = None
    meta_unsupported: str | None = None
    geometry: VideoGeometry | None = None
    depths: Mapping[str, Mapping[str, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _tupled(self, "containers", self.containers)
        _tupled(self, "excluded", self.excluded)
        object.__setattr__(
            self,
            "attention_calls",
            MappingProxyType(
                {
                    block: calls if isinstance(calls, int) else MappingProxyType(dict(cast(Mapping[Any, int], calls)))
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
                ((type(i) is int and i >= 0) or (type(i) is str and i)) and type(n) is int and n >= 0
                for i, n in per_index
            ):
                got = dict(calls) if isinstance(calls, Mapping) else calls
                raise AdapterError(
                    f"ModelSpec for {self.cls}: attention_calls[{block!r}] must be an int >= 0, or a mapping "
                    f"of block index (int >= 0) or block path to an int >= 0; got {got!r}"
                )
        if self.tiny is not None:
            _check_factory(self.tiny, f"ModelSpec for {self.cls}: tiny")
        for name, factory in self.presets.items():
            _check_factory(factory, f"ModelSpec for {self.cls}: presets[{name!r}]")
        object.__setattr__(
            self, "depths", MappingProxyType({k: MappingProxyType(dict(v)) for k, v in self.depths.items()})
        )
        for name, options in self.depths.items():
            if name not in self.presets or not options:
                raise AdapterError(
                    f"ModelSpec for {self.cls}: depths[{name!r}] must name one of its presets "
                    f"{sorted(self.presets)} and give the keyword options of its real depth"
                )
            if not all(type(n) is int and n >= 1 for n in options.values()):
                raise AdapterError(f"ModelSpec for {self.cls}: depths[{name!r}] must be ints >= 1, got {dict(options)}")

    @property
    def class_name(self) -> str:
        return self.cls.rpartition(".")[2]

    def calls_of(self, block_class: str, index: int | None = None, path: str | None = None) -> int | None:
        """The attention calls ``attention_calls`` declares for one block of ``block_class``, the ``index``-th
        of its container at ``path``; None where it declares nothing for that class (or, for a per-block count,
        that path or index)."""
        calls = self.attention_calls.get(block_class)
        if calls is None or isinstance(calls, int):
            return calls
        per_block: Mapping[Any, int] = calls  # keyed by index or by path
        if path is not None and path in per_block:
            return per_block[path]
        return None if index is None else per_block.get(index)

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
class ContextParallel:
    """How an adapter's models split their sequence over ranks (context parallelism), for the conformance suite's
    check: ``modes`` the ways it can (``"ulysses"``, ``"ring"``); ``enable(model, mode)`` switches a built model to
    one of them inside the default process group (each rank then runs its chunk of the tokens); ``shard(inputs)``
    gives this rank's part of one forward's inputs (the rest as they are; a library that splits them in its own
    hooks, as diffusers does, passes them whole). ``unsupported(model)``: why a built model of a class the adapter
    serves cannot run context parallel, or None where it can (None: every class can)."""

    modes: tuple[str, ...]
    enable: Callable[[nn.Module, str], None]
    shard: Callable[[Mapping[str, Any]], Mapping[str, Any]]
    unsupported: Callable[[nn.Module], str | None] | None = None

    def reason(self, model: nn.Module) -> str | None:
        """Why ``model`` cannot run context parallel, or None where it can."""
        return None if self.unsupported is None else self.unsupported(model)

    def __post_init__(self) -> None:
        _tupled(self, "modes", self.modes)
        if not self.modes or not all(isinstance(m, str) and m for m in self.modes):
            raise AdapterError(
                f"ContextParallel.modes must name at least one mode, e.g. ('ulysses',); got {self.modes}"
            )
        if not callable(self.enable) or not callable(self.shard):
            raise AdapterError("ContextParallel needs callables enable(model, mode) and shard(inputs)")
        if self.unsupported is not None and not callable(self.unsupported):
            raise AdapterError("ContextParallel.unsupported must be a callable unsupported(model) or None")


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

    ``activation_collectives``: the functional collectives (``"_c10d_functional::..."``) whose outputs carry
    activations in the family's forward, which ``Ops()`` keeps where what they move is no parameter of the block
    (:data:`~ac_core.collectives.ACTIVATION_COLLECTIVES` by default: Ulysses' all-to-all; add a ring's
    ``_c10d_functional::all_gather_into_tensor`` of keys and values to keep it too). ``context_parallel``: how its
    models run context parallel (a :class:`ContextParallel`), which the conformance suite then checks on 2 ranks.
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
    activation_collectives: tuple[str, ...] = tuple(sorted(ACTIVATION_COLLECTIVES))
    context_parallel: ContextParallel | None = None

    def __post_init__(self) -> None:
        for attr in ("models", "backends", "requirements", "activation_collectives"):
            _tupled(self, attr, getattr(self, attr))
        try:
            check_activation_collectives(self.activation_collectives, f"adapter {self.name!r}: activation_collectives")
        except ValueError as exc:
            raise AdapterError(str(exc)) from None
        if self.context_parallel is not None and not isinstance(self.context_parallel, ContextParallel):
            raise AdapterError(f"adapter {self.name!r}: context_parallel must be a ContextParallel")
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
