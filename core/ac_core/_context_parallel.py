"""Context-parallel attention for tests: Ulysses and ring, on functional collectives as the libraries call them.

Each rank holds one contiguous chunk of the sequence (rank r the r-th): q, k and v are ``[batch, heads,
tokens / world, head_dim]``. Ulysses trades the sequence split for a head split with one all-to-all each of q, k
and v, attends over the whole sequence with its share of the heads, and trades back with a fourth (diffusers'
``ulysses_degree``, xDiT and FastVideo do the same). The ring exchanges keys and values: one all-gather of them
(torch's ``context_parallel`` rotates by all-gather by default), then the local queries attend to each rank's
chunk in turn with the CPU flash kernel, and the chunks' outputs are merged by their log-sum-exps. Its backward
runs the kernel's backward per chunk against the merged output and log-sum-exp, which gives each chunk's exact
gradients, and reduce-scatters the keys' and values' gradients back to the ranks that own them.

Both are ``torch.autograd.Function``s whose forward calls ``_c10d_functional`` ops and waits on them, as
diffusers' templated attention does, so a checkpoint's recompute runs (or, kept, skips) the same collectives.
"""

from __future__ import annotations

from typing import Any

import torch

_CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_CPU_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _group(group: Any) -> Any:
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(
            "context-parallel attention needs a process group: call torch.distributed.init_process_group first "
            "(e.g. 'gloo' on CPU), or run the model with plain attention"
        )
    return group if group is not None else dist.group.WORLD


def _world(group: Any) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group)


def _waited(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return tensor.wait() if isinstance(tensor, AsyncCollectiveTensor) else tensor


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    from torch.distributed import _functional_collectives as funcol

    return _waited(funcol.all_to_all_single(x.contiguous(), None, None, group))


def _heads_to_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``[b, h, n / w, d]`` (this rank's tokens, every head) to ``[b, h / w, n, d]`` (every token, its heads)."""
    world = _world(group)
    b, h, n, d = x.shape
    if h % world:
        raise ValueError(f"Ulysses splits the heads over the ranks: {h} heads do not divide over {world} ranks")
    sent = x.reshape(b, world, h // world, n, d).transpose(0, 1)  # [w: head group, b, h / w, n / w, d]
    got = _all_to_all(sent, group)  # [w: sequence chunk, b, h / w, n / w, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // world, world * n, d)


def _sequence_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The inverse of :func:`_heads_to_sequence`."""
    world = _world(group)
    b, h, n, d = x.shape
    sent = x.reshape(b, h, world, n // world, d).permute(2, 0, 1, 3, 4)  # [w: sequence chunk, b, h, n / w, d]
    got = _all_to_all(sent, group)  # [w: head group, b, h, n / w, d]
    return got.transpose(0, 1).reshape(b, h * world, n // world, d)


class _Reshard(torch.autograd.Function):
    """Ulysses' all-to-all, heads to sequence (``to_sequence``) or back; its backward is the other direction."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, to_sequence: bool) -> torch.Tensor:
        ctx.group, ctx.to_sequence = group, to_sequence
        return (_heads_to_sequence if to_sequence else _sequence_to_heads)(x, group)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        back = _sequence_to_heads if ctx.to_sequence else _heads_to_sequence
        return back(grads[0], ctx.group), None, None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Attention over the whole sequence from this rank's chunk of it: ``[batch, heads, tokens / world, head_dim]``
    in and out, heads a multiple of the world size. Four ``_c10d_functional::all_to_all_single`` per call in
    forward (q, k, v and the output), four in backward; the kernel is torch's SDPA. ``group``: the process
    group (None: the default one)."""
    group = _group(group)
    q, k, v = (_Reshard.apply(t, group, True) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return _Reshard.apply(out, group, False)


def _gather(x: torch.Tensor, group: Any) -> torch.Tensor:
    # The op itself: funcol's wrapper of it changed names across torch versions (all_gather_tensor, then _single).
    gathered = torch.ops._c10d_functional.all_gather_into_tensor(
        x.unsqueeze(0).contiguous(), _world(group), group.group_name
    )
    return torch.ops._c10d_functional.wait_tensor(gathered)


def _reduce_scatter(x: torch.Tensor, group: Any) -> torch.Tensor:
    scattered = torch.ops._c10d_functional.reduce_scatter_tensor(x.contiguous(), "sum", _world(group), group.group_name)
    return torch.ops._c10d_functional.wait_tensor(scattered).squeeze(0)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any) -> torch.Tensor:
        kv = _gather(torch.stack((k, v)), group)  # [w: sequence chunk, 2, b, h, n / w, d]
        outs, lses = zip(*(_CPU_FLASH(q, kv[i, 0], kv[i, 1]) for i in range(kv.shape[0])), strict=True)
        lse = torch.logsumexp(torch.stack(lses), dim=0)
        out = sum(o * (part - lse).exp().unsqueeze(-1) for o, part in zip(outs, lses, strict=True))
        assert isinstance(out, torch.Tensor)
        ctx.group = group
        ctx.save_for_backward(q, kv, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        grad = grads[0]
        q, kv, out, lse = ctx.saved_tensors
        dq = torch.zeros_like(q)
        dkv = torch.empty_like(kv)
        for i in range(kv.shape[0]):
            dq_i, dk, dv = _CPU_FLASH_BACKWARD(grad.contiguous(), q, kv[i, 0], kv[i, 1], out, lse, 0.0, False)
            dq += dq_i
            dkv[i, 0], dkv[i, 1] = dk, dv
        dk, dv = _reduce_scatter(dkv, ctx.group)
        return dq, dk, dv, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Attention over the whole sequence from this rank's chunk of it, as :func:`ulysses_attention` takes it, by
    exchanging keys and values: one ``_c10d_functional::all_gather_into_tensor`` of them per call in forward, one
    ``reduce_scatter_tensor`` of their gradients in backward; per chunk the CPU flash kernel
    (``aten::_scaled_dot_product_flash_attention_for_cpu``), so it runs on the CPU."""
    if q.device.type not in ("cpu", "meta"):  # meta: shapes only, as a plan on a stand-in process group runs it
        raise ValueError(f"ring_attention runs torch's CPU flash kernel; got tensors on {q.device}")
    return _RingAttention.apply(q, k, v, _group(group))


def shard_sequence(x: torch.Tensor, dim: int = 1, group: Any = None) -> torch.Tensor:
    """This rank's contiguous chunk of ``x`` along ``dim`` (rank r the r-th of world-size equal chunks)."""
    import torch.distributed as dist

    group = _group(group)
    world, rank = _world(group), dist.get_rank(group)
    if x.shape[dim] % world:
        raise ValueError(f"{x.shape[dim]} tokens along dim {dim} do not split evenly over {world} ranks")
    return x.chunk(world, dim)[rank].clone()


__all__ = ["ring_attention", "shard_sequence", "ulysses_attention"]
