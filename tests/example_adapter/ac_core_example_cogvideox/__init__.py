"""An ac-core adapter for diffusers' CogVideoXTransformer3DModel, written as a third party would.

ac-core ships no CogVideoX adapter; this package registers one through the ``ac_core.adapters``
entry point (see its pyproject.toml) and passes the conformance suite. Importing it imports
nothing of diffusers: the served class is an import string and the callables import lazily.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ac_core import DEFAULT_RETAINED_OPS, AdapterSpec, AttentionBackend, ModelCase, ModelSpec


def tiny_cogvideox() -> ModelCase:
    """Three CogVideoX blocks at width 16 over 2 x 3 frames of 8 x 8 latents and 8 text tokens; no download."""
    from diffusers import CogVideoXTransformer3DModel

    torch.manual_seed(0)
    model = CogVideoXTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        time_embed_dim=8,
        text_embed_dim=16,
        num_layers=3,  # BlockSkip(every=2), the suite's block_skip, checkpoints blocks 0 and 2 and leaves 1
        sample_width=8,
        sample_height=8,
        sample_frames=9,  # (9 - 1) / temporal_compression_ratio + 1 = 3 latent frames
        patch_size=2,
        temporal_compression_ratio=4,
        max_text_seq_length=8,
    )
    inputs = {
        "hidden_states": torch.randn(2, 3, 4, 8, 8),
        "encoder_hidden_states": torch.randn(2, 8, 16),
        "timestep": torch.tensor([10, 500]),
        "return_dict": False,
    }
    return ModelCase(model, inputs, lambda out: out[0].float().pow(2).mean())


class MathAttention:
    """Runs CogVideoX's attention processor with PyTorch's math SDPA kernel, which has no single output op."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    # The explicit signature matters: diffusers passes a processor only the keyword arguments it names.
    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> Any:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            return self.inner(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


def set_backend(model: nn.Module, name: str) -> None:
    """``"sdpa"``: CogVideoX's own processor (fused SDPA kernels); ``"math"``: the same under the math kernel."""
    if name not in ("sdpa", "math"):
        raise ValueError(f"CogVideoX attention backends are 'sdpa' and 'math', not {name!r}")
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if processor is None or not callable(getattr(module, "set_processor", None)):
            continue
        plain = processor.inner if isinstance(processor, MathAttention) else processor
        module.set_processor(MathAttention(plain) if name == "math" else plain)


def token_count(model: nn.Module, inputs: Mapping[str, Any]) -> int:
    """Text tokens plus latent patches, per sample."""
    frames, _, height, width = inputs["hidden_states"].shape[1:]
    patch = model.config.patch_size
    return inputs["encoder_hidden_states"].shape[1] + frames * (height // patch) * (width // patch)


COGVIDEOX_ADAPTER = AdapterSpec(
    name="cogvideox",
    models=(
        ModelSpec(
            cls="diffusers.CogVideoXTransformer3DModel",
            containers=("transformer_blocks",),
            # One joint attention over text and video tokens per block (attn1).
            attention_calls={"CogVideoXBlock": 1},
            versions="diffusers>=0.42",
            tiny=tiny_cogvideox,
        ),
    ),
    backends=(
        # CogVideoX's processor calls F.scaled_dot_product_attention itself (diffusers' attention
        # dispatcher does not reach it), so its output is one of PyTorch's fused SDPA kernels.
        AttentionBackend("sdpa", ops=tuple(sorted(DEFAULT_RETAINED_OPS))),
        AttentionBackend(
            "math", not_retainable="PyTorch's math SDPA is a composite: bmm, softmax and bmm, no single output op"
        ),
    ),
    default_backend="sdpa",
    library="diffusers",
    set_backend=set_backend,
    token_count=token_count,
)
"""The adapter; registered as ``cogvideox`` by this package's entry point."""
