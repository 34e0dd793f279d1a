"""Other libraries' forwards on ac-core's blocks: diffusers' hooks (group offloading, FirstBlockCache, layerwise
casting) and accelerate's (AlignDevicesHook, dispatch_model, cpu_offload), each applied before and after ac-core
and removed in either order, on a tiny Flux (its adapter) and a tiny QwenImage (the diffusers library route) on CPU.
Both keep working: gradients equal the plain model's with the same hook, the hook's own effect is counted (onloads
in the recompute, blocks the cache skips, storage dtype), what ac-core reports is true, and no ac-core forward is
left behind."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn

from ac_core import (
    ModelCase,
    apply_activation_checkpointing,
    checkpointed_blocks,
    get_adapter,
    is_activation_checkpointed,
    remove_activation_checkpointing,
)
from ac_core._chain import _ChainedForward

from . import route_models

pytest.importorskip("diffusers")
pytest.importorskip("accelerate")
flux = pytest.importorskip("ac_core_adapters.models.flux")

from accelerate import cpu_offload, dispatch_model  # noqa: E402
from accelerate.hooks import AlignDevicesHook, add_hook_to_module, remove_hook_from_module  # noqa: E402
from diffusers.hooks import group_offloading  # noqa: E402
from diffusers.hooks.first_block_cache import FirstBlockCacheConfig  # noqa: E402
from diffusers.hooks.hooks import HookRegistry  # noqa: E402

CPU = torch.device("cpu")
ORDERS = ["ac_core_first", "hook_first"]
REMOVALS = [("ac_core", "hook"), ("hook", "ac_core")]


@dataclasses.dataclass
class Counts:
    """Calls counted in one phase: group onloads/offloads, AlignDevicesHook pre-forwards, block runs."""

    onload: int = 0
    offload: int = 0
    align: int = 0
    blocks: int = 0

    def __sub__(self, other: Counts) -> Counts:
        return Counts(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True)))


@dataclasses.dataclass(frozen=True)
class Tiny:
    """A tiny diffusers model the tests run on, and what they count on it."""

    make: Callable[[], ModelCase]
    adapter: str  # the name of the adapter serving it
    blocks: list[str]  # the blocks ac-core checkpoints
    block_class: str  # the class of its first block


TINIES = {
    "flux": Tiny(
        flux.tiny_flux,
        "flux",
        [f"transformer_blocks.{i}" for i in range(3)] + [f"single_transformer_blocks.{i}" for i in range(3)],
        "FluxTransformerBlock",
    ),
    "qwen_image-route": Tiny(
        route_models.tiny_qwen_image,
        "diffusers-route",
        route_models.QWEN_IMAGE_BLOCKS,
        "QwenImageTransformerBlock",
    ),
}


@pytest.fixture(params=list(TINIES))
def tiny(request) -> Tiny:
    return TINIES[request.param]


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> Counts:
    counted = Counts()

    def counting(name: str, original: Callable) -> Callable:
        @functools.wraps(original)
        def wrapper(self, *args, **kwargs):
            setattr(counted, name, getattr(counted, name) + 1)
            return original(self, *args, **kwargs)

        return wrapper

    group = group_offloading.ModuleGroup
    monkeypatch.setattr(group, "onload_", counting("onload", group.onload_))
    monkeypatch.setattr(group, "offload_", counting("offload", group.offload_))
    monkeypatch.setattr(AlignDevicesHook, "pre_forward", counting("align", AlignDevicesHook.pre_forward))
    return counted


def _built(tiny: Tiny, counts: Counts) -> Any:
    """The tiny model with its block runs counted: a pre-hook on each block's first child runs once per block run,
    whatever the block's own forward is (a cache skips it; a recompute runs it again)."""
    case = tiny.make()
    assert get_adapter(case.model).name == tiny.adapter

    def count(*_):
        counts.blocks += 1

    for name in tiny.blocks:
        next(case.model.get_submodule(name).children()).register_forward_pre_hook(count)
    return case


