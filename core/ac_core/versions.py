"""The installed library against the versions an adapter declares (one answer for inspect, bench, the suite)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from .errors import UnsupportedVersionError
from .spec import AdapterSpec, ModelSpec


def version_supported(requirement: str | None) -> tuple[bool, str | None]:
    """(supported, installed version) for a requirement string such as ``"diffusers>=0.42"``."""
    if requirement is None:
        return True, None
    from packaging.requirements import Requirement

    req = Requirement(requirement)
    try:
        installed = version(req.name)
    except PackageNotFoundError:
        return False, None
    return req.specifier.contains(installed, prereleases=True), installed


def check_version(adapter: AdapterSpec, model_spec: ModelSpec) -> None:
    """Raise UnsupportedVersionError when the installed library is outside ``model_spec.versions``."""
    supported, installed = version_supported(model_spec.versions)
    if not supported:
        raise UnsupportedVersionError(
            f"adapter {adapter.name!r} declares the layout of {model_spec.class_name} for {model_spec.versions}, "
            f"but {installed or 'no version'} is installed, whose blocks it may miss. "
            f"Install a supported version ({adapter.install_hint}), or name the containers yourself with "
            "blocks=[...]."
        )
