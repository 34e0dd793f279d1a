"""What the subcommands share: choosing adapters and presets, building models, the environment, output."""

from __future__ import annotations

import argparse
import importlib
import logging
import platform
import sys
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.logging import RichHandler

from ..errors import AdapterError
from ..registry import get_adapter, registered_adapters
from ..spec import AdapterSpec, ModelCase, ModelSpec
from ..versions import version_supported

TINY = "tiny"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOY = "toy"
TOY_REF = "ac_core.testing:TOY_ADAPTER"


class CLIError(Exception):
    """Bad input on the command line: printed as ``error: ...`` with exit status 2."""


def stdout() -> Console:
    # Created per call so that output goes to whatever sys.stdout is now (pytest's capture included).
    # Not a terminal (a file, a CI log): wide enough that the bench table is never squeezed.
    return Console(file=sys.stdout, width=None if sys.stdout.isatty() else 200, highlight=False, soft_wrap=True)


def stderr() -> Console:
    return Console(file=sys.stderr)


@contextmanager
def ac_core_logs_to(console: Console) -> Iterator[None]:
    """Route ac-core's log messages through ``console`` so that they do not tear a progress bar."""
    logger = logging.getLogger("ac_core")
    handler = RichHandler(console=console, show_time=False, show_path=False, markup=False)
    handler.setLevel(logging.WARNING)
    previous = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = previous


NOTICE_LIBRARIES = ("diffusers", "transformers")


@contextmanager
def library_notices_silenced(libraries: Iterable[str]) -> Iterator[None]:
    """Within the block, the log notices of those of ``libraries`` in :data:`NOTICE_LIBRARIES` and Python
    warnings are not printed; levels and filters come back on exit.

    They tell how the libraries expect a model to be loaded or served (e.g. transformers' use_cache notice
    under its own checkpointing), not something about the measurement.
    """
    loggers = []
    for name in NOTICE_LIBRARIES:
        if name not in libraries:
            continue
        try:
            # Its first import sets the library logger's level: done now, it cannot undo ours mid-run.
            importlib.import_module(f"{name}.utils.logging")
        except ImportError:
            continue
        loggers.append(logging.getLogger(name))
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels, strict=True):
                logger.setLevel(level)


def positive(value: str) -> int:
    """An argparse type: an int >= 1."""
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def non_negative(value: str) -> int:
    """An argparse type: an int >= 0."""
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {number}")
    return number


def split_names(value: str) -> list[str]:
    """``"a,b , c"`` -> ``["a", "b", "c"]``."""
    return [name.strip() for name in value.split(",") if name.strip()]


def _get_adapter(ref: str) -> AdapterSpec:
    try:
        return get_adapter(ref)
    except AdapterError as exc:
        raise CLIError(str(exc)) from None


def known_adapters() -> dict[str, AdapterSpec]:
    """Registered adapters, plus the built-in toy (``ac_core.testing:TOY_ADAPTER``) unless one is named ``toy``."""
    adapters = registered_adapters()
    if TOY not in adapters:
        adapters[TOY] = _get_adapter(TOY_REF)
    return adapters


def select_adapters(value: str) -> list[AdapterSpec]:
    """Adapters named by ``--adapter``: names, ``module:attribute`` references, or ``all`` (the registered ones)."""
    known = known_adapters()
    registered = registered_adapters()
    chosen: dict[str, AdapterSpec] = {}
    for name in split_names(value):
        if name == "all":
            if not registered:
                raise CLIError(
                    "--adapter all: no adapter is registered. Install ours with pip install 'ac-core[all]', "
                    f"or run the built-in toy model with --adapter {TOY}"
                )
            chosen.update(registered)
        elif ":" in name:
            spec = _get_adapter(name)
            chosen[spec.name] = spec
        elif name in known:
            chosen[name] = known[name]
        else:
            raise CLIError(
                f"unknown adapter {name!r}; valid values: all, {', '.join(sorted(known))} "
                "(or module:attribute of an AdapterSpec)"
            )
    if not chosen:
        raise CLIError(f"--adapter names no adapter; valid values: all, {', '.join(sorted(known))}")
    return list(chosen.values())


