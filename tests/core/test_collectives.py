"""Which collective calls move activations and which move parameters, told apart by tensor identity alone; and the
op names a policy may and may not keep."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ac_core import Ops
from ac_core.collectives import (
    ACTIVATION_COLLECTIVES,
    CollectiveKeeper,
    block_state,
    check_activation_collectives,
    is_keepable_collective,
)


def test_data_made_from_parameters_alone_is_parameter_data_and_the_rest_activations():
    block = nn.Linear(4, 4)
    block.register_buffer("table", torch.ones(4))
    keeper = CollectiveKeeper(block_state(block))
    x = torch.randn(2, 4)
    cast = block.weight.to(torch.bfloat16)  # FSDP-style: a copy of the weight is still the weight
    keeper.saw((block.weight, torch.bfloat16), {}, cast)
    shard = block.weight.view(-1)[:8]  # a view shares the parameter's storage
    out = block(x)
    keeper.saw((x, block.weight, block.bias), {}, out)  # mixed inputs: an activation
    assert not keeper.moves_activations((block.weight,), {})
    assert not keeper.moves_activations((cast,), {})
    assert not keeper.moves_activations((shard,), {})
    assert not keeper.moves_activations((block.table,), {})  # type: ignore[arg-type]
    assert not keeper.moves_activations((x, block.weight), {})  # any parameter data in it: a parameter collective
    assert keeper.moves_activations((x,), {}) and keeper.moves_activations((out,), {"group_name": "0"})
    assert not keeper.moves_activations((), {})  # nothing moved: nothing to keep


def test_a_wait_is_kept_only_on_a_kept_output():
    keeper = CollectiveKeeper(())
    kept, other = torch.randn(3), torch.randn(3)
    keeper.kept(kept)
    assert keeper.waits_on_kept((kept,)) and keeper.waits_on_kept((kept.view(3, 1),))
    assert not keeper.waits_on_kept((other,)) and not keeper.waits_on_kept(())


def test_only_functional_collectives_but_their_wait_can_be_kept():
    assert {"_c10d_functional::all_to_all_single"} == ACTIVATION_COLLECTIVES
    assert is_keepable_collective("_c10d_functional::all_gather_into_tensor")
    assert is_keepable_collective("_c10d_functional::all_to_all_single.default")
    for refused in ("_c10d_functional::wait_tensor", "_c10d_functional::wait_tensor.default", "c10d::allgather_"):
        assert not is_keepable_collective(refused)
    assert not is_keepable_collective("aten::mm")
    with pytest.raises(ValueError, match="the wait, not the collective"):
        check_activation_collectives(["_c10d_functional::wait_tensor"], "here")
    with pytest.raises(ValueError, match=r"here: \['aten::mm'\] are not functional collectives"):
        check_activation_collectives(["aten::mm"], "here")


def test_ops_keeps_the_adapters_activation_collectives_unless_told_not_to():
    from ac_core import resolve_blocks
    from ac_core.policies.fixed import retained_ops
    from ac_core.testing import TOY_ADAPTER, toy_case

    blocks = resolve_blocks(toy_case().model, TOY_ADAPTER)
    assert retained_ops(blocks, Ops().retain, Ops().collectives) >= ACTIVATION_COLLECTIVES
    assert not any("c10d" in op for op in retained_ops(blocks, (), collectives=False))
