"""Blocks in containers other than a ModuleList: torchtitan's ModuleDict of string keys, and a Sequential."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import pytest
import torch
from torch import nn

import ac_core
from ac_core import (
    AdapterError,
    CheckpointType,
    ModelCase,
    apply_activation_checkpointing,
    checkpointed_blocks,
    last_offload_stats,
    resolve_blocks,
    use_offload_transport,
)
from ac_core.measure import CompiledOpCounter, OpCounter
from ac_core.offload.testing import RecordingTransport
from ac_core.testing import TOY_ADAPTER, ToyBlock

from ..offload.helpers import EVERYTHING, assert_contract_kept

DIM, HEADS, DEPTH, TOKENS, BATCH = 16, 2, 4, 8, 2
ATTENTION = ["aten::_scaled_dot_product_flash_attention_for_cpu"]
NUMBERED = tuple(str(i) for i in range(DEPTH))
NAMED = ("first", "my-key", "2b", "last")  # dynamo spells these raw after a dot: "L['self'].layers.my-key"


class DictStack(nn.Module):
    """torchtitan's layout: ``layers`` is a ModuleDict of blocks by string key, iterated with ``.values()``."""

    def __init__(self, keys: tuple[str, ...] = NUMBERED) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleDict({key: ToyBlock(DIM, HEADS) for key in keys})
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers.values():
            h = layer(h)
        return self.head(h)


class SequentialStack(nn.Module):
    """``layers`` is an nn.Sequential of blocks, called as one module."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.layers = nn.Sequential(*(ToyBlock(DIM, HEADS) for _ in range(DEPTH)))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.embed(x)))


class ModeStack(nn.Module):
    """Flux's layout: a ModuleDict of ModuleLists of blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.mode_blocks = nn.ModuleDict(
            {mode: nn.ModuleList(ToyBlock(DIM, HEADS) for _ in range(n)) for mode, n in [("image", 3), ("video", 2)]}
        )


MODELS: dict[str, Callable[[], nn.Module]] = {
    "moduledict": DictStack,
    "named-keys": lambda: DictStack(NAMED),
    "sequential": SequentialStack,
}
PATHS = {
    "moduledict": [f"layers.{key}" for key in NUMBERED],
    "named-keys": [f"layers.{key}" for key in NAMED],
    "sequential": [f"layers.{i}" for i in range(DEPTH)],
}


def _case(name: str) -> ModelCase:
    torch.manual_seed(0)
    model = MODELS[name]().double()
    x = torch.randn(BATCH, TOKENS, DIM, dtype=torch.float64)
    return ModelCase(model, {"x": x}, lambda out: out.pow(2).mean())


def _grads(case: ModelCase) -> dict[str, torch.Tensor]:
    case.model.zero_grad(set_to_none=True)
    case.run().backward()
    return {name.removeprefix("_orig_mod."): p.grad.clone() for name, p in case.model.named_parameters()}


def _assert_same_grads(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        assert torch.equal(got[name], grad), name


def _names(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters()]


@pytest.fixture(params=list(MODELS))
def model_name(request) -> str:
    return request.param


def test_blocks_keep_their_fqns_and_index_by_position(model_name):
    resolved = resolve_blocks(_case(model_name).model, blocks=["layers"])
    assert [block.path for block in resolved] == PATHS[model_name]
    assert [block.index for block in resolved] == list(range(DEPTH))
    assert [container.path for container in resolved.containers] == ["layers"]


@pytest.mark.parametrize(
    ("config", "kind", "positions"),
    [
        ("full", CheckpointType.FULL, range(DEPTH)),
        (ac_core.Ops(), CheckpointType.OPS, range(DEPTH)),
        (ac_core.BlockSkip(every=2), CheckpointType.FULL, range(0, DEPTH, 2)),
    ],
    ids=["full", "ops", "block_skip2"],
)
def test_fixed_policies_checkpoint_the_blocks_and_train_like_plain(model_name, config, kind, positions):
    expected = _grads(_case(model_name))
    case = _case(model_name)
    names = _names(case.model)
    apply_activation_checkpointing(case.model, config, blocks=["layers"])
    assert checkpointed_blocks(case.model) == {PATHS[model_name][i]: kind for i in positions}
    assert _names(case.model) == names
    with OpCounter() as ops:
        got = _grads(case)
    _assert_same_grads(got, expected)
    assert ops.count(ATTENTION, "forward") == DEPTH
    # ops keeps attention's output; the other policies rerun the attention of the blocks they checkpoint.
    assert ops.count(ATTENTION, "backward") == (0 if kind is CheckpointType.OPS else len(positions))


@pytest.mark.parametrize("how", ["plan", "budget"])
def test_a_memory_budget_plans_the_blocks_and_trains_like_plain(model_name, how):
    expected = _grads(_case(model_name))
    case = _case(model_name)
    names = _names(case.model)
    plan = ac_core.plan_activation_checkpointing(case.model, case.inputs, 0.5, blocks=["layers"])
    assert [block.path for block in plan.blocks] == PATHS[model_name]
    checkpointed = {block.path for block in plan.blocks if block.mode != "none"}
    assert checkpointed, "half the bytes of none needs some block checkpointed"
    config = plan if how == "plan" else ac_core.Budget(0.5, example_inputs=case.inputs)
    apply_activation_checkpointing(case.model, config, blocks=["layers"])
    assert checkpointed_blocks(case.model).keys() == checkpointed
    assert _names(case.model) == names
    _assert_same_grads(_grads(case), expected)


@pytest.mark.parametrize("blocks", [["layers"], None], ids=["blocks=", "found-in-graph"])
def test_the_graph_route_finds_the_blocks(model_name, blocks):
    if blocks is None and model_name != "moduledict":
        # Without blocks= the pass takes items under numeric keys of a container that is indexed, not called.
        pytest.skip("only numbered items of a ModuleList or ModuleDict are found in the graph")
    torch._dynamo.reset()
    expected = _grads(_case(model_name))
    case = _case(model_name)
    names = _names(case.model)
    case.model = ac_core.compile(case.model, ac_core.Ops(), backend="aot_eager", blocks=blocks)
    _assert_same_grads(_grads(case), expected)  # compiles outside the counter
    assert _names(case.model) == [f"_orig_mod.{name}" for name in names]
    with CompiledOpCounter() as ops:
        case.run().backward()
    assert ops.count(ATTENTION, "backward") == 0
    # Blocks were matched: each recomputes its unsaved matmuls (qkv and mlp.0); outside a block all is saved.
    assert ops.count(["aten::addmm"], "backward") == 2 * DEPTH
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "expression",
    ["L['self'].layers.my-key.attn", "getattr(L['self'].layers, 'my-key').attn", "L['self'].layers['my-key'].attn"],
)
def test_graph_module_paths_keep_module_dict_keys_whole(expression):
    from ac_core.graph.blocks import module_path

    assert module_path(expression) == "layers.my-key.attn"


