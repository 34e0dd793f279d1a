"""``make_case``: the recipe every tiny factory follows (seed, model, then inputs), so that each call is the same."""

from __future__ import annotations

import torch
from torch import nn

from ac_core.testing import make_case


def _case(seed: int | None = 0):
    return make_case(
        lambda: nn.Linear(4, 3).eval(), lambda: {"input": torch.randn(2, 4)}, lambda out: out.sum(), seed=seed
    )


def test_the_seed_fixes_weights_then_inputs():
    case = _case()
    torch.manual_seed(0)
    weight = nn.Linear(4, 3).weight
    assert torch.equal(case.model.weight, weight)
    assert torch.equal(case.inputs["input"], torch.randn(2, 4))  # drawn after the weights
    again = _case()
    assert torch.equal(again.model.weight, case.model.weight) and torch.equal(
        again.inputs["input"], case.inputs["input"]
    )


def test_the_model_trains_and_the_case_runs():
    case = _case()
    assert case.model.training  # built in eval mode above, put in training mode
    assert case.run().ndim == 0


def test_no_seed_leaves_the_generator_as_it_is():
    torch.manual_seed(7)
    state = torch.get_rng_state()
    case = _case(seed=None)
    torch.set_rng_state(state)
    assert torch.equal(case.model.weight, nn.Linear(4, 3).weight)
