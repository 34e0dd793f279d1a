"""Context parallelism on 2 CPU ranks (gloo): the toy under Ulysses and ring attention (``ac_core.testing``), with
each policy applied before or after switching to it, trains bit-equal to the same parallel run unchecked, and
backward re-runs exactly the attention kernels and collectives its policy recomputes, from the first step on.

One set of ranks runs every check (a spawn costs seconds of imports); each rank compares its own gradients and
counts, and rank 0 saves what both found.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import pytest
import torch

A2A = "_c10d_functional::all_to_all_single"
GATHER = "_c10d_functional::all_gather_into_tensor"
SCATTER = "_c10d_functional::reduce_scatter_tensor"
WAIT = "_c10d_functional::wait_tensor"
KERNEL = "aten::_scaled_dot_product_flash_attention_for_cpu"
COUNTED = (A2A, GATHER, SCATTER, WAIT, KERNEL)

WORLD = 2
DEPTH, TOKENS, BATCH, DIM, HEADS = 2, 16, 2, 32, 4
STEPS = 2
POLICIES = ("none", "full", "ops", "plan")
ORDERS = ("before", "after")  # ac-core applied before or after the model is switched to context parallelism
FLOAT = 4  # bytes of a float32
SHARE = BATCH * (TOKENS // WORLD) * DIM * FLOAT  # an all-to-all's output: one rank's share of q, k, v or the output
KV = WORLD * 2 * BATCH * HEADS * (TOKENS // WORLD) * (DIM // HEADS) * FLOAT  # gathered keys, values: [w, 2, b, h, n, d]

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")


def _case(mode: str | None):
    from ac_core.testing import TOY_CONTEXT_PARALLEL, toy_case

    case = toy_case(dim=DIM, heads=HEADS, depth=DEPTH, tokens=TOKENS, batch=BATCH)
    inputs = TOY_CONTEXT_PARALLEL.shard(case.inputs) if mode is not None else dict(case.inputs)
    return case, inputs


def _config(policy: str, plan: Any) -> Any:
    import ac_core

    return {"full": ac_core.Full(), "ops": ac_core.Ops(), "plan": plan}.get(policy, policy)


def _steps(case: Any, inputs: Mapping[str, Any]) -> list[dict[str, Any]]:
    """STEPS training steps (SGD between them): per step the backward's counts of COUNTED ops, the bytes ``ops``
    kept by op name, and the gradients."""
    from ac_core import observe_retention
    from ac_core.measure import OpCounter

    found = []
    for _ in range(STEPS):
        case.model.zero_grad(set_to_none=True)
        with OpCounter() as counter, observe_retention() as log:
            case.loss(case.model(**inputs)).backward()
        kept: Counter[str] = Counter()
        for out in log.outputs:
            kept[out.op] += out.nbytes
        grads = {n: p.grad.clone() for n, p in case.model.named_parameters()}
        with torch.no_grad():
            for p in case.model.parameters():
                p -= 0.1 * p.grad
        found.append(
            {"backward": {op: counter.count([op], "backward") for op in COUNTED}, "kept": kept, "grads": grads}
        )
    return found


def _run(mode: str, policy: str, order: str, plan: Any) -> list[dict[str, Any]]:
    from ac_core import apply_activation_checkpointing
    from ac_core.testing import TOY_ADAPTER, TOY_CONTEXT_PARALLEL

    case, inputs = _case(mode)
    if policy != "none" and order == "before":
        apply_activation_checkpointing(case.model, _config(policy, plan), adapter=TOY_ADAPTER)
    TOY_CONTEXT_PARALLEL.enable(case.model, mode)
    if policy != "none" and order == "after":
        apply_activation_checkpointing(case.model, _config(policy, plan), adapter=TOY_ADAPTER)
    return _steps(case, inputs)


def _plan(mode: str, budget: Any) -> tuple[Any, dict[str, Any]]:
    """The toy's plan under ``mode`` on an H100 at ``budget``, with what it keeps per block and the bytes of every
    op occurrence of a block's profile by (op, index) (the same for every block)."""
    from ac_core import plan_activation_checkpointing, resolve_blocks
    from ac_core.budget import profile_model
    from ac_core.testing import TOY_ADAPTER, TOY_CONTEXT_PARALLEL

    case, inputs = _case(mode)
    TOY_CONTEXT_PARALLEL.enable(case.model, mode)
    plan = plan_activation_checkpointing(case.model, inputs, budget, adapter=TOY_ADAPTER, device="h100")
    profile = profile_model(resolve_blocks(case.model, TOY_ADAPTER), inputs)
    block = profile.blocks[0][1]
    sizes = {(op.op, op.index): op.nbytes for op in block.forward}
    facts = {
        "keep": [list(b.keep) for b in plan.blocks],
        "modes": [b.mode.value for b in plan.blocks],
        "timed": sorted({op.op for op in block.timed_candidates}),
        "ranks": {op.op: op.ranks for op in block.forward if "c10d" in op.op},
        "inputs": plan.inputs,
    }
    return plan, {"facts": facts, "sizes": sizes}


