"""What the subcommands share: choosing adapters and presets, building models, the environment, output."""

from __future__ import annotations

import importlib
import logging
import platform
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch
from rich.console import Console
from rich.logging import RichHandler

from ..registry import registered_adapters
from ..spec import AdapterSpec, ModelCase, ModelSpec

TINY = "tiny"
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


def split_names(value: str) -> list[str]:
    """``"a,b , c"`` -> ``["a", "b", "c"]``."""
    return [name.strip() for name in value.split(",") if name.strip()]


def _load_ref(ref: str) -> AdapterSpec:
    module, _, attr = ref.partition(":")
    try:
        spec = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise CLIError(f"cannot load adapter {ref!r}: {exc}") from None
    if not isinstance(spec, AdapterSpec):
        raise CLIError(f"{ref} is a {type(spec).__name__}, not an AdapterSpec")
    return spec


def known_adapters() -> dict[str, AdapterSpec]:
    """Registered adapters, plus the built-in toy (``ac_core.testing:TOY_ADAPTER``) unless one is named ``toy``."""
    adapters = registered_adapters()
    if TOY not in adapters:
        adapters[TOY] = _load_ref(TOY_REF)
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
            spec = _load_ref(name)
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


def presets_of(adapters: Iterable[AdapterSpec]) -> list[str]:
    """``tiny`` and every named preset the adapters' model classes offer."""
    names = {preset for adapter in adapters for model in adapter.models for preset in model.presets}
    return [TINY, *sorted(names)]


def models_for(adapter: AdapterSpec, preset: str) -> list[ModelSpec]:
    """The model classes of ``adapter`` that can be built at ``preset``."""
    if preset == TINY:
        return [m for m in adapter.models if m.tiny is not None]
    return [m for m in adapter.models if preset in m.presets]


def build_case(model: ModelSpec, preset: str, *, layers: int | None = None, seq: int | None = None) -> ModelCase:
    """A seeded ModelCase of ``model`` at ``preset`` (tiny: its fixed config; else ``layers`` blocks at ``seq``)."""
    torch.manual_seed(0)
    if preset == TINY:
        assert model.tiny is not None
        return model.tiny()
    options: dict[str, Any] = {"seq": seq}
    if layers is not None:
        options["layers"] = layers
    return model.presets[preset](**options)


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


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_flops(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f}"
