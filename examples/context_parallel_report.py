"""What each policy costs and keeps under context parallelism, measured on 2 CPU ranks (gloo).

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/context_parallel_report.py

The toy (``ac_core.testing``) under Ulysses and ring attention, for each policy (none, full, ops, a plan at a
fraction of none's held bytes): per training step, the attention kernels and collectives backward re-runs beyond
the plain backward's, the bytes kept by collectives (``observe_retention``), whether the gradients equal the
unchecked parallel run's (``torch.equal``), and the peak of the first step against the later ones' (the storage
tracker, above the weights and optimizer state). Rank 0 prints the table; ``--json`` writes it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ac_core import Full, Ops, apply_activation_checkpointing, observe_retention, plan_activation_checkpointing
from ac_core.collectives import is_collective
from ac_core.measure import OpCounter, PeakMemory
from ac_core.testing import TOY_ADAPTER, TOY_CONTEXT_PARALLEL, toy_case

KERNEL = "aten::_scaled_dot_product_flash_attention_for_cpu"
COLLECTIVES = (
    "_c10d_functional::all_to_all_single",
    "_c10d_functional::all_gather_into_tensor",
    "_c10d_functional::reduce_scatter_tensor",
)
MODES = ("ulysses", "ring")
POLICIES = ("none", "full", "ops", "plan")


def _say(line: str) -> None:
    # One write per line: under PYTHONUNBUFFERED print() writes the text and its newline apart.
    if dist.get_rank() == 0:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def _build(args: argparse.Namespace, mode: str) -> tuple[Any, dict[str, Any]]:
    torch.manual_seed(0)  # every rank and every policy starts from the same weights
    case = toy_case(dim=args.dim, heads=args.heads, depth=args.depth, tokens=args.tokens, batch=args.batch)
    inputs = dict(TOY_CONTEXT_PARALLEL.shard(case.inputs))
    TOY_CONTEXT_PARALLEL.enable(case.model, mode)
    return case, inputs


def _run(args: argparse.Namespace, mode: str, policy: str) -> dict[str, Any]:
    case, inputs = _build(args, mode)
    if policy == "plan":
        # Planned from shapes and ops alone, so every rank decides the same (a decision that differs deadlocks).
        # Priced on an H100's roofline and link, so a collective recompute costs its time, not its zero FLOPs.
        config: Any = plan_activation_checkpointing(
            case.model, inputs, args.budget, adapter=TOY_ADAPTER, device=args.gpu
        )
    else:
        config = {"full": Full(), "ops": Ops()}.get(policy)
    if config is not None:
        apply_activation_checkpointing(case.model, config, adapter=TOY_ADAPTER)
    model = case.model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps = []
    for _ in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        # The peak of forward and backward above the weights and optimizer state: what checkpointing changes
        # (the optimizer's own step allocates its state on the first step only).
        with PeakMemory("cpu", track=(model, optimizer)) as memory, OpCounter() as counter:
            with observe_retention() as log:
                loss = case.loss(model(**inputs))
            loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        steps.append(
            {
                "backward": {op: counter.count([op], "backward") for op in (KERNEL, *COLLECTIVES)},
                # observe_retention sees what ops retain by name, not a plan's kept occurrences.
                "collective_bytes": None
                if policy == "plan"
                else sum(out.nbytes for out in log.outputs if is_collective(out.op)),
                "peak": memory.bytes,
                "grads": grads,
            }
        )
    return {"policy": policy, "mode": mode, "steps": steps}


def _row(run: dict[str, Any], plain: dict[str, Any]) -> dict[str, Any]:
    first, later = run["steps"][0], run["steps"][1:]
    equal = all(
        torch.equal(g, ref)
        for step, base in zip(run["steps"], plain["steps"], strict=True)
        for g, ref in zip(step["grads"], base["grads"], strict=True)
    )
    reruns = {op: first["backward"][op] - plain["steps"][0]["backward"][op] for op in (KERNEL, *COLLECTIVES)}
    return {
        "mode": run["mode"],
        "policy": run["policy"],
        "attention_reruns": reruns[KERNEL],
        "collective_reruns": sum(reruns[op] for op in COLLECTIVES),
        "collective_bytes_kept": first["collective_bytes"],
        "grads_equal": equal,
        "first_peak": first["peak"],
        "later_peak": max((s["peak"] for s in later), default=None),
        "peaks": [s["peak"] for s in run["steps"]],
    }


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description="What each policy re-runs and keeps under context parallelism")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--budget", type=float, default=0.5, help="the plan's fraction of none's held bytes")
    parser.add_argument("--gpu", default="h100", help="the device the plan is priced on")
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step's peak is compared with the later ones'")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # ranks share a small machine
    _say(f"toy on {dist.get_world_size()} ranks: {args.depth} blocks, {args.tokens} tokens, {args.steps} steps each")
    rows = []
    for mode in MODES:
        plain = None
        for policy in POLICIES:
            _say(f"  {mode} {policy} ...")
            run = _run(args, mode, policy)
            plain = plain or run
            rows.append(_row(run, plain))
    header = (
        f"{'mode':8} {'policy':6} {'attention re-runs':>17} {'collective re-runs':>18} {'collective MiB kept':>19} "
        f"{'grads equal':>11} {'step 1 peak MiB':>15} {'later peak MiB':>14}"
    )
    _say(
        "\nre-runs: the first step's, in backward, beyond the unchecked parallel run's; peaks: forward and "
        f"backward, above the weights and optimizer state; plan: {args.budget:g} of none's held bytes, priced on "
        f"{args.gpu}"
    )
    _say(header)
    for r in rows:
        _say(
            f"{r['mode']:8} {r['policy']:6} {r['attention_reruns']:>17} {r['collective_reruns']:>18} "
            f"{_mib(r['collective_bytes_kept']):>19} {'yes' if r['grads_equal'] else 'NO':>11} "
            f"{_mib(r['first_peak']):>15} {_mib(r['later_peak']):>14}"
        )
    if args.json is not None and dist.get_rank() == 0:
        args.json.write_text(json.dumps({"rows": rows, "settings": vars(args) | {"json": str(args.json)}}, indent=1))
        _say(f"wrote {args.json}")
    dist.barrier()  # no rank tears the group down while another is still in a collective
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
