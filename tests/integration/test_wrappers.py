"""Models inside common wrappers (peft's PeftModel, torch.compile, DDP, any `.module` wrapper) are served by their own
adapter, with block paths that are FQNs of the model as passed; `blocks=` on a transformers model trains too."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ac_core
from ac_core import AdapterError, apply_activation_checkpointing, checkpointed_blocks, get_adapter, resolve_blocks

from ..adapters.cases import assert_same_training, loss_and_grads

transformers = pytest.importorskip("transformers")
llama = pytest.importorskip("ac_core_adapters.models.llama")

LAYERS = [f"model.layers.{i}" for i in range(3)]


class _Wrapper(nn.Module):
    """A DDP-like wrapper: the model is its one child, `module`, and its forward calls it."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def _peft_model(model: nn.Module) -> nn.Module:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return peft.get_peft_model(model, config)


def test_a_peft_model_is_served_by_the_adapter_of_its_base_model():
    case = llama.tiny_llama_for_causal_lm()
    wrapped = _peft_model(case.model)
    assert type(wrapped).__name__ == "PeftModelForCausalLM"
    assert get_adapter(wrapped) is get_adapter("llama")
    resolved = resolve_blocks(wrapped)
    assert resolved.model is wrapped and resolved.served_model is case.model
    assert resolved.served_path == "base_model.model"
    assert [b.path for b in resolved] == [f"base_model.model.{p}" for p in LAYERS]
    assert resolved.source == "adapter 'llama'"
    # Paths are FQNs of the model as passed.
    assert all(wrapped.get_submodule(b.path) is b.module for b in resolved)
    # Named the same ways as without the wrapper.
    assert resolve_blocks(wrapped, "llama").paths == resolved.paths
    assert resolve_blocks(wrapped, blocks=["base_model.model.model.layers"]).paths == resolved.paths
    assert resolve_blocks(wrapped, blocks=["model.layers"]).paths == resolved.paths  # a path in the wrapped model


def test_the_graph_route_finds_the_blocks_of_a_wrapped_model():
    wrapped = _peft_model(llama.tiny_llama_for_causal_lm().model)
    route = ac_core.prepare_graph_route(wrapped)
    assert route.blocks == {f"base_model.model.{p}" for p in LAYERS}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in route.retain


def test_torch_compile_and_module_wrappers_are_looked_through():
    case = llama.tiny_llama_for_causal_lm()
    compiled = torch.compile(case.model)
    assert [b.path for b in resolve_blocks(compiled)] == [f"_orig_mod.{p}" for p in LAYERS]
    wrapped = _Wrapper(compiled)
    assert [b.path for b in resolve_blocks(wrapped)] == [f"module._orig_mod.{p}" for p in LAYERS]


def test_a_compiled_model_trains_like_the_plain_one():
    # The reference is compiled too and trains without its KV cache, as ac-core's does: dynamo's graph of the tiny
    # Llama without the cache gives gradients 3e-8 off the eager ones on some CPUs, with no checkpointing at all.
    plain = llama.tiny_llama_for_causal_lm()
    plain.model.config.use_cache = False
    expected = _train(plain, lambda model: torch.compile(model, backend="eager"))
    case = llama.tiny_llama_for_causal_lm()
    compiled = torch.compile(case.model, backend="eager")  # dynamo only: seconds on CPU
    loss, grads, _ = _train(case, lambda _: compiled, {})
    assert_same_training((loss, grads), expected[:2])
    assert list(checkpointed_blocks(compiled)) == [f"_orig_mod.{p}" for p in LAYERS]


def test_an_adapter_that_serves_no_level_says_what_is_wrapped():
    wrapped = _Wrapper(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(AdapterError, match=r"wrapping torch\.nn\.modules\.container\.Sequential at 'module'"):
        resolve_blocks(wrapped)
    with pytest.raises(AdapterError, match=r"does not serve _Wrapper, wrapping LlamaForCausalLM at 'module'"):
        resolve_blocks(_Wrapper(llama.tiny_llama_for_causal_lm().model), "flux")


def _train(case, wrapper=lambda m: m, apply: dict | None = None) -> tuple:
    model = wrapper(case.model)
    if apply is not None:
        apply_activation_checkpointing(model, "ops", **apply)
    output = model(**case.inputs)
    loss = case.loss(output)
    loss.backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in case.model.named_parameters()}
    return loss.detach(), grads, model


@pytest.mark.parametrize(
    ("factory", "blocks"),
    [("tiny_llama_for_causal_lm", ["model.layers"]), ("tiny_llama_model", ["layers"])],
)
def test_blocks_on_a_transformers_model_trains_without_the_cache_error(factory, blocks):
    # blocks= applies no adapter; the KV-cache guard comes with any model whose forward takes use_cache.
    make = getattr(llama, factory)
    expected = loss_and_grads(make())
    case = make()
    apply_activation_checkpointing(case.model, "ops", blocks=blocks)
    assert_same_training(loss_and_grads(case), expected)
    with torch.no_grad():  # without gradients the cache is kept
        assert case.model(input_ids=case.inputs["input_ids"]).cache.get_seq_length() == 16


@pytest.mark.parametrize("route", ["adapter", "blocks"])
def test_a_wrapped_model_trains_like_the_plain_one(route):
    expected = _train(llama.tiny_llama_for_causal_lm())
    apply = {} if route == "adapter" else {"blocks": ["module.model.layers"]}
    loss, grads, model = _train(llama.tiny_llama_for_causal_lm(), _Wrapper, apply)
    assert_same_training((loss, grads), expected[:2])
    assert list(checkpointed_blocks(model)) == [f"module.{p}" for p in LAYERS]


def test_a_one_rank_ddp_model_is_served_and_trains_like_the_plain_one(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    from torch.nn.parallel import DistributedDataParallel

    expected = _train(llama.tiny_llama_for_causal_lm())
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        case = llama.tiny_llama_for_causal_lm()
        ddp = DistributedDataParallel(case.model)
        assert [b.path for b in resolve_blocks(ddp)] == [f"module.{p}" for p in LAYERS]
        apply_activation_checkpointing(ddp, "ops")
        loss, grads, _ = _train(case, lambda _: ddp)
    finally:
        dist.destroy_process_group()
    # DDP averages gradients over its one rank: the same values.
    assert_same_training((loss, grads), expected[:2])
    assert list(checkpointed_blocks(ddp)) == [f"module.{p}" for p in LAYERS]


def test_the_wrapped_models_names_are_unchanged():
    case = llama.tiny_llama_for_causal_lm()
    wrapped = _peft_model(case.model)
    before = [n for n, _ in wrapped.named_parameters()], list(wrapped.state_dict())
    apply_activation_checkpointing(wrapped, "ops")
    assert ([n for n, _ in wrapped.named_parameters()], list(wrapped.state_dict())) == before
    ac_core.remove_activation_checkpointing(wrapped)
    assert checkpointed_blocks(wrapped) == {}
