"""The compiled-route measurements count exactly what the partitioner keeps and recomputes."""

from __future__ import annotations

import functools

import pytest

from ac_core import experiments
from ac_core.cli import compare, main
from ac_core.cli.compare import format_table
from ac_core.experiments import compare_routes
from ac_core.measure.compiled import CompiledActivations
from ac_core.testing import toy_case

BATCH, TOKENS, DIM, HEADS, DEPTH = 2, 32, 64, 4, 2
ACT = BATCH * TOKENS * DIM * 4  # one fp32 activation of the residual stream
LSE = BATCH * HEADS * TOKENS * 4  # the attention kernel's logsumexp, kept with its output
ATTENTION = ["aten::_scaled_dot_product_flash_attention_for_cpu"]


@pytest.fixture(scope="module")
def routes() -> dict[str, CompiledActivations]:
    make = functools.partial(toy_case, dim=DIM, heads=HEADS, depth=DEPTH, tokens=TOKENS, batch=BATCH)
    return compare_routes(make, blocks=["layers"])


def test_graph_pass_keeps_exactly_attention_every_other_matmul_and_block_outputs(routes):
    ours = routes["graph pass"]
    # The embedding's output (it enters block 0), then per block: attention output and logsumexp,
    # the output projection (the 3rd, 7th ... matmul: saved by the alternation, needed by the
    # recomputed residual add) and the block's output. Parameters and the batch are not counted.
    assert ours.saved_bytes == (1 + 3 * DEPTH) * ACT + DEPTH * LSE
    assert ours.saved_tensors == 1 + 4 * DEPTH
    assert ours.runs_forward(ATTENTION) == DEPTH
    assert ours.recomputes(ATTENTION) == 0
    # The unsaved matmuls (qkv and mlp.0) are recomputed, with both layer norms and the GELU.
    assert ours.recomputes(["aten::addmm"]) == 2 * DEPTH
    assert ours.recomputes(["aten::native_layer_norm"]) == 2 * DEPTH


def test_graph_pass_saves_less_than_no_pass_and_recomputes_less_than_eager_ops(routes):
    plain, ours, full, ops = (routes[r] for r in experiments.ROUTES)
    assert plain.recomputes([*ATTENTION, "aten::addmm"]) == 0  # min-cut alone recomputes no costly op
    assert ours.saved_tensors < plain.saved_tensors and 3 * ours.saved_bytes < plain.saved_bytes
    assert ours.recompute_count < ops.recompute_count < full.recompute_count
    assert full.saved_bytes < ops.saved_bytes < ours.saved_bytes
    # Under eager 'full', backward re-runs each block's attention; 'ops' keeps it as the pass does.
    assert full.recomputes(ATTENTION) == DEPTH and ops.recomputes(ATTENTION) == 0


def test_table_lists_every_route(routes):
    table = format_table(routes, "toy").splitlines()
    assert table[0] == "toy" and [line.split()[0] for line in table[2:]] == ["no", "graph", "eager", "eager"]


def test_command_line_measures_the_toy_stack_it_is_given(monkeypatch, capsys):
    seen = {}

    def fake_compare(make_case, **kwargs):
        seen["case"], seen["kwargs"] = make_case(), kwargs
        return {route: CompiledActivations(2**20, 1) for route in experiments.ROUTES}

    monkeypatch.setattr(compare, "compare_routes", fake_compare)
    assert main(["compare", "--depth", "3", "--dim", "32", "--heads", "2", "--batch", "1", "--tokens", "8"]) == 0
    assert len(seen["case"].model.layers) == 3 and tuple(seen["case"].inputs["x"].shape) == (1, 8, 32)
    assert seen["kwargs"] == {"blocks": ["layers"], "backend": "aot_eager"}
    assert "graph pass" in capsys.readouterr().out


def test_command_skips_a_model_declared_not_compilable(capsys):
    from dataclasses import replace

    from ac_core import register_adapter
    from ac_core.registry import unregister_adapter
    from ac_core.testing import TOY_ADAPTER

    declared = replace(TOY_ADAPTER.models[0], compile_unsupported="upstream backward fails under compile")
    register_adapter(replace(TOY_ADAPTER, name="toy_uncompilable", models=(declared,)))
    try:
        assert main(["compare", "--adapter", "toy_uncompilable"]) == 0
    finally:
        unregister_adapter("toy_uncompilable")
    out = capsys.readouterr().out
    assert "skipped: torch.compile cannot train it (declared: upstream backward fails under compile)" in out
    assert "no pass" not in out


def test_command_names_the_valid_adapters(capsys):
    assert main(["compare", "--adapter", "nope"]) == 2
    assert "ac-core compare: error: unknown adapter 'nope'; valid values: all, " in capsys.readouterr().err


def test_command_line_compares_budgets_and_names_one_below_the_least(capsys):
    toy = ["--depth", "2", "--dim", "32", "--heads", "2", "--batch", "1", "--tokens", "16"]
    assert main(["compare", "--budget", "0.3,0.01", *toy]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[1].split() == ["budget", "route", "saved", "MiB", "recompute", "GFLOP", "ac-core", "/", "torch"]
    assert lines[2].startswith("0.3 (") and "ac-core plan, predicted" in lines[2]
    assert "ac-core plan, compiled" in lines[3] and "torch memory budget" in lines[4]
    ratio = float(lines[3].split()[-1])
    assert 0 < ratio < 10
    assert "budget 0.01: memory_budget=0.01" in out and "is below the least any plan holds" in out


def test_command_sizes_only_presets(capsys):
    assert main(["compare", "--adapter", "wan", "--layers", "2"]) == 2
    assert "--layers and --seq size a real-width preset" in capsys.readouterr().err