def _train_step(case, counts: Counts, context: bool = False):
    """(loss, grads, counts in forward, counts in backward); ``context``: inside a cache context."""
    model = case.model
    model.zero_grad(set_to_none=True)
    start = dataclasses.replace(counts)
    if context:
        model._reset_stateful_cache()
        with model.cache_context("cond"):
            loss = case.run()
            middle = dataclasses.replace(counts)
            loss.backward()
    else:
        loss = case.run()
        middle = dataclasses.replace(counts)
        loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, middle - start, counts - middle


def _assert_same(got, expected) -> None:
    (loss, grads), (expected_loss, expected_grads) = got[:2], expected[:2]
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=0)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=0, atol=0, msg=f"gradient of {name}")


def _ac_core_forwards(model: nn.Module) -> list[str]:
    """Where an ac-core forward is still kept: instance forwards, accelerate's _old_forward, diffusers' references."""
    found = []
    for name, module in model.named_modules():
        kept = [module.__dict__.get("forward"), module.__dict__.get("_old_forward")]
        registry = module.__dict__.get("_diffusers_hook")
        for reference in getattr(registry, "_fn_refs", []):
            kept += [reference.forward, reference.original_forward]
        found += [name for each in kept if isinstance(each, _ChainedForward)]
    return found + [name for name, m in model.named_modules() if "_ac_core_chain" in m.__dict__]


def _apply(model: nn.Module, order: str, hook: Callable[[Any], object]) -> None:
    if order == "ac_core_first":
        apply_activation_checkpointing(model, "full")
        hook(model)
    else:
        hook(model)
        apply_activation_checkpointing(model, "full")


# Hooks that place the weights for the forward: the recompute must run them too. Each is applied and removed given
# the model and its blocks.


def _group_offloading(model: Any, blocks: Sequence[str] = ()) -> None:
    model.enable_group_offload(
        onload_device=CPU, offload_device=CPU, offload_type="block_level", num_blocks_per_group=1
    )


def _remove_group_offloading(model: nn.Module, blocks: Sequence[str]) -> None:
    # diffusers has no public switch-off; this is how it removes group offloading itself.
    HookRegistry.check_if_exists_or_initialize(model).remove_hook("group_offloading", recurse=True)


def _align_devices(model: nn.Module, blocks: Sequence[str]) -> None:
    for name in blocks:
        add_hook_to_module(model.get_submodule(name), AlignDevicesHook(execution_device=CPU, io_same_device=True))


def _remove_align_devices(model: nn.Module, blocks: Sequence[str]) -> None:
    for name in blocks:
        remove_hook_from_module(model.get_submodule(name))


def _dispatch(model: nn.Module, blocks: Sequence[str]) -> None:
    dispatch_model(model, device_map={"": "cpu"}, force_hooks=True)


def _remove_dispatch(model: nn.Module, blocks: Sequence[str]) -> None:
    remove_hook_from_module(model, recurse=True)


@dataclasses.dataclass(frozen=True)
class Placement:
    apply: Callable[[nn.Module, Sequence[str]], None]
    remove: Callable[[nn.Module, Sequence[str]], None]
    counter: str  # what the hook's pre-forward does, counted


PLACEMENT = {
    "group_offloading": Placement(_group_offloading, _remove_group_offloading, "onload"),
    "align_devices": Placement(_align_devices, _remove_align_devices, "align"),
    "dispatch_model": Placement(_dispatch, _remove_dispatch, "align"),
}


