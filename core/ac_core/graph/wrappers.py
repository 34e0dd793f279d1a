"""The graph pass's old public wrappers, served by ``ac_core.__getattr__`` with a DeprecationWarning."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._deprecated import UNSET, renamed
from .partition import sac_partition
from .route import GraphRoute
from .save_ops import DEFAULT_SAC_SAVE_OPS


def _route(
    retain: frozenset[object] | None, blocks: frozenset[str] | None, outside: frozenset[str] | None
) -> GraphRoute:
    return GraphRoute(DEFAULT_SAC_SAVE_OPS if retain is None else frozenset(retain), blocks, outside)


def sac_aot_eager(
    retain: frozenset[object] | None = None,
    blocks: frozenset[str] | None = None,
    outside_modules: frozenset[str] | None = None,
    *,
    save_ops: Any = UNSET,
) -> Callable[..., Any]:
    retain = renamed("sac_aot_eager", "save_ops", "retain", save_ops, retain, None)
    return _route(retain, blocks, outside_modules).aot_eager()


def sac_inductor_options(
    retain: frozenset[object] | None = None,
    options: dict | None = None,
    blocks: frozenset[str] | None = None,
    outside_modules: frozenset[str] | None = None,
    *,
    save_ops: Any = UNSET,
) -> dict[str, Any]:
    retain = renamed("sac_inductor_options", "save_ops", "retain", save_ops, retain, None)
    return _route(retain, blocks, outside_modules).inductor_options(options)


__all__ = ["sac_aot_eager", "sac_inductor_options", "sac_partition"]
