"""Real-width presets: the named ones exist, build the requested layers and hit the requested token count."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ac_core import get_adapter, resolve_blocks

# preset -> (adapter, tokens its default seq gives as token_count counts them, tokens for seq=1000)
PRESETS = {
    "wan2.1-1.3b": ("wan", 6240, 1008),
    "wan2.1-14b": ("wan", 6240, 1008),
    "hunyuanvideo": ("hunyuan", 6240 + 256, 1008 + 256),
    "flux.1-dev": ("flux", 4096 + 512, 992 + 512),
    "llama-3-8b": ("llama", 4096, 1000),
}


def _preset(name: str):
    adapter = get_adapter(PRESETS[name][0])
    if importlib.util.find_spec(adapter.library) is None:
        pytest.skip(f"{adapter.library} is not installed")
    (model_spec,) = [m for m in adapter.models if name in m.presets]
    return adapter, model_spec, model_spec.preset(name)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_builds_on_meta_with_the_requested_shape(name):
    adapter, model_spec, factory = _preset(name)
    for layers, seq, tokens in ((1, None, PRESETS[name][1]), (2, 1000, PRESETS[name][2])):
        with torch.device("meta"):
            case = factory(layers=layers, seq=seq)
        resolved = resolve_blocks(case.model, blocks=model_spec.containers)
        assert {len(container.blocks) for container in resolved.containers} == {layers}
        assert adapter.token_count(case.model, case.inputs) == tokens
        assert case.model.training
        with torch.device("meta"):  # shapes line up at the real width
            case.run()


def test_real_widths():
    widths = {}
    for name in PRESETS:
        _, _, factory = _preset(name)
        with torch.device("meta"):
            model = factory(layers=1).model
        widths[name] = next(p for n, p in model.named_parameters() if "norm" not in n and p.ndim == 2).shape
    assert widths["wan2.1-1.3b"][0] == 1536 and widths["wan2.1-14b"][0] == 5120
    assert widths["hunyuanvideo"][0] == 3072 and widths["flux.1-dev"][0] == 3072
    assert widths["llama-3-8b"][1] == 4096


def test_a_preset_builds_and_trains_on_cpu():
    _, _, factory = _preset("wan2.1-1.3b")
    case = factory(layers=1, seq=60)
    assert next(case.model.parameters()).dtype == torch.float32
    case.run().backward()
    assert all(p.grad is not None for p in case.model.blocks.parameters())


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_non_positive_seq_is_refused(name):
    _, _, factory = _preset(name)
    with torch.device("meta"), pytest.raises(ValueError, match="positive token count"):
        factory(layers=1, seq=0)