@pytest.mark.parametrize("removal", REMOVALS, ids=lambda r: "_then_".join(r))
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("hook", list(PLACEMENT))
def test_a_hook_that_places_weights_runs_in_the_recompute(tiny, hook, order, removal, counts):
    spec = PLACEMENT[hook]
    blocks = tiny.blocks
    reference = _built(tiny, counts)
    spec.apply(reference.model, blocks)
    expected = _train_step(reference, counts)
    per_forward = getattr(expected[2], spec.counter)
    assert per_forward > 0 and getattr(expected[3], spec.counter) == 0

    case = _built(tiny, counts)
    _apply(case.model, order, lambda model: spec.apply(model, blocks))
    assert sorted(checkpointed_blocks(case.model)) == sorted(blocks)
    recomputed = []
    for _ in range(2):
        got = _train_step(case, counts)
        _assert_same(got, expected)
        forward, backward = got[2], got[3]
        assert getattr(forward, spec.counter) == per_forward
        # Every block is recomputed inside its hook from the first step on, whichever came first.
        assert backward.blocks == len(blocks)
        recomputed.append(getattr(backward, spec.counter))
        if hook == "group_offloading":  # each group recomputed with its weights onloaded, offloaded again after
            assert backward.onload == backward.offload == backward.blocks
    assert 0 < recomputed[0] == recomputed[1]

    present = {"ac_core", "hook"}
    for what in removal:
        if what == "ac_core":
            remove_activation_checkpointing(case.model)
        else:
            spec.remove(case.model, blocks)
        present.discard(what)
        got = _train_step(case, counts)
        _assert_same(got, expected)
        assert (getattr(got[2], spec.counter) == per_forward) == ("hook" in present)
        assert got[3].blocks == (len(blocks) if "ac_core" in present else 0)
        assert (getattr(got[3], spec.counter) > 0) == (present == {"ac_core", "hook"})
        assert sorted(checkpointed_blocks(case.model)) == (sorted(blocks) if "ac_core" in present else [])
        assert is_activation_checkpointed(case.model) == ("ac_core" in present)
    assert _ac_core_forwards(case.model) == []


# Diffusers' caches skip blocks: counted in inference, as they are used.


def _denoise(case, counts: Counts, steps: int = 3) -> tuple[list[int], list[torch.Tensor]]:
    """Block runs per step and outputs of ``steps`` cached denoising steps on the same inputs."""
    runs, outputs = [], []
    case.model._reset_stateful_cache()
    with torch.no_grad():
        for step in range(steps):
            before = counts.blocks
            with case.model.cache_context("cond", step_index=step):
                outputs.append(case.model(**case.inputs).sample)
            runs.append(counts.blocks - before)
    return runs, outputs


CACHE = FirstBlockCacheConfig(threshold=0.2)


@pytest.mark.parametrize("removal", REMOVALS, ids=lambda r: "_then_".join(r))
@pytest.mark.parametrize("order", ORDERS)
def test_first_block_cache_keeps_skipping_and_checkpointing_stays_true(tiny, order, removal, counts):
    blocks = tiny.blocks
    all_runs, cached_runs = [len(blocks)] * 3, [len(blocks), 1, 1]  # per step: every block; the first block only
    reference = _built(tiny, counts)
    reference.model.enable_cache(CACHE)
    expected_runs, expected_outputs = _denoise(reference, counts)
    assert expected_runs == cached_runs
    expected = _train_step(reference, counts, context=True)
    plain = _built(tiny, counts)
    plain_training = _train_step(plain, counts)
    _, plain_outputs = _denoise(plain, counts)

    case = _built(tiny, counts)
    _apply(case.model, order, lambda model: model.enable_cache(CACHE))
    runs, outputs = _denoise(case, counts)
    assert runs == cached_runs
    torch.testing.assert_close(outputs, expected_outputs, rtol=0, atol=0)
    got = _train_step(case, counts, context=True)
    _assert_same(got, expected)
    assert got[3].blocks == len(blocks)  # every block recomputed

    present = {"ac_core", "hook"}
    for what in removal:
        if what == "ac_core":
            remove_activation_checkpointing(case.model)
        else:
            case.model.disable_cache()
        present.discard(what)
        runs, outputs = _denoise(case, counts)
        assert runs == (cached_runs if "hook" in present else all_runs)
        torch.testing.assert_close(outputs, expected_outputs if "hook" in present else plain_outputs, rtol=0, atol=0)
        got = _train_step(case, counts, context="hook" in present)
        _assert_same(got, expected if "hook" in present else plain_training)
        # What checkpointed_blocks says is what runs: the blocks it lists are recomputed in backward.
        listed = checkpointed_blocks(case.model)
        assert sorted(listed) == (sorted(blocks) if "ac_core" in present else [])
        assert got[3].blocks == len(listed)
    assert _ac_core_forwards(case.model) == []


