"""The conformance suite as pytest classes: subclass one, point it at an adapter, and pytest runs the checks.

:class:`AdapterConformance` is every check's pytest class, in the order of the package's check registry; each
class (:class:`CoverageTests`, :class:`AttentionTests` ...) is defined next to its check functions in
``checks/<name>.py`` and is a name of this module too. How the tests are parametrized (subject, policy,
device, backends) is :class:`~ac_core_conformance.base.AdapterTests`'.
"""

from __future__ import annotations

import importlib

from ._registry import CHECKS, Check
from .base import DEVICES, AdapterTests


def _test_class(check: Check) -> type[AdapterTests]:
    found = getattr(importlib.import_module(f".{check.module}", __package__), check.tests, None)
    if not (isinstance(found, type) and issubclass(found, AdapterTests)):
        raise TypeError(
            f"check {check.name!r} is registered with pytest class {check.tests!r}, but {check.module} defines no "
            f"AdapterTests subclass of that name (got {found!r}): define it there, or fix its registration"
        )
    return found


_TEST_CLASSES = {check.tests: _test_class(check) for check in CHECKS}
globals().update(_TEST_CLASSES)  # ``from ac_core_conformance.suite import CoverageTests`` keeps working


class AdapterConformance(*_TEST_CLASSES.values()):
    """The whole conformance suite. Subclass it as ``Test...`` and set ``adapter``::

    class TestMyAdapter(AdapterConformance):
        adapter = "my-adapter"  # or the AdapterSpec, or "my_package.adapter:SPEC"
    """


__all__ = ["DEVICES", "AdapterConformance", "AdapterTests", *_TEST_CLASSES]  # pyright: ignore[reportUnsupportedDunderAll]  # derived from the registry
