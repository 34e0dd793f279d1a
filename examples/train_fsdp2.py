"""A few optimizer steps of an adapter's tiny model under FSDP2, with activation checkpointing by policy.

    torchrun --nproc-per-node 2 examples/train_fsdp2.py --adapter toy --policy ops --steps 3

runs on CPUs (gloo) or, where CUDA is present, one GPU per rank (nccl), unchanged. Run with plain
``python`` it trains in one process without FSDP: the reference the sharded run must match. Each
block the adapter declares is sharded on its own (``fully_shard``), then the root. Every rank trains
on the same batch here, so the losses equal the single process's; a real job gives each rank its
own shard of the data. Each rank prints its loss per step and its peak memory.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

from ac_core import (
    AdapterSpec,
    ModelCase,
    OffloadConfig,
    apply_activation_checkpointing,
    apply_activation_offload,
    checkpointed_blocks,
    get_adapter,
    model_blocks,
    register_adapter,
    registered_adapters,
)
from ac_core.measure import PeakMemory

POLICIES = ("none", "full", "ops", "block_skip")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter", default="toy", help="a registered adapter, or 'toy' (ac_core.testing)")
    parser.add_argument("--model", default=None, help="model class name (default: the adapter's first with a tiny)")
    parser.add_argument("--policy", choices=POLICIES, default="ops")
    parser.add_argument("--n-layer", type=int, default=2, help="block_skip: checkpoint every n-th block")
    parser.add_argument(
        "--offload",
        type=int,
        default=0,
        metavar="MIN_TOKENS",
        help="offload activations of forwards with at least MIN_TOKENS tokens to pinned host memory (0: off; "
        "CUDA only, a no-op on CPU)",
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    return parser.parse_args()


def load_adapter(name: str) -> AdapterSpec:
    if name == "toy" and "toy" not in registered_adapters():
        from ac_core.testing import TOY_ADAPTER

        register_adapter(TOY_ADAPTER)
    return get_adapter(name)


def build(adapter: AdapterSpec, model_class: str | None) -> ModelCase:
    tiny = [m for m in adapter.models if m.tiny is not None and model_class in (None, m.class_name)]
    if not tiny:
        served = ", ".join(m.class_name for m in adapter.models if m.tiny is not None)
        raise SystemExit(f"adapter {adapter.name!r} has no tiny model {model_class!r}; it has: {served}")
    torch.manual_seed(0)  # the same weights and batch on every rank
    return tiny[0].build_tiny()


def shard(model: nn.Module, adapter: AdapterSpec, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for _, block in model_blocks(model, adapter=adapter):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def main() -> None:
    args = parse_args()
    distributed = "RANK" in os.environ  # set by torchrun
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    rank, world = 0, 1
    mesh = None
    if distributed:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        local_rank = int(os.environ["LOCAL_RANK"])
        if use_cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if use_cuda else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        mesh = init_device_mesh("cuda" if use_cuda else "cpu", (world,))
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")

    adapter = load_adapter(args.adapter)
    case = build(adapter, args.model).to(device)
    model = case.model.train()
    name = type(model).__name__  # fully_shard renames the class (FSDP<name>)
    offload = OffloadConfig(min_tokens=args.offload) if args.offload else None
    if args.policy != "none":
        n_layer = args.n_layer if args.policy == "block_skip" else 1
        apply_activation_checkpointing(model, args.policy, n_layer, adapter=adapter, offload=offload)
    elif offload is not None:
        apply_activation_offload(model, offload, adapter=adapter)
    if distributed:
        shard(model, adapter, mesh)
    if rank == 0:
        print(
            f"{name} ({adapter.name}): policy {args.policy}, {len(checkpointed_blocks(model))} blocks "
            f"checkpointed, {'FSDP2 on ' + str(world) + ' ranks' if distributed else 'one process, no FSDP'}, {device}",
            flush=True,
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    peak = 0
    for step in range(1, args.steps + 1):
        optimizer.zero_grad()
        with PeakMemory(device, track=(model, optimizer)) as memory:
            loss = case.run()
            loss.backward()
            optimizer.step()
        peak = max(peak, memory.base_bytes + memory.bytes)
        # One write per line: ranks share the terminal, and print() writes the text and its newline apart,
        # so under PYTHONUNBUFFERED two ranks' lines run together.
        sys.stdout.write(f"rank {rank} step {step} loss {loss.item():.9f} peak {peak / 2**20:.2f} MiB\n")
        sys.stdout.flush()
    if distributed:
        torch.distributed.barrier()  # no rank tears the group down while another is still in a collective
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
