"""Lean import, container paths, and resolving the type from a training config."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
from torch import nn

import ac_core
from ac_core import (
    CheckpointType,
    apply_activation_checkpointing,
    checkpointed_blocks,
    resolve_checkpointing_type,
)
from ac_core.testing import ToyBlock


def test_import_is_lean():
    code = (
        "import sys, ac_core; "
        "heavy = ('diffusers', 'transformers', 'ac_core_adapters', 'ac_core_conformance', 'rich', 'matplotlib'); "
        "print(sorted({m.split('.')[0] for m in sys.modules if m.split('.')[0] in heavy})); "
        "print('torch' in sys.modules); "
        # The graph route imports the compiler only when ac_core.compile is called.
        "print(sorted(m for m in ('torch._inductor', 'torch._dynamo') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "[]"
    assert out[1] == "True"
    assert out[2] == "[]"


def test_every_public_name_is_exported():
    import ac_core

    for name in ac_core.__all__:
        assert getattr(ac_core, name) is not None, name


class _ModeModel(nn.Module):
    """Blocks in a ModuleDict of ModuleLists, as Flux3's mode_blocks are."""

    def __init__(self) -> None:
        super().__init__()
        self.mode_blocks = nn.ModuleDict(
            {
                "image": nn.ModuleList(ToyBlock(16, 2) for _ in range(3)),
                "video": nn.ModuleList([ToyBlock(16, 2)]),
            }
        )
        self.single = nn.ModuleList(ToyBlock(16, 2) for _ in range(2))


def test_wildcard_paths_expand_over_module_dicts():
    model = _ModeModel()
    assert [fqn for fqn, _ in ac_core.modules_at(model, "mode_blocks.*")] == [
        "mode_blocks.image",
        "mode_blocks.video",
    ]
    assert ac_core.modules_at(model, "mode_blocks.audio") is None
    apply_activation_checkpointing(model, "block_skip", 2, blocks=["mode_blocks.*", "single"])
    # block_skip counts indices within each container.
    assert checkpointed_blocks(model) == {
        "mode_blocks.image.0": CheckpointType.FULL,
        "mode_blocks.image.2": CheckpointType.FULL,
        "mode_blocks.video.0": CheckpointType.FULL,
        "single.0": CheckpointType.FULL,
    }


@pytest.mark.parametrize(
    ("own", "config", "expected"),
    [
        ("ops", SimpleNamespace(model=SimpleNamespace(enable_gradient_checkpointing_type="full")), "ops"),
        (None, SimpleNamespace(model=SimpleNamespace(enable_gradient_checkpointing_type="full")), "full"),
        (None, SimpleNamespace(model=SimpleNamespace()), None),
        (None, SimpleNamespace(), None),
        (None, None, None),
    ],
)
def test_resolve_checkpointing_type(own, config, expected):
    assert resolve_checkpointing_type(own, config) == expected


def test_checkpoint_type_is_a_str_enum():
    assert CheckpointType("block_skip") is CheckpointType.BLOCK_SKIP
    assert CheckpointType.OPS == "ops" and str(CheckpointType.FULL) == "full"