# Hooks set on the blocks after ac-core: the model's first call already checkpoints every block above them.


def _first_block_cache(model: Any) -> None:
    model.enable_cache(CACHE)


AFTER_AC_CORE = {"group_offloading": _group_offloading, "first_block_cache": _first_block_cache}


@pytest.mark.parametrize("hook", list(AFTER_AC_CORE))
def test_the_first_step_checkpoints_every_block_under_a_hook_set_after_ac_core(tiny, hook, counts, caplog):
    context = hook == "first_block_cache"  # a cache trains inside its cache context
    reference = _built(tiny, counts)
    AFTER_AC_CORE[hook](reference.model)
    expected = _train_step(reference, counts, context)
    assert expected[3].blocks == 0

    case = _built(tiny, counts)
    _apply(case.model, "ac_core_first", AFTER_AC_CORE[hook])
    with caplog.at_level(logging.DEBUG, logger="ac_core"):
        got = _train_step(case, counts, context)  # the first call of every block
    _assert_same(got, expected)
    assert got[2].blocks == expected[2].blocks == len(tiny.blocks)
    assert got[3].blocks == len(tiny.blocks)  # every block's first call recomputed: checkpointed
    assert not [r for r in caplog.records if "sat out" in r.getMessage()]


# Hooks on the leaf modules inside a block run inside ac-core's checkpoint in either order.


@pytest.mark.parametrize("order", ORDERS)
def test_layerwise_casting_keeps_storage_dtype_and_gradients(tiny, order, counts):
    def casting(model: Any) -> None:
        model.enable_layerwise_casting(storage_dtype=torch.bfloat16, compute_dtype=torch.float32)

    reference = _built(tiny, counts)
    casting(reference.model)
    stored = {name: p.dtype for name, p in reference.model.named_parameters()}
    assert torch.bfloat16 in stored.values()
    expected = _train_step(reference, counts)

    case = _built(tiny, counts)
    _apply(case.model, order, casting)
    for _ in range(2):
        got = _train_step(case, counts)
        _assert_same(got, expected)  # exact: the same casts, in the same order, forward and recompute
        assert got[3].blocks == len(tiny.blocks)
        assert {name: p.dtype for name, p in case.model.named_parameters()} == stored
    # diffusers cannot remove layerwise casting (its hook refuses to deinitialize); ac-core's removal leaves it.
    remove_activation_checkpointing(case.model)
    got = _train_step(case, counts)
    _assert_same(got, expected)
    assert got[3].blocks == 0 and checkpointed_blocks(case.model) == {}
    assert {name: p.dtype for name, p in case.model.named_parameters()} == stored
    assert _ac_core_forwards(case.model) == []


@pytest.mark.parametrize("order", ORDERS)
def test_cpu_offload_loads_weights_in_the_recompute(tiny, order, counts):
    def offloading(model: nn.Module) -> None:
        cpu_offload(model, execution_device=CPU)

    reference = _built(tiny, counts)
    offloading(reference.model)
    expected = _train_step(reference, counts)
    assert expected[2].align > 0 and expected[3].align == 0

    case = _built(tiny, counts)
    _apply(case.model, order, offloading)
    got = _train_step(case, counts)
    _assert_same(got, expected)
    assert got[2].align == expected[2].align and got[3].align > 0 and got[3].blocks == len(tiny.blocks)
    remove_activation_checkpointing(case.model)
    got = _train_step(case, counts)
    _assert_same(got, expected)
    assert got[2].align == expected[2].align and got[3].align == 0 and got[3].blocks == 0
    assert _ac_core_forwards(case.model) == []


