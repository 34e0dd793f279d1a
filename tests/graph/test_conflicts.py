"""No double checkpointing: the graph route takes eager checkpointing off first, and says so."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import ac_core
from ac_core import ConflictingCheckpointError, GraphRoute, apply_activation_checkpointing, checkpointed_blocks
from ac_core.testing import LibraryCheckpointingToy, toy_case

from ..core.helpers import assert_same_training, loss_and_grads, structure


def _case(checkpointing: str):
    case = toy_case(depth=2)
    if checkpointing == "library":
        library = LibraryCheckpointingToy(depth=2)
        library.load_state_dict(case.model.state_dict())
        library.gradient_checkpointing = True
        case.model = library
    else:
        apply_activation_checkpointing(case.model, checkpointing, blocks=["layers"])
    return case


@pytest.mark.parametrize("checkpointing", ["ops", "full", "library"])
def test_the_pass_over_eager_checkpointing_fails_to_partition(checkpointing, tmp_path, monkeypatch):
    # What removal prevents: eager regions reach the joint graph tagged, with their own ac_graph_id
    # on every node (getitems included); the pass re-tags the rest at id 0, so the partitioner's
    # region-boundary rule forces a multi-output producer to MUST_SAVE while its getitems must be
    # recomputed, a cut it cannot make.
    monkeypatch.chdir(tmp_path)  # the partitioner writes its failed graph to the working directory
    case = _case(checkpointing)
    compiled = torch.compile(case.model, backend=GraphRoute().aot_eager())
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="failed to partition"):
        case.loss(compiled(**case.inputs)).backward()


@pytest.mark.parametrize("checkpointing", ["ops", "library"])
def test_compile_removes_eager_checkpointing_and_logs_it(caplog, checkpointing):
    expected = loss_and_grads(toy_case(depth=2))
    case = _case(checkpointing)
    with caplog.at_level(logging.INFO, logger="ac_core"):
        case.model = ac_core.compile(case.model, backend="aot_eager")
        got = loss_and_grads(case)
    removed = [r for r in caplog.records if "eager checkpointing was removed" in r.getMessage()]
    assert len(removed) == 1 and removed[0].levelno == logging.INFO
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name == "ac_core"]
    model = case.model._orig_mod
    assert checkpointed_blocks(model) == {} and getattr(model, "gradient_checkpointing", False) is False
    assert_same_training(got, expected)


def test_a_foreign_wrapper_is_refused_and_the_model_left_as_it_was():
    model = toy_case(depth=2).model
    model.layers[0] = checkpoint_wrapper(model.layers[0])
    before = structure(model)
    with pytest.raises(ConflictingCheckpointError, match="checkpoint_wrapper"):
        ac_core.compile(model, backend="aot_eager")
    assert structure(model) == before