def missing_library(adapter: AdapterSpec) -> str | None:
    """Why ``adapter`` cannot run here (its library is not installed, with the install command), or None."""
    if adapter.library is None:
        return None
    try:
        version(adapter.library)
    except PackageNotFoundError:
        return f"{adapter.library} is not installed: {adapter.install_hint}"
    return None


def version_status(model: ModelSpec) -> tuple[bool, str | None]:
    """(supported, installed version) of the library whose layout ``model`` declares (``versions``)."""
    return version_supported(model.versions)


def presets_of(adapters: Iterable[AdapterSpec]) -> list[str]:
    """``tiny`` and every named preset the adapters' model classes offer."""
    names = {preset for adapter in adapters for model in adapter.models for preset in model.presets}
    return [TINY, *sorted(names)]


def add_size_arguments(parser: argparse.ArgumentParser, example: str) -> None:
    """``--preset``, ``--layers`` and ``--seq``: the size of the model a command builds."""
    parser.add_argument("--preset", default=TINY, help=f"'tiny' (default) or a real-width preset, e.g. {example}")
    parser.add_argument("--layers", type=positive, default=None, help="blocks per container of a preset (4)")
    parser.add_argument("--seq", type=positive, default=None, help="main-stream tokens of a preset (its default)")


def check_size_arguments(args: argparse.Namespace, adapters: Iterable[AdapterSpec]) -> None:
    """Refuse ``--layers``/``--seq`` with the tiny preset, naming the presets ``adapters`` offer."""
    if args.preset == TINY and (args.layers is not None or args.seq is not None):
        raise CLIError(
            "--layers and --seq size a real-width preset; the tiny preset has a fixed config. Choose a preset: "
            f"{', '.join(presets_of(adapters)[1:]) or 'none is offered by these adapters'}"
        )


def models_for(adapter: AdapterSpec, preset: str) -> list[ModelSpec]:
    """The model classes of ``adapter`` that can be built at ``preset``."""
    if preset == TINY:
        return [m for m in adapter.models if m.tiny is not None]
    return [m for m in adapter.models if preset in m.presets]


def build_case(
    model: ModelSpec, preset: str, *, layers: int | None = None, seq: int | None = None, **extra: Any
) -> ModelCase:
    """A seeded ModelCase of ``model`` at ``preset`` (tiny: its fixed config; else ``layers`` blocks at ``seq``,
    with the preset's ``extra`` keyword options: ``grid``, ``single_layers``)."""
    torch.manual_seed(0)
    if preset == TINY:
        return model.build_tiny()
    options: dict[str, Any] = {"seq": seq, **extra}
    if layers is not None:
        options["layers"] = layers
    return model.preset(preset)(**options)


def library_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:  # Linux names the CPU model here; platform.processor() is often empty
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: torch.device, dtype: torch.dtype, **settings: Any) -> dict[str, Any]:
    """Versions, device and dtype, plus the ``settings`` every row of a run shares (preset, seq, layers, ...)."""
    from .. import __version__

    return {
        "ac_core": __version__,
        "torch": torch.__version__,
        "diffusers": library_version("diffusers"),
        "transformers": library_version("transformers"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "device_name": device_name(device),
        "cpu_threads": torch.get_num_threads(),
        "dtype": str(dtype).removeprefix("torch."),
        **settings,
    }


def human_flops(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f}"


def check_outputs(plot: Path | None, json_path: Path | None) -> None:
    """Refuse a ``--plot`` that is no PNG or has no matplotlib, and outputs into folders that do not exist, before
    anything is measured."""
    if plot is not None:
        if plot.suffix.lower() != ".png":
            raise CLIError(f"--plot writes a PNG; give a file name ending in .png, not {plot.name!r}")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise CLIError("--plot needs matplotlib: pip install 'ac-core[plot]'") from None
    for path in (json_path, plot):
        if path is not None and not path.parent.exists():
            raise CLIError(f"cannot write {path}: folder {path.parent} does not exist")
