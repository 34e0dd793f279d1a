"""The check registry is the one list of checks: exports, the docstring's numbered list and the suite follow it."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import pytest

import ac_core_conformance
from ac_core_conformance import suite
from ac_core_conformance._registry import CHECKS, Check, numbered

EXPORTED_BEFORE_THE_REGISTRY = {
    "AdapterConformance",
    "AdapterTests",
    "AttentionContext",
    "AttentionTests",
    "CompileTests",
    "CoverageTests",
    "DEVICES",
    "EAGER_TOLERANCE",
    "FSDPTests",
    "GradientTests",
    "INDUCTOR_TOLERANCE",
    "LibraryCheckpointingTests",
    "MemoryTests",
    "NameTests",
    "Subject",
    "Tolerance",
    "check_attention_recomputed",
    "check_attention_retained",
    "check_budget",
    "check_compile",
    "check_coverage",
    "check_fsdp",
    "check_gradients",
    "check_gradients_with_dropout",
    "check_gradients_with_random_ops",
    "check_library_checkpointing",
    "check_library_checkpointing_after",
    "check_memory",
    "check_meta_planning",
    "check_names",
    "check_not_retainable_backend",
    "check_pickle_round_trip",
    "check_save_pretrained",
    "default_policies",
    "load_adapter",
    "portable_ref",
    "subjects_of",
}


def _module(check: Check):
    return importlib.import_module(f"ac_core_conformance.{check.module}")


def test_the_names_exported_before_still_resolve():
    assert set(ac_core_conformance.__all__) >= EXPORTED_BEFORE_THE_REGISTRY
    for name in ac_core_conformance.__all__:
        assert getattr(ac_core_conformance, name) is not None, name
    for check in CHECKS:
        assert getattr(suite, check.tests) is getattr(ac_core_conformance, check.tests)


def test_every_registered_export_comes_from_its_check_module():
    for check in CHECKS:
        module = _module(check)
        for name in (check.tests, *check.exports):
            assert name in module.__all__, f"{check.module} does not export {name}"
            assert getattr(ac_core_conformance, name) is getattr(module, name)


def test_the_suite_is_every_registered_class_in_order():
    classes = [getattr(_module(check), check.tests) for check in CHECKS]
    assert list(suite.AdapterConformance.__bases__) == classes
    assert len(CHECKS) == 11


def test_the_docstring_lists_the_registry():
    doc = ac_core_conformance.__doc__ or ""
    listed = [line.split(" (")[0] for line in doc.splitlines() if line[:1].isdigit()]
    assert listed == [f"{number}. {check.name}" for number, check in numbered()]


def test_module_and_class_docstrings_carry_the_registry_number():
    for number, check in numbered():
        module, cls = _module(check), getattr(_module(check), check.tests)
        assert (module.__doc__ or "").startswith(f"Check {number}: "), check.module
        assert (inspect.getdoc(cls) or "").startswith(f"Check {number}: "), check.tests


def test_check_modules_export_no_name_twice():
    names = [name for check in CHECKS for name in _module(check).__all__]
    assert len(names) == len(set(names)), sorted(n for n in set(names) if names.count(n) > 1)


def test_a_registration_without_its_class_fails_naming_it():
    with pytest.raises(TypeError, match=r"check 'coverage' is registered with pytest class 'CoverTests'.*define it"):
        suite._test_class(Check("coverage", "a summary", (), "CoverTests"))


def test_importing_the_package_and_its_list_imports_no_torch():
    code = (
        "import sys, ac_core_conformance as m; m.__doc__; m.__all__; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
