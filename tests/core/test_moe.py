"""Mixture-of-experts blocks: the router's top-k decision is kept under ``ops`` and in every plan, so recompute
sends each token to the same experts; ``full`` recomputes it from the same inputs. Gradients bit-equal.

Three MoE blocks, each 2 layers, hidden 16-32, 4 experts, top-2: a plain-torch one written as DeepSeek-V3's
reference code writes it (softmax router, topk, tokens sorted by expert, split by ``bincount(...).tolist()``),
transformers' Mixtral with its eager experts (one matmul per expert hit, found with ``nonzero``) and Qwen3-MoE
with its default grouped experts (sort, histc, grouped matmul: shapes fixed). Each router has two experts with
equal weights, so its scores tie exactly: :class:`_TiesBrokenOtherwise` makes a recomputed ``topk`` break those
ties the other way, as another run of a CUDA kernel may (torchtitan#1117).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointError

import ac_core
from ac_core.budget import ModelProfile, plan_from_profile, profile_model
from ac_core.measure import OpCounter, held_for_backward

transformers = pytest.importorskip("transformers")

TOPK = ["aten::topk"]
LAYERS = 2
TOKENS, TOP_K = 16, 2
ROUTING_BYTES = LAYERS * TOKENS * TOP_K * (4 + 8)  # per block: top-k weights (float32) and indices (int64)


class ToyMoE(nn.Module):
    def __init__(self, dim: int = 16, experts: int = 4, k: int = TOP_K) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.gate = nn.Linear(dim, experts, bias=False)
        self.up = nn.Parameter(torch.randn(experts, dim, 2 * dim) * 0.2)
        self.down = nn.Parameter(torch.randn(experts, 2 * dim, dim) * 0.2)
        self.experts, self.k = experts, k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x).flatten(0, 1)
        weights, chosen = torch.topk(self.gate(h).softmax(-1), self.k, dim=-1)
        order = torch.argsort(chosen.flatten(), stable=True)  # (token, choice) slots, grouped by expert
        counts = torch.bincount(chosen.flatten(), minlength=self.experts).tolist()
        out = torch.zeros_like(h)
        groups = zip(order.split(counts), (order // self.k).split(counts), strict=True)
        for expert, (slots, tokens) in enumerate(groups):
            y = torch.relu(h[tokens] @ self.up[expert]) @ self.down[expert]
            out = out.index_add(0, tokens, y * weights.flatten()[slots, None])
        return x + out.view_as(x)


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ToyMoE() for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def _ids(seed: int, shape: tuple[int, int] = (2, 8)) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, 64, shape, generator=torch.Generator().manual_seed(seed))}


_SIZES = dict(vocab_size=64, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2)


def _mixtral() -> nn.Module:
    config = transformers.MixtralConfig(
        **_SIZES, intermediate_size=32, num_local_experts=4, num_experts_per_tok=TOP_K, max_position_embeddings=64
    )
    model = transformers.MixtralForCausalLM(config)
    model.set_experts_implementation("eager")
    return model


def _qwen3_moe() -> nn.Module:
    config = transformers.Qwen3MoeConfig(
        **_SIZES, intermediate_size=32, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=TOP_K,
        head_dim=8, max_position_embeddings=64, norm_topk_prob=True,
    )  # fmt: skip
    return transformers.Qwen3MoeForCausalLM(config)


def _lm_loss(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**inputs, labels=inputs["input_ids"]).loss


def _toy_loss(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    return model(inputs)


@dataclass
class Subject:
    model: nn.Module
    inputs: Any
    loss: Callable[[nn.Module, Any], torch.Tensor]
    blocks: list[str]
    grads: dict[str, torch.Tensor]
    profile: ModelProfile


def _tie_two_experts(model: nn.Module) -> None:
    for module in model.modules():
        weight = getattr(getattr(module, "gate", None), "weight", None)
        if isinstance(weight, nn.Parameter):
            weight.data[1] = weight.data[0]


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


_MAKERS = {
    "toy": (ToyModel, lambda: torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(2)), _toy_loss, "layers"),
    "mixtral": (_mixtral, lambda: _ids(1), _lm_loss, "model.layers"),
    "qwen3_moe": (_qwen3_moe, lambda: _ids(1), _lm_loss, "model.layers"),
}


@functools.cache
def _subject(name: str) -> Subject:
    make, inputs, loss, container = _MAKERS[name]
    torch.manual_seed(0)
    model = make()
    _tie_two_experts(model)
    model_inputs = inputs()
    plain = copy.deepcopy(model)
    loss(plain, model_inputs).backward()
    profile = profile_model(ac_core.resolve_blocks(model, blocks=[container]), model_inputs)
    return Subject(model, model_inputs, loss, [container], _grads(plain), profile)


@pytest.fixture(params=list(_MAKERS))
def subject(request) -> Subject:
    return _subject(request.param)


def _apply(subject: Subject, policy: str) -> nn.Module:
    model = copy.deepcopy(subject.model)
    if policy in ("full", "ops"):
        return ac_core.apply_activation_checkpointing(model, policy, blocks=subject.blocks)
    fraction = 0.5 if policy == "plan" else None
    budget = fraction if fraction is not None else subject.profile.min_bytes + subject.profile.routing_bytes
    plan = plan_from_profile(subject.profile, budget, containers=tuple(subject.blocks))
    return ac_core.apply_activation_checkpointing(model, plan)


class _TiesBrokenOtherwise(TorchDispatchMode):
    """In backward, ``aten::topk`` returns the last of tied scores where the forward's returned the first."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.ops.aten.topk.default or torch._C._current_graph_task_id() == -1:
            return func(*args, **kwargs)
        scores, k, *rest = args
        dim = rest[0] if rest else kwargs.get("dim", -1)
        values, indices = func(scores.flip(dim), k, *rest, **kwargs)
        return values, scores.size(dim) - 1 - indices


