"""The suite can fail: each deliberately false declaration makes the check that owns it fail, by name."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from ac_core import (
    AdapterError,
    AttentionBackend,
    BlockSkip,
    ExcludedContainer,
    ModelCase,
    apply_activation_checkpointing,
    checkpointed_blocks,
    registered_policies,
)
from ac_core.testing import TOY_ADAPTER
from ac_core_conformance import (
    AdapterConformance,
    attention_recomputes,
    check_attention_recomputed,
    check_attention_retained,
    check_coverage,
    check_gradients,
    check_gradients_with_random_ops,
    check_library_checkpointing,
    check_library_checkpointing_after,
    check_memory,
    check_names,
    check_not_retainable_backend,
    check_pickle_round_trip,
    default_policies,
    portable_ref,
)
from ac_core_conformance.training import build

from .broken import (
    MATH_CLAIMED_RETAINABLE,
    REFINER_EXCLUDED,
    SDPA_CLAIMED_NOT_RETAINABLE,
    WRONG_CALLS,
    ToyWithAttentionList,
    ToyWithLibraryCheckpointing,
    ToyWithMlpList,
    ToyWithRefiner,
    spec,
    subject,
    toy_adapter,
)


@pytest.mark.parametrize("policy", ["full", "block_skip"])
def test_undeclared_container_of_blocks_fails_naming_it(policy):
    with pytest.raises(AssertionError, match=r"'refiner' holds blocks \(ToyBlock at refiner.0\)"):
        check_coverage(subject(spec(ToyWithRefiner)), policy)


def test_declared_excluded_container_passes_and_stays_unchecked():
    report = check_coverage(subject(REFINER_EXCLUDED), "full")
    assert sorted(report.checkpointed) == ["layers.0", "layers.1", "layers.2"]
    report = check_coverage(subject(REFINER_EXCLUDED), BlockSkip(every=2))
    assert sorted(report.checkpointed) == ["layers.0", "layers.2"]


def test_the_checks_run_under_every_registered_policy():
    assert [type(p) for p in default_policies()] == list(registered_policies().values())
    assert BlockSkip(every=2) in default_policies()  # every second block: one left unchecked in three

    class Suite(AdapterConformance):
        adapter = TOY_ADAPTER

    toy = subject(TOY_ADAPTER)
    assert [p.id for p in Suite()._dimension("policy", toy)] == list(registered_policies())
    # The recompute check runs under every policy: under ops no block reruns attention, under full each does.
    blocks = [f"layers.{i}" for i in range(4)]  # the toy's four blocks, one attention call each
    assert attention_recomputes(toy, "ops") == dict.fromkeys(blocks, 0)
    assert check_attention_recomputed(toy, "ops") == 0
    assert attention_recomputes(toy, "full") == dict.fromkeys(blocks, 1)
    assert check_attention_recomputed(toy, BlockSkip(every=2)) == 2  # layers.0 and layers.2


def test_container_running_attention_is_found_without_any_class_hint():
    with pytest.raises(AssertionError, match="'refiner' runs attention in its elements"):
        check_coverage(subject(spec(ToyWithAttentionList)), "ops")


def test_container_of_the_models_own_no_split_modules_is_found():
    with pytest.raises(AssertionError, match=r"'refiner' holds blocks \(Mlp at refiner.0\)"):
        check_coverage(subject(spec(ToyWithMlpList)), "full")


def test_renamed_container_fails_naming_it():
    with pytest.raises(AssertionError, match=r"renamed upstream.*'blocks'"):
        check_coverage(subject(toy_adapter(containers=("blocks",))), "full")


def test_renamed_excluded_container_fails_naming_it():
    adapter = spec(ToyWithRefiner, excluded=(ExcludedContainer("token_refiner", "few tokens"),))
    with pytest.raises(AssertionError, match="excluded container 'token_refiner' does not exist"):
        check_coverage(subject(adapter), "full")


def test_wrong_attention_calls_fail():
    with pytest.raises(AssertionError, match=r"layers.0 \(ToyBlock\) ran 'sdpa'.s kernel 1 times.*declares 2"):
        check_attention_retained(subject(WRONG_CALLS), "sdpa")
    with pytest.raises(AssertionError, match="declares 2"):
        check_attention_recomputed(subject(WRONG_CALLS), "full")


def test_undeclared_block_class_in_attention_calls_fails():
    with pytest.raises(AssertionError, match="attention_calls declares nothing for block class ToyBlock"):
        check_attention_retained(subject(toy_adapter(attention_calls={})), "sdpa")


def test_false_retainable_claim_fails():
    # The declared kernel never runs on the math backend: the message blames the ops, not attention_calls.
    with pytest.raises(
        AssertionError,
        match=r"none of its declared ops .* ran in one forward\. Attention-like ops that did run: \[.*softmax",
    ):
        check_attention_retained(subject(MATH_CLAIMED_RETAINABLE), "math")


def test_misspelled_op_name_is_named_as_the_cause():
    typo = toy_adapter(
        "typo", backends=(AttentionBackend("sdpa", ops=("aten::_scaled_dot_product_flash_attention_for_cpux",)),)
    )
    with pytest.raises(
        AssertionError,
        match=r"Attention-like ops that did run: \['aten::_scaled_dot_product_flash_attention_for_cpu'\]",
    ) as info:
        check_attention_retained(subject(typo), "sdpa")
    assert "attention_calls declares" not in str(info.value)


def test_false_retainable_claim_shows_in_memory_too():
    # 'ops' retains nothing on this backend, so it holds what 'full' holds.
    with pytest.raises(AssertionError, match="expected full < ops < none"):
        check_memory(subject(MATH_CLAIMED_RETAINABLE))


def test_offload_that_moves_a_retained_output_fails():
    """A context reporting every new storage as offloaded stands in for offload that moves attention outputs."""
    from contextlib import contextmanager
    from types import SimpleNamespace

    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode

    class MovesEverything(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.offloaded: list[SimpleNamespace] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.offloaded.append(SimpleNamespace(source=StorageWeakRef(t.untyped_storage())))
            return out

    @contextmanager
    def everything_moves(model, device):
        with MovesEverything() as mode:
            yield mode

    with pytest.raises(AssertionError, match=r"retained outputs left the compute device.*offloaded"):
        check_attention_retained(subject(TOY_ADAPTER), "sdpa", context=everything_moves)


def test_false_not_retainable_claim_fails():
    with pytest.raises(
        AssertionError,
        match=r"no 'retained nothing' warning .* ran \['aten::_scaled_dot_product_flash_attention_for_cpu'\]\. "
        r"The backend was probably not switched",
    ):
        check_not_retainable_backend(subject(SDPA_CLAIMED_NOT_RETAINABLE), "sdpa")


def test_prepare_that_changes_the_numbers_fails_gradients():
    def scale_head(model):
        with torch.no_grad():
            model.head.weight.mul_(2)

    with pytest.raises(AssertionError, match=r"gradients differ|loss"):
        check_gradients(subject(replace(TOY_ADAPTER, name="bad-prepare", prepare=scale_head)), "ops")


def test_prepare_that_adds_state_fails_names():
    def add_buffer(model):
        model.register_buffer("step_count", torch.zeros(()))

    with pytest.raises(AssertionError, match=r"state_dict\(\) changed: \['step_count'\]"):
        check_names(subject(replace(TOY_ADAPTER, name="bad-names", prepare=add_buffer)), "full")


def test_library_checkpointing_is_taken_over():
    message = check_library_checkpointing(subject(spec(ToyWithLibraryCheckpointing)), "ops")
    assert "ToyWithLibraryCheckpointing" in message and "disable_gradient_checkpointing()" in message


def test_build_rejects_a_factory_of_another_class():
    adapter = toy_adapter(tiny=lambda: ModelCase(nn.Linear(4, 4), {"input": torch.randn(2, 4)}, torch.sum))
    with pytest.raises(AssertionError, match="builds a Linear, which the ModelSpec"):
        build(subject(adapter))


def test_portable_refs_for_spawned_ranks():
    assert portable_ref(TOY_ADAPTER) == "ac_core.testing:TOY_ADAPTER"
    assert portable_ref(WRONG_CALLS) == "tests.conformance.broken:WRONG_CALLS"
    assert portable_ref("pkg.mod:SPEC") == "pkg.mod:SPEC"
    assert portable_ref("cogvideox") == "cogvideox"  # an installed entry point
    with pytest.raises(AdapterError, match="registered only in this process"):
        portable_ref(toy_adapter("made-in-a-function"))


def test_checkpointed_blocks_of_excluded_container_stay_plain():
    case = build(subject(REFINER_EXCLUDED))
    apply_activation_checkpointing(case.model, "full", adapter=REFINER_EXCLUDED)
    assert not any(name.startswith("refiner") for name in checkpointed_blocks(case.model))


def _pytest(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_named_to_pytest_the_suite_fails_the_false_check_only(tmp_path):
    result = _pytest(
        "--pyargs",
        "ac_core_conformance",
        "--ac-core-adapter",
        "tests.conformance.broken:WRONG_CALLS",
        "-k",
        "attention_retained or coverage",
        cwd=tmp_path,
    )
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    # Check 3 runs plain and with offload on: the false declaration fails both, and nothing else.
    for context in ("plain", "offload"):
        assert f"::test_attention_retained[wrong-calls-ToyTransformer-cpu-sdpa-{context}]" in out
    assert "3 passed" in out and "2 failed" in out, out


def test_unknown_adapter_is_a_usage_error_listing_the_registered_ones(tmp_path):
    result = _pytest("--pyargs", "ac_core_conformance", "--ac-core-adapter", "no-such-adapter", cwd=tmp_path)
    assert result.returncode == pytest.ExitCode.USAGE_ERROR
    assert "--ac-core-adapter no-such-adapter: no adapter named 'no-such-adapter'" in result.stderr
    assert "Registered adapters here: ['cogvideox'" in result.stderr


def test_an_unsupported_library_version_fails_once_up_front_naming_the_range(tmp_path):
    ref = "tests.conformance.broken:OLD_LIBRARY"
    result = _pytest("--pyargs", "ac_core_conformance", "--ac-core-adapter", ref, cwd=tmp_path)
    assert result.returncode == pytest.ExitCode.USAGE_ERROR
    message = f"--ac-core-adapter {ref}: adapter 'old-library' does not declare the installed library version"
    assert result.stderr.count(message) == 1, result.stderr
    assert "ToyTransformer declares torch<2.0, installed: " in result.stderr
    assert "ac-core's" not in result.stderr and " passed" not in result.stdout


def test_without_an_adapter_the_packaged_suite_skips_saying_why(tmp_path):
    result = _pytest("--pyargs", "ac_core_conformance", "-k", "coverage", cwd=tmp_path)
    assert result.returncode == 0, result.stdout
    assert "no adapter to check" in result.stdout


def test_random_ops_check_fails_where_recompute_does_not_replay_the_rng(monkeypatch):
    from ac_core import _checkpoint

    toy = subject(TOY_ADAPTER)
    check_gradients_with_random_ops(toy, "full")  # passes as shipped
    # As ac-core once did: keep the RNG state only where the block's first forward drew a random number.
    original = _checkpoint.CheckpointLayer.forward
    drew: dict[int, bool] = {}

    def infer_from_the_first_call(self, module, call_next, args, kwargs):
        self.preserve_rng_state = drew.get(id(self), True)
        before = torch.get_rng_state()
        out = original(self, module, call_next, args, kwargs)
        drew.setdefault(id(self), not torch.equal(before, torch.get_rng_state()))
        return out

    monkeypatch.setattr(_checkpoint.CheckpointLayer, "forward", infer_from_the_first_call)
    with pytest.raises(AssertionError, match=r"warm-up from 0: rate 0.25 at the second step\).*gradients differ"):
        check_gradients_with_random_ops(toy, "full")


def test_pickle_check_fails_where_the_copy_loses_the_checkpointing(monkeypatch):
    from ac_core import _chain

    toy = subject(TOY_ADAPTER)
    check_pickle_round_trip(toy, "ops", "torch.save")  # passes as shipped
    # As before the chain's forward pickled: loading looks the method up by name on the block and fails.
    monkeypatch.setattr(_chain._ChainedForward, "__reduce__", lambda self: (getattr, (self.__self__, "_gone")))
    with pytest.raises(AssertionError, match=r"after a torch\.save round trip: failed only because of ac-core"):
        check_pickle_round_trip(toy, "ops", "torch.save")


def test_library_checkpointing_switched_on_after_apply_fails_where_it_is_not_found(monkeypatch):
    from ac_core.libraries import checkpointing as library_checkpointing

    toy = subject(spec(ToyWithLibraryCheckpointing))
    message = check_library_checkpointing_after(toy, "ops")  # found and turned off as shipped
    assert "ToyWithLibraryCheckpointing" in message
    monkeypatch.setattr(library_checkpointing, "switched_on", lambda *args, **kwargs: None)
    with pytest.raises(AssertionError, match=r"expected one warning naming ToyWithLibraryCheckpointing"):
        check_library_checkpointing_after(toy, "ops")