# Reporting.


def test_a_hook_found_over_ac_core_is_reported_naming_the_blocks(tiny, counts, caplog):
    first, second = (f"{path} ({tiny.block_class})" for path in tiny.blocks[:2])
    case = _built(tiny, counts)
    with caplog.at_level(logging.INFO, logger="ac_core"):
        apply_activation_checkpointing(case.model, "full")
        _group_offloading(case.model)
        caplog.clear()
        _train_step(case, counts)
    # Found when the model is called, before its first block runs: no call sat out.
    assert not [r for r in caplog.records if "came up through" in r.getMessage()]
    moved = [r.getMessage() for r in caplog.records if "layers run above it from now on" in r.getMessage()]
    assert len(moved) == 1 and first in moved[0] and second in moved[0] and "group_offloading" in moved[0]
    unnamed = len(tiny.blocks) - 4  # the message names 4 blocks, then says how many more
    assert (f"and {unnamed} more" in moved[0]) if unnamed > 0 else " more" not in moved[0]

    case = _built(tiny, counts)
    _group_offloading(case.model)
    with caplog.at_level(logging.INFO, logger="ac_core"):
        caplog.clear()
        apply_activation_checkpointing(case.model, "full")
    kept = [r.getMessage() for r in caplog.records if "puts back ac-core's forward" in r.getMessage()]
    assert len(kept) == 1 and tiny.blocks[0] in kept[0] and "group_offloading" in kept[0]


def test_a_forward_that_replaced_ac_core_s_is_reported_and_left_as_it_is(tiny, counts, caplog):
    """A library that puts back the forward it kept from before ac-core's drops ac-core's: checkpointed_blocks,
    is_activation_checkpointed and removal say so, and removal puts back nothing stale."""
    case = _built(tiny, counts)
    block = case.model.get_submodule(tiny.blocks[0])
    kept = block.forward  # what such a library keeps from before ac-core
    apply_activation_checkpointing(case.model, "full")
    block.forward = kept  # ... and puts back on removing its hook
    with caplog.at_level(logging.WARNING, logger="ac_core"):
        listed = checkpointed_blocks(case.model)
    assert sorted(listed) == sorted(tiny.blocks[1:])
    assert any(f"{tiny.blocks[0]} ({tiny.block_class})" in r.getMessage() for r in caplog.records)
    assert not is_activation_checkpointed(block) and is_activation_checkpointed(case.model)
    assert _train_step(case, counts)[3].blocks == len(tiny.blocks) - 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ac_core"):
        remove_activation_checkpointing(case.model)
    assert any("had been replaced" in r.getMessage() for r in caplog.records)
    assert block.forward is kept and _ac_core_forwards(case.model) == []
    _assert_same(_train_step(case, counts), _train_step(_built(tiny, counts), counts))


def test_a_wrapper_that_keeps_ac_core_s_forward_out_of_reach_gets_a_pass_through(tiny, counts, caplog):
    """A forward wrapped by someone who keeps it only in a closure (``__wrapped__``) cannot be taken out:
    after ac-core's removal it passes straight through, never failing on a chain that is gone."""
    case = _built(tiny, counts)
    apply_activation_checkpointing(case.model, "full")
    block = case.model.get_submodule(tiny.blocks[0])
    inner = block.forward

    @functools.wraps(inner)
    def wrapper(*args, **kwargs):
        return inner(*args, **kwargs)

    block.forward = wrapper
    assert sorted(checkpointed_blocks(case.model)) == sorted(tiny.blocks)
    with caplog.at_level(logging.INFO, logger="ac_core"):
        remove_activation_checkpointing(case.model)
    assert any("passes straight through" in r.getMessage() for r in caplog.records)
    assert block.forward is wrapper and checkpointed_blocks(case.model) == {}
    got = _train_step(case, counts)
    assert got[3].blocks == 0
    _assert_same(got, _train_step(_built(tiny, counts), counts))