def _step(subject: Subject, model: nn.Module, ties_broken_otherwise: bool = False) -> OpCounter:
    counter = OpCounter()
    with counter:
        loss = subject.loss(model, subject.inputs)
        if ties_broken_otherwise:
            with _TiesBrokenOtherwise():
                loss.backward()
        else:
            loss.backward()
    return counter


def _bit_equal(subject: Subject, model: nn.Module) -> bool:
    grads = _grads(model)
    return grads.keys() == subject.grads.keys() and all(torch.equal(grads[n], g) for n, g in subject.grads.items())


@pytest.mark.parametrize("policy", ["full", "ops", "plan", "least"])
def test_gradients_bit_equal_and_topk_recomputed_under_full_only(subject, policy):
    model = _apply(subject, policy)
    counter = _step(subject, model)
    assert counter.count(TOPK) == LAYERS
    assert counter.count(TOPK, "backward") == (LAYERS if policy == "full" else 0)
    assert _bit_equal(subject, model)


@pytest.mark.parametrize("policy", ["ops", "plan", "least"])
def test_kept_routing_sends_tokens_to_the_same_experts_when_ties_break_otherwise(subject, policy):
    model = _apply(subject, policy)
    counter = _step(subject, model, ties_broken_otherwise=True)
    assert counter.count(TOPK, "backward") == 0
    assert _bit_equal(subject, model)


def test_full_recomputes_routing_so_ties_broken_otherwise_route_elsewhere(subject):
    # Why the decision is kept: recomputed, it sends tokens elsewhere. With data-dependent shapes torch refuses
    # (torchtitan#1117); with fixed ones (grouped experts) the gradients are silently another routing's.
    model = _apply(subject, "full")
    if isinstance(model, transformers.Qwen3MoeForCausalLM):
        _step(subject, model, ties_broken_otherwise=True)
        assert not _bit_equal(subject, model)
        return
    with pytest.raises(CheckpointError, match="different metadata than during the forward pass"):
        _step(subject, model, ties_broken_otherwise=True)


def test_every_plan_keeps_each_routing_decision_and_counts_its_bytes(subject):
    profile = subject.profile
    assert profile.routing_bytes == ROUTING_BYTES
    plan = plan_from_profile(profile, 0.5)
    assert all(("aten::topk", 0) in b.keep for b in plan.blocks if b.mode != ac_core.BlockMode.NONE)
    least = plan_from_profile(profile, profile.min_bytes + ROUTING_BYTES)
    assert least.min_bytes == profile.min_bytes + ROUTING_BYTES
    assert [b.keep for b in least.blocks] == [(("aten::topk", 0),)] * LAYERS
    with pytest.raises(ValueError, match="nothing kept but block inputs and MoE routing decisions"):
        plan_from_profile(profile, profile.min_bytes + ROUTING_BYTES - 1)


def test_toy_plan_keeps_no_op_after_bincount_decides_the_shapes():
    # Before bincount: the router's matmul (the norm and softmax count no FLOPs) and topk; after it nothing.
    plan = plan_from_profile(_subject("toy").profile, 0.9)
    assert [b.keep for b in plan.blocks] == [(("aten::mm", 0), ("aten::topk", 0))] * LAYERS


def _forward_matmuls(model: nn.Module, inputs: dict[str, torch.Tensor]) -> int:
    with torch.no_grad(), OpCounter() as counter:
        model(**inputs)
    return counter.count(["aten::mm"])


def test_a_plan_holds_as_planned_at_a_batch_routed_to_fewer_experts():
    # Eager experts run one matmul pair per expert hit: a plan naming 'mm#7' would name another expert's matmul,
    # at another size, in another batch. Measured before: 6,516 bytes at the planned batch, 6,644 (over the
    # 6,556-byte budget) at a batch hitting fewer experts.
    torch.manual_seed(0)
    model = _mixtral()
    batches = [_ids(seed, (1, 2)) for seed in range(12)]
    by_matmuls = {_forward_matmuls(model, batch): batch for batch in batches}
    planned, other = by_matmuls[max(by_matmuls)], by_matmuls[min(by_matmuls)]
    assert max(by_matmuls) - min(by_matmuls) >= 4  # other experts hit, so other matmul counts
    plan = ac_core.plan_activation_checkpointing(model, planned, 0.5, blocks=["model.layers"])
    ac_core.apply_activation_checkpointing(model, plan)
    held = [held_for_backward(lambda b=batch: _lm_loss(model, b))[1] for batch in (planned, other)]
    assert held[0] == held[1] <= plan.budget_bytes


def test_ops_keeps_routing_on_the_graph_route_too():
    request = ac_core.GraphRequest(ToyModel(), containers=["layers"])
    assert "aten::topk" in ac_core.graph_decisions(ac_core.Ops(), request).retain


def test_retained_routing_is_the_kept_copy_alive_until_backward(subject):
    # observe_retention reports what is kept for backward: for routing that is the copy, not the router's own
    # output (transformers' routers normalise it in place, then drop it).
    model = _apply(subject, "ops")
    with ac_core.observe_retention() as retained:
        loss = subject.loss(model, subject.inputs)
        routing = [out for out in retained.outputs if out.op == TOPK[0]]
        alive = [out.alive for out in routing]
        loss.backward()
    assert len(routing) == 2 * LAYERS  # values and indices per MoE block
    assert alive == [True] * len(routing)
    assert not any(out.alive for out in routing)  # freed once backward has used them
