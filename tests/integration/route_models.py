"""Tiny models no curated adapter serves, for the integration tests: a transformers Qwen3ForCausalLM and a diffusers
QwenImageTransformer2DModel, both served by the library route (adapters 'transformers-route' and 'diffusers-route').

They are laid out as the curated tiny Llama and Flux are where a test counts on it: 3 decoder layers at
``model.layers``, 16-token batches of 2 (Qwen3); image and text tokens of Flux's sizes (QwenImage, 3 blocks).
``QWEN3_ROUTE`` and ``QWEN_IMAGE_ROUTE`` are the route's own adapters with the tiny factory attached, found by
``"tests.integration.route_models:QWEN3_ROUTE"`` from another process (the FSDP2 ranks).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import torch

from ac_core import AdapterSpec, ModelCase, get_adapter
from ac_core.libraries.diffusers import sample_loss
from ac_core.testing import make_case

QWEN3_LAYERS = [f"model.layers.{i}" for i in range(3)]
QWEN_IMAGE_BLOCKS = [f"transformer_blocks.{i}" for i in range(3)]


def _lm_loss(output: Any) -> torch.Tensor:
    return output.loss


def _lm_inputs() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (2, 16))
    return {"input_ids": ids, "labels": ids}


def tiny_qwen3_for_causal_lm() -> ModelCase:
    """Qwen3ForCausalLM (q/k norms, grouped-query attention), 3 decoder layers, batch 2 x 16 tokens."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    return make_case(lambda: Qwen3ForCausalLM(config), _lm_inputs, _lm_loss)


def tiny_qwen_image() -> ModelCase:
    """QwenImageTransformer2DModel, 3 double-stream blocks, 16 image (4 x 4) and 6 text tokens."""
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel

    return make_case(
        lambda: QwenImageTransformer2DModel(
            patch_size=1,
            in_channels=8,
            out_channels=8,
            num_layers=3,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=16,
            axes_dims_rope=(2, 2, 4),
        ),
        lambda: {
            "hidden_states": torch.randn(1, 16, 8),
            "encoder_hidden_states": torch.randn(1, 6, 16),
            "encoder_hidden_states_mask": torch.ones(1, 6),
            "timestep": torch.tensor([0.5]),
            "img_shapes": [(1, 4, 4)],
        },
        sample_loss,
    )


def _routed(factory: Any, name: str) -> AdapterSpec:
    """The adapter the library route derives for ``factory``'s model, with ``factory`` as its tiny model."""
    model = factory().model
    adapter = get_adapter(model)
    assert adapter.name == name, f"{type(model).__name__} is served by {adapter.name!r}, not the library route"
    spec = adapter.model_spec(model)
    assert spec is not None
    return replace(adapter, models=(replace(spec, tiny=factory),))


_ROUTED = {
    "QWEN3_ROUTE": (tiny_qwen3_for_causal_lm, "transformers-route"),
    "QWEN_IMAGE_ROUTE": (tiny_qwen_image, "diffusers-route"),
}


@functools.cache
def __getattr__(name: str) -> AdapterSpec:
    # Derived on first use: importing this module builds no model and imports neither library.
    if name not in _ROUTED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _routed(*_ROUTED[name])