def test_offload_of_block_inputs_through_the_double():
    expected = _grads(_case("named-keys"))
    case = _case("named-keys")
    config = dataclasses.replace(EVERYTHING, token_count=lambda model, inputs: inputs["x"].shape[1])
    apply_activation_checkpointing(case.model, "full", blocks=["layers"], offload=config)
    assert checkpointed_blocks(case.model).keys() == set(PATHS["named-keys"])
    with use_offload_transport(RecordingTransport()) as transport:
        got = _grads(case)
    _assert_same_grads(got, expected)
    stats = last_offload_stats(case.model)
    assert stats is not None and stats.checkpoint_inputs == DEPTH
    assert_contract_kept(transport)


def test_a_module_dict_of_containers_needs_a_star():
    model = ModeStack()
    with pytest.raises(AdapterError, match=r"'mode_blocks'.* its item 'image' is a ModuleList.*name 'mode_blocks\.\*'"):
        resolve_blocks(model, blocks=["mode_blocks"])
    resolved = resolve_blocks(model, blocks=["mode_blocks.*"])
    assert [(b.path, b.index) for b in resolved] == [
        ("mode_blocks.image.0", 0),
        ("mode_blocks.image.1", 1),
        ("mode_blocks.image.2", 2),
        ("mode_blocks.video.0", 0),
        ("mode_blocks.video.1", 1),
    ]


def test_a_star_over_a_module_dict_of_blocks_names_the_dict_instead():
    with pytest.raises(AdapterError, match=r"'layers\.first' .* is a ToyBlock, .*; name 'layers' for the blocks"):
        resolve_blocks(DictStack(NAMED), blocks=["layers.*"])


def test_errors_list_module_dicts_of_blocks():
    with pytest.raises(AdapterError) as info:
        resolve_blocks(DictStack(), blocks=["layer"])
    assert "DictStack's block containers are ['layers']." in str(info.value)  # not padded with layers.0.mlp
    assert str(info.value).endswith("Did you mean 'layers'?")
    with pytest.raises(AdapterError, match=r"does not serve DictStack .*block containers are \['layers'\]"):
        resolve_blocks(DictStack(), TOY_ADAPTER)


class _TwoDicts(DictStack):
    def __init__(self) -> None:
        super().__init__()
        self.refiner = nn.ModuleDict({"a": ToyBlock(DIM, HEADS), "b": ToyBlock(DIM, HEADS)})


def test_a_module_dict_of_blocks_left_out_is_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="ac_core"):
        apply_activation_checkpointing(_TwoDicts(), "full", blocks=["layers"])
    assert "'refiner' (ToyBlock at refiner.a)" in caplog.text


def test_draft_finds_module_dicts_of_blocks_and_the_lists_inside_one():
    from ac_core.cli.draft import find_containers

    assert find_containers(DictStack(NAMED))[0] == ["layers"]
    assert find_containers(ModeStack())[0] == ["mode_blocks.image", "mode_blocks.video"]


def _tiny_named() -> ModelCase:
    torch.manual_seed(0)
    return ModelCase(DictStack(NAMED), {"x": torch.randn(BATCH, TOKENS, DIM)}, lambda out: out.pow(2).mean())


# Per-position attention calls: a ModuleDict's keys are no indices.
NAMED_ADAPTER = dataclasses.replace(
    TOY_ADAPTER,
    name="toy-named-keys",
    models=(
        ac_core.ModelSpec(
            cls=f"{DictStack.__module__}.{DictStack.__qualname__}",
            containers=("layers",),
            attention_calls={"ToyBlock": dict.fromkeys(range(DEPTH), 1)},
            tiny=_tiny_named,
        ),
    ),
)


@pytest.mark.parametrize(
    "policy", [ac_core.Full(), ac_core.Ops(), ac_core.BlockSkip(every=2)], ids=["full", "ops", "block_skip2"]
)
def test_the_conformance_checks_take_a_module_dict(policy):
    pytest.importorskip("ac_core_conformance")
    from ac_core_conformance import Subject, check_attention_recomputed, check_attention_retained, check_coverage

    subject = Subject(NAMED_ADAPTER, NAMED_ADAPTER.models[0], NAMED_ADAPTER)
    report = check_coverage(subject, policy)
    assert set(report.checkpointed) <= set(PATHS["named-keys"])
    if isinstance(policy, ac_core.Ops):
        assert check_attention_retained(subject, "sdpa").per_block == dict.fromkeys(PATHS["named-keys"], 1)
    else:
        assert check_attention_recomputed(subject, policy) == len(report.checkpointed)
