"""token_count counts the tokens the attention kernels really see."""

from __future__ import annotations

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from .cases import served

CPU_SDPA = "aten::_scaled_dot_product_flash_attention_for_cpu"


class _LongestQuery(TorchDispatchMode):
    """Batch x query length of the longest attention call (the joint sequence, or the video's self-attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name() == CPU_SDPA:
            query = args[0]  # (batch, heads, tokens, head_dim)
            self.tokens = max(self.tokens, query.shape[0] * query.shape[2])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("spec", "model_spec"), list(served()))
def test_token_count_is_the_longest_attention_sequence(spec, model_spec):
    case = model_spec.build_tiny()
    with _LongestQuery() as seen:
        case.run()
    assert spec.token_count(case.model, case.inputs) == seen.tokens > 0