def _compare(runs: dict[tuple[str, str, str], list[dict[str, Any]]]) -> dict[str, Any]:
    """Per (mode, policy, order): the backward's counts per step, the bytes kept, and whether every step's
    gradients equal the unchecked run's (torch.equal)."""
    summary = {}
    for (mode, policy, order), steps in runs.items():
        plain = runs[(mode, "none", "before")]
        equal = all(
            torch.equal(step["grads"][n], ref["grads"][n])
            for step, ref in zip(steps, plain, strict=True)
            for n in ref["grads"]
        )
        summary[f"{mode}/{policy}/{order}"] = {
            "backward": [s["backward"] for s in steps],
            "kept": [dict(s["kept"]) for s in steps],
            "equal": equal,
        }
    return summary


def _parallel_matches_one_process(mode: str) -> float:
    """The largest difference between the ranks' averaged gradients under ``mode`` and one process's over the
    whole sequence (sdpa): each rank's loss is the mean over its tokens, so their average is the whole mean."""
    import torch.distributed as dist

    from ac_core.testing import TOY_CONTEXT_PARALLEL

    whole, whole_inputs = _case(None)
    whole.loss(whole.model(**whole_inputs)).backward()
    case, inputs = _case(mode)
    TOY_CONTEXT_PARALLEL.enable(case.model, mode)
    case.loss(case.model(**inputs)).backward()
    worst = 0.0
    for (name, p), q in zip(case.model.named_parameters(), whole.model.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        dist.all_reduce(p.grad)
        worst = max(worst, (p.grad / WORLD - q.grad).abs().max().item())
    return worst


class _GatheredRingBlock(torch.nn.Module):
    """A block that all-gathers its weight from per-rank shards (a parameter collective) and attends with the ring
    (whose keys' and values' all-gather is an activation collective): one op name, two kinds of data."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(DIM // WORLD, DIM) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        from ac_core.testing import ring_attention

        group = dist.group.WORLD
        assert group is not None
        gathered = torch.ops._c10d_functional.all_gather_into_tensor(self.weight, WORLD, group.group_name)
        weight = torch.ops._c10d_functional.wait_tensor(gathered)
        b, n, d = x.shape
        heads = (x @ weight.t()).view(b, n, HEADS, d // HEADS).transpose(1, 2)
        return x + ring_attention(heads, heads, heads).transpose(1, 2).reshape(b, n, d)


class _GatheredRingModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_GatheredRingBlock() for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _parameter_collective() -> dict[str, Any]:
    """Under Ops(retain={all-gather}), per step: the backward's all-gathers, the bytes kept, gradients equal to
    the unchecked run's; and which all-gather occurrences the planner may keep."""
    from ac_core import Ops, apply_activation_checkpointing, observe_retention, resolve_blocks
    from ac_core.budget import profile_model
    from ac_core.measure import OpCounter
    from ac_core.testing import shard_toy_inputs

    def build() -> torch.nn.Module:
        torch.manual_seed(1 + torch.distributed.get_rank())  # each rank its own shard of the weights
        return _GatheredRingModel()

    torch.manual_seed(0)
    x = shard_toy_inputs({"x": torch.randn(BATCH, TOKENS, DIM)})["x"]
    results = {}
    for policy in ("none", "ops"):
        model = build()
        if policy == "ops":
            apply_activation_checkpointing(model, Ops(retain=frozenset({GATHER})), blocks=["layers"])
        with OpCounter() as counter, observe_retention() as log:
            model(x).pow(2).mean().backward()
        results[policy] = {
            "gathers": counter.count([GATHER], "backward"),
            "kept": [(o.op, o.nbytes) for o in log.outputs],
            "grads": [torch.zeros(0) if p.grad is None else p.grad.clone() for p in model.parameters()],
        }
    equal = all(torch.equal(a, b) for a, b in zip(results["ops"]["grads"], results["none"]["grads"], strict=True))
    profile = profile_model(resolve_blocks(build(), blocks=["layers"]), x)
    block = profile.blocks[0][1]
    gathers = [(op.index, op.moves_parameters) for op in block.forward if op.op == GATHER]
    timed = sorted(op.index for op in block.timed_candidates if op.op == GATHER)
    return {
        "gathers": {p: r["gathers"] for p, r in results.items()},
        "kept": results["ops"]["kept"],
        "equal": equal,
        "profiled": gathers,
        "timed": timed,
    }


def _under_fsdp2() -> dict[str, dict[str, Any]]:
    """Ulysses on the toy with every block and the root fully_shard-ed over the same 2 ranks (FSDP2 over the
    sequence-parallel group, as DeepSpeed-Ulysses with ZeRO), per policy applied before or after sharding: the
    backward's all-to-alls and attention kernels, and whether the full gradients equal the unchecked run's."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from ac_core import apply_activation_checkpointing
    from ac_core.measure import OpCounter
    from ac_core.testing import TOY_ADAPTER, TOY_CONTEXT_PARALLEL

    runs = {}
    for policy, order in (("none", "before"), *((p, o) for p in ("full", "ops") for o in ORDERS)):
        case, inputs = _case("ulysses")
        TOY_CONTEXT_PARALLEL.enable(case.model, "ulysses")
        if policy != "none" and order == "before":
            apply_activation_checkpointing(case.model, _config(policy, None), adapter=TOY_ADAPTER)
        for layer in case.model.layers:
            fully_shard(layer)
        fully_shard(case.model)
        if policy != "none" and order == "after":
            apply_activation_checkpointing(case.model, _config(policy, None), adapter=TOY_ADAPTER)
        with OpCounter() as counter:
            case.loss(case.model(**inputs)).backward()
        grads = {}
        for name, p in case.model.named_parameters():
            grad = p.grad
            grads[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad
        runs[f"{policy}/{order}"] = {
            "backward": {op: counter.count([op], "backward") for op in (A2A, KERNEL)},
            "grads": grads,
        }
    plain = runs["none/before"]["grads"]
    return {
        key: {"backward": run["backward"], "equal": all(torch.equal(run["grads"][n], g) for n, g in plain.items())}
        for key, run in runs.items()
    }


def _profiled_step() -> dict[str, Any]:
    """A Ulysses step profiled on each rank (profile_step), rank 1's own figures made to differ: what each rank's
    profile says and plans."""
    import dataclasses

    import torch.distributed as dist

    from ac_core import profile_step
    from ac_core.testing import TOY_ADAPTER, TOY_CONTEXT_PARALLEL

    case, inputs = _case("ulysses")
    TOY_CONTEXT_PARALLEL.enable(case.model, "ulysses")
    with profile_step(case.model, adapter=TOY_ADAPTER) as step:
        case.loss(case.model(**inputs)).backward()
    if dist.get_rank() == 1:  # as a rank's measurement may differ by timing (collectives.agreed)
        made = step._made_profile()
        step._made_profile = lambda: dataclasses.replace(made, none_bytes=made.none_bytes + 1)  # type: ignore[method-assign]
    profile = step.profile
    plan = step.plan(0.5)
    return {
        "none_bytes": profile.none_bytes,
        "grouped": profile.group is not None,
        "keep": [b.keep for b in plan.blocks],
    }


def _compiled() -> dict[str, Any]:
    """Ulysses under ac_core.compile(model, Ops()) and under plain torch.compile (aot_eager), one step each from
    the same weights: whether the gradients are equal."""
    import ac_core
    from ac_core.testing import TOY_ADAPTER, TOY_CONTEXT_PARALLEL

    grads = []
    for policy in (None, ac_core.Ops()):
        case, inputs = _case("ulysses")
        TOY_CONTEXT_PARALLEL.enable(case.model, "ulysses")
        torch._dynamo.reset()
        if policy is None:
            compiled = torch.compile(case.model, backend="aot_eager")
        else:
            compiled = ac_core.compile(case.model, policy, backend="aot_eager", adapter=TOY_ADAPTER)
        case.loss(compiled(**inputs)).backward()
        grads.append([p.grad.clone() for p in case.model.parameters()])
    torch._dynamo.reset()
    return {"equal": all(torch.equal(a, b) for a, b in zip(*grads, strict=True))}


def _step_budget() -> dict[str, Any]:
    """A StepBudget(cp=2) plan made on the ranks under Ulysses, just below none's predicted peak: what it was
    planned at, what it keeps and holds per block, and the bytes of each op occurrence it could keep."""
    from ac_core import StepBudget, plan_activation_checkpointing, predict_step, resolve_blocks
    from ac_core.budget import profile_model
    from ac_core.testing import TOY_ADAPTER, TOY_CONTEXT_PARALLEL

    case, inputs = _case("ulysses")
    TOY_CONTEXT_PARALLEL.enable(case.model, "ulysses")
    probe = StepBudget("80GiB", device="h100", cp=WORLD, optimizer="sgd", margin=0.0)
    none = predict_step(case.model, inputs, "none", probe, adapter=TOY_ADAPTER).total
    budget = StepBudget(none - 1, device="h100", cp=WORLD, optimizer="sgd", margin=0.0)
    plan = plan_activation_checkpointing(case.model, inputs, budget, adapter=TOY_ADAPTER)
    block = profile_model(resolve_blocks(case.model, TOY_ADAPTER), inputs).blocks[0][1]
    return {
        "inputs": plan.inputs,
        "keep": [list(b.keep) for b in plan.blocks],
        "held": [b.held_bytes for b in plan.blocks if b.mode.value == "ops"],
        "sizes": {(op.op, op.index): op.nbytes for op in block.timed_candidates},
        "cp": plan.step_budget.cp if plan.step_budget is not None else None,
    }


def _worker(rank: int, world: int, tmp: str) -> None:
    import torch.distributed as dist

    from ac_core_conformance.distributed import _finish_rank

    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
    torch.set_num_threads(1)  # two ranks on a small machine: one thread each keeps them from starving each other
    found: dict[str, Any] = {"rank": rank}
    runs: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    plans = {}
    for mode in ("ulysses", "ring"):
        found[f"{mode}/one-process"] = _parallel_matches_one_process(mode)
        # 80% of what none holds: the knapsack keeps one block's collectives and kernels, leaves the other unchecked.
        plan, plans[mode] = _plan(mode, 0.8)
        for policy in POLICIES:
            for order in ORDERS if policy != "none" else ("before",):
                runs[(mode, policy, order)] = _run(mode, policy, order, plan)
    found["runs"] = _compare(runs)
    found["plans"] = plans
    found["parameter"] = _parameter_collective()
    found["step_budget"] = _step_budget()
    found["compiled"] = _compiled()
    found["fsdp2"] = _under_fsdp2()
    found["profiled"] = _profiled_step()

    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, found)
    _finish_rank(tmp, rank, everyone)


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    from ac_core_conformance.distributed import _run_ranks

    return _run_ranks(_worker, (), WORLD, 300.0)


def _per_step(found: dict[str, Any], key: str, op: str) -> list[int]:
    return [step[op] for step in found["runs"][key]["backward"]]


def test_the_parallel_toy_trains_like_one_process(ranks):
    for found in ranks:
        for mode in ("ulysses", "ring"):
            assert found[f"{mode}/one-process"] < 1e-6, mode


def test_every_policy_gives_the_unchecked_parallel_gradients_bit_equal(ranks):
    for found in ranks:
        unequal = [key for key, run in found["runs"].items() if not run["equal"]]
        assert unequal == [], f"rank {found['rank']}"


def test_ulysses_recomputes_no_collective_under_ops_and_every_one_under_full(ranks):
    calls = 4 * DEPTH  # q, k, v and the output, per block
    for found in ranks:
        assert _per_step(found, "ulysses/none/before", A2A) == [calls] * STEPS  # the plain backward's own
        assert _per_step(found, "ulysses/none/before", WAIT) == [calls] * STEPS
        for order in ORDERS:
            assert _per_step(found, f"ulysses/full/{order}", A2A) == [2 * calls] * STEPS
            assert _per_step(found, f"ulysses/full/{order}", KERNEL) == [DEPTH] * STEPS
            assert _per_step(found, f"ulysses/ops/{order}", A2A) == [calls] * STEPS
            assert _per_step(found, f"ulysses/ops/{order}", KERNEL) == [0] * STEPS
            # The kept all-to-alls' waits are kept with them: no wait re-runs on a tensor no collective made.
            assert _per_step(found, f"ulysses/ops/{order}", WAIT) == [calls] * STEPS


def test_ops_keeps_the_all_to_alls_outputs_and_reports_their_bytes(ranks):
    for found in ranks:
        for order in ORDERS:
            for kept in found["runs"][f"ulysses/ops/{order}"]["kept"]:
                assert kept[A2A] == 4 * DEPTH * SHARE
                assert WAIT not in kept
            for kept in found["runs"][f"ring/ops/{order}"]["kept"]:
                assert A2A not in kept and GATHER not in kept  # the ring's KV all-gather is not kept by default


def test_ring_recomputes_its_kv_all_gather_but_no_kernel_under_ops(ranks):
    for found in ranks:
        assert _per_step(found, "ring/none/before", GATHER) == [0] * STEPS
        assert _per_step(found, "ring/none/before", SCATTER) == [DEPTH] * STEPS
        for order in ORDERS:
            assert _per_step(found, f"ring/full/{order}", GATHER) == [DEPTH] * STEPS
            assert _per_step(found, f"ring/full/{order}", KERNEL) == [WORLD * DEPTH] * STEPS
            assert _per_step(found, f"ring/ops/{order}", GATHER) == [DEPTH] * STEPS
            assert _per_step(found, f"ring/ops/{order}", KERNEL) == [0] * STEPS


def test_plans_price_the_collectives_and_keep_them_where_the_budget_allows(ranks):
    plans = [found["plans"] for found in ranks]
    assert plans[0]["ulysses"]["facts"] == plans[1]["ulysses"]["facts"]  # every rank plans the same
    assert plans[0]["ring"]["facts"] == plans[1]["ring"]["facts"]
    for found in ranks:
        for mode, collective in (("ulysses", A2A), ("ring", GATHER)):
            facts = found["plans"][mode]["facts"]
            assert collective in facts["timed"]  # priced: a candidate of the time-costed knapsack
            assert facts["ranks"][collective] == WORLD
            kept = [(op, index) for keep in facts["keep"] for op, index in keep if op == collective]
            assert kept, f"{mode}: the plan keeps no {collective}"
            # Priced at what one rank holds: its share of q, k, v or the output; the gathered keys and values.
            sizes = found["plans"][mode]["sizes"]
            assert {sizes[k] for k in kept} == {SHARE if mode == "ulysses" else KV}
            for order in ORDERS:
                reruns = _per_step(found, f"{mode}/plan/{order}", collective)
                plain = _per_step(found, f"{mode}/none/before", collective)
                # Each kept occurrence spares backward one call of it, from the first step on.
                assert [r - p for r, p in zip(reruns, plain, strict=True)] == [
                    _recomputed(facts, collective, mode)
                ] * STEPS


def _recomputed(facts: dict[str, Any], collective: str, mode: str) -> int:
    """The calls of ``collective`` the plan's checkpointed blocks recompute: every forward call not kept."""
    per_block = 4 if mode == "ulysses" else 1
    return sum(
        per_block - sum(op == collective for op, _ in keep)
        for keep, block_mode in zip(facts["keep"], facts["modes"], strict=True)
        if block_mode != "none"
    )


def test_a_parameter_all_gather_is_never_kept_where_an_activation_one_of_the_same_op_is(ranks):
    for found in ranks:
        facts = found["parameter"]
        assert facts["equal"]
        assert [kept for kept in facts["kept"] if kept[0] == GATHER] == [(GATHER, KV)] * DEPTH  # the ring's only
        assert facts["gathers"] == {"none": 0, "ops": DEPTH}  # backward gathers each weight again
        assert facts["profiled"] == [(0, True), (1, False)]
        assert facts["timed"] == [1]


def test_a_step_budget_plans_one_ranks_tokens_and_prices_its_collectives(ranks):
    assert ranks[0]["step_budget"] == ranks[1]["step_budget"]  # every rank plans the same
    for found in ranks:
        facts = found["step_budget"]
        assert facts["cp"] == WORLD
        assert facts["inputs"] == (("x", (BATCH, TOKENS // WORLD, DIM), "torch.float32"),)
        assert all(facts["sizes"][(A2A, i)] == SHARE for i in range(4))
        kept = [(op, i) for keep in facts["keep"] for op, i in keep if op == A2A]
        assert kept, "the plan keeps no all-to-all"
        # What an ops block of the plan holds is what it keeps, the all-to-alls at one rank's bytes.
        kept_bytes = [sum(facts["sizes"][tuple(k)] for k in keep) for keep in facts["keep"] if keep]
        assert kept_bytes == facts["held"]


def test_the_compiled_route_keeping_the_all_to_alls_trains_like_plain_torch_compile(ranks):
    """What the graph route keeps and recomputes is counted on stand-in ranks (tests/graph/
    test_compile_collectives.py); here, on real ones, its gradients against torch.compile's without the pass."""
    assert all(found["compiled"]["equal"] for found in ranks)


def test_under_fsdp2_ops_keeps_the_all_to_alls_and_gradients_equal_the_unchecked_run(ranks):
    """FSDP2's all-gathers move parameters and are never kept; Ulysses' all-to-alls move activations and are,
    whether ac-core is applied before or after fully_shard."""
    for found in ranks:
        runs = found["fsdp2"]
        plain = runs["none/before"]["backward"]
        assert plain == {A2A: 4 * DEPTH, KERNEL: 0}  # q, k, v and the output's gradients; SDPA's own backward
        for order in ORDERS:
            assert runs[f"ops/{order}"] == {"backward": plain, "equal": True}, order
            full = runs[f"full/{order}"]
            assert full["equal"] and full["backward"] == {A2A: 8 * DEPTH, KERNEL: DEPTH}, order


def test_a_profiled_step_plans_the_same_on_every_rank(ranks):
    """Rank 1 measured one byte more: each rank's profile is rank 0's, so both keep the same ops."""
    assert ranks[0]["profiled"] == ranks[1]["profiled"]
    assert ranks[0]["profiled"]["grouped"]
