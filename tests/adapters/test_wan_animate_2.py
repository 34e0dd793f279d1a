"""WanAnimate2 under checkpointing: its reference cache holds what the forward stored, and diffusers' own
gradient checkpointing, which cannot run this model, is turned off before the model's forward needs it."""

from __future__ import annotations

import pytest
import torch

from ac_core import apply_activation_checkpointing, get_adapter
from ac_core.libraries.checkpointing import enable_library_checkpointing, library_checkpointing
from ac_core_adapters.models.wan import tiny_animate_2, tiny_wan

pytest.importorskip("diffusers.models.transformers.transformer_wan_animate_2", reason="WanAnimate2 is new in 0.42")


def _live_saved_tensors(tensor: torch.Tensor) -> int:
    """Saved tensors still held by the graph behind ``tensor`` (those of a graph that backward freed raise)."""
    seen, stack, alive = set(), [tensor.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            if name.startswith("_saved_"):
                try:
                    value = getattr(node, name)
                except RuntimeError:
                    continue
                alive += isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return alive


def _cache_after_a_step(policy: str, blocks: list[str] | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(keys and values the forward stored, what the cache holds after backward), layer by layer; ``blocks`` names
    the containers itself, so that the adapter is not used."""
    case = tiny_animate_2()
    apply_activation_checkpointing(case.model, policy, blocks=blocks)
    output = case.model(**case.inputs)
    layers = case.inputs["kv_cache"].layer_caches
    stored = [t for layer in layers for t in (layer.key, layer.value)]
    case.loss(output).backward()
    return stored, [t for layer in layers for t in (layer.key, layer.value)]


@pytest.mark.parametrize("policy", ["full", "ops", "block_skip"])
def test_the_cache_holds_the_forwards_keys_and_values_after_backward(policy):
    stored, after = _cache_after_a_step(policy)
    assert len(after) == 4
    assert all(got is kept for got, kept in zip(after, stored, strict=True))
    assert [_live_saved_tensors(t) for t in after] == [0, 0, 0, 0]


def test_without_the_adapters_prepare_a_recompute_stores_its_own_graph():
    """Why prepare() hooks the blocks: named by blocks=, the model is checkpointed without it, and the recompute's
    keys and values (equal values) replace the forward's, keeping the recompute's saved activations alive."""
    stored, after = _cache_after_a_step("full", blocks=["blocks"])
    assert all(got is not kept and torch.equal(got, kept) for got, kept in zip(after, stored, strict=True))
    assert all(_live_saved_tensors(t) > 0 for t in after)


def test_prepare_hooks_each_block_once_and_leaves_other_wan_models_alone():
    case = tiny_animate_2()
    apply_activation_checkpointing(case.model, "full")
    apply_activation_checkpointing(case.model, "ops")
    assert [len(block._forward_pre_hooks) for block in case.model.get_submodule("blocks").children()] == [1, 1]
    # prepare's hook once on the model (beside ac-core's own, which settles foreign forwards before each call)
    assert [getattr(h, "__name__", "") for h in case.model._forward_pre_hooks.values()].count(
        "_library_checkpointing_off"
    ) == 1
    other, prepare = tiny_wan(), get_adapter("wan").prepare
    assert prepare is not None
    prepare(other.model)
    assert all(not m._forward_pre_hooks for m in other.model.modules())


def test_diffusers_checkpointing_switched_on_after_ac_core_is_turned_off_before_it_runs():
    plain = tiny_animate_2()
    enable_library_checkpointing(plain.model)
    with pytest.raises(TypeError, match="unexpected keyword argument 'kv_cache'"):
        plain.run()  # diffusers' own checkpointing cannot run this model

    case = tiny_animate_2()
    apply_activation_checkpointing(case.model, "full")
    enable_library_checkpointing(case.model)
    case.run().backward()
    assert library_checkpointing(case.model) == []
