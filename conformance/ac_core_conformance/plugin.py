"""pytest plugin of the conformance suite: ``--ac-core-adapter`` and the ``cuda`` marker.

Loaded automatically where ac-core is installed (``pytest11`` entry point), or with
``-p ac_core_conformance.plugin``. Run the suite on installed adapters with::

    pytest --pyargs ac_core_conformance --ac-core-adapter wan --ac-core-adapter my_pkg.adapters:SPEC

It imports nothing heavy unless an adapter is named.
"""

from __future__ import annotations

from typing import Any

import pytest

ADAPTER_FLAG = "--ac-core-adapter"
COMPILE_BACKEND_FLAG = "--ac-core-compile-backend"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ac-core", "ac-core adapter conformance")
    group.addoption(
        ADAPTER_FLAG,
        action="append",
        default=[],
        metavar="NAME|module:attr",
        help="adapter the conformance suite checks: a name registered through the ac_core.adapters entry point, "
        "or 'module:attr' of an AdapterSpec (repeatable)",
    )
    group.addoption(
        COMPILE_BACKEND_FLAG,
        default=None,
        metavar="BACKEND",
        help="torch.compile backend of the compile check (default: $AC_CORE_COMPILE_BACKEND, else aot_eager; "
        "inductor costs about a minute per model on 2 CPU cores)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA device (skipped where none is present)")
    refs = config.getoption("ac_core_adapter") or []
    if not refs:
        return
    from ac_core import registered_adapters

    from .subjects import load_adapter

    for ref in refs:
        try:
            adapter = load_adapter(ref)
        except Exception as exc:
            known = sorted(registered_adapters()) or "none"
            raise pytest.UsageError(
                f"{ADAPTER_FLAG} {ref}: {exc}\n"
                f"Registered adapters here: {known}. An adapter registers through the 'ac_core.adapters' entry "
                "point of an installed package (ours: pip install 'ac-core[wan]', '[hunyuan]', '[flux]', "
                "'[llama]'); one defined only in code is named as 'module:attr'."
            ) from None
        _check_versions(ref, adapter)


def _check_versions(ref: str, adapter: Any) -> None:
    """Fail once, before any test, where the installed library is outside a model's declared versions: every
    check of that model would fail alike."""
    from ac_core.versions import version_supported

    unsupported = []
    for model in adapter.models:
        supported, installed = version_supported(model.versions)
        if not supported:
            unsupported.append(f"{model.class_name} declares {model.versions}, installed: {installed or 'nothing'}")
    if unsupported:
        raise pytest.UsageError(
            f"{ADAPTER_FLAG} {ref}: adapter {adapter.name!r} does not declare the installed library version: "
            + "; ".join(sorted(set(unsupported)))
            + ". Install a version in that range, or widen the adapter's ModelSpec.versions once its layout is "
            "checked on the installed one."
        )
