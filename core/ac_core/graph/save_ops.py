"""Which ops the graph pass saves, and matching graph nodes against op names or op objects."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..op_names import op_matches
from ..ops import DEFAULT_RETAINED_OPS

# Names, not op objects: an op a library registers late (varlen attention, a backend's custom
# kernel) can be listed before it exists, and importing ac_core resolves nothing. A name without
# an overload ("aten::max") covers every overload; a higher-order op goes by its bare name.
# Matrix multiplies are absent on purpose: they alternate whatever this set says (see
# alternate_matmuls.py). ``aten::_scaled_dot_product_attention_math`` is absent too: it is a
# composite that decomposes into bmm/softmax while the joint graph is traced, so no node ever
# carries it and listing it would protect nothing.
DEFAULT_SAC_SAVE_OPS: frozenset[str] = DEFAULT_RETAINED_OPS | {
    # Small outputs (a float8 amax is a scalar) that are costly to recompute relative to their size.
    "aten::max",
    # A forward reduce-scatter in a joint graph is a tensor/sequence-parallel activation, not an
    # FSDP weight gather: saving it keeps a collective out of backward. All-gathers stay
    # recomputable, so weights gathered inside the graph are not pinned until backward.
    "_c10d_functional::reduce_scatter_tensor",
    "flex_attention",
    "torch_attn::_varlen_attn",
    "inductor_compiled_code",
}
"""Op names whose outputs :func:`apply_sac_pass` saves by default: PyTorch's SDPA kernels (CPU's
included), flex and varlen attention, ``aten::max``, forward reduce-scatters and regions inductor
already compiled. Extend it with names or op objects: ``DEFAULT_SAC_SAVE_OPS | {"mylib::attn"}``."""


def op_name(target: object) -> str | None:
    """The dispatcher name of an op (``"aten::add.Tensor"``, ``"aten::mm"``) or a higher-order op's name."""
    if isinstance(target, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
        return target.name()
    return None


class OpSet:
    """A set of ops given as dispatcher names and/or op objects, matched against ``node.target``.

    A name matches an overload of that name, or every overload when it names none; an
    ``OpOverload`` or any other callable matches itself; an ``OpOverloadPacket`` every overload.
    """

    def __init__(self, ops: Iterable[object]) -> None:
        if isinstance(ops, (str, bytes)):
            raise TypeError(f"give a collection of ops, e.g. {{{ops!r}}}, not a single string")
        self.names: set[str] = set()
        self.targets: set[object] = set()
        self.packets: set[object] = set()
        for op in ops:
            if isinstance(op, str):
                if not op:
                    raise ValueError("an op name must be a non-empty string such as 'aten::mm'")
                self.names.add(op)
            elif isinstance(op, torch._ops.OpOverloadPacket):
                self.packets.add(op)
            elif callable(op):
                self.targets.add(op)
            else:
                raise TypeError(
                    f"ops are given as dispatcher names ('aten::mm') or op objects (torch.ops.aten.mm.default), "
                    f"got {op!r} of type {type(op).__name__}"
                )

    def __contains__(self, target: object) -> bool:
        try:
            if target in self.targets:
                return True
        except TypeError:  # an unhashable target is no op of ours
            return False
        if getattr(target, "overloadpacket", None) in self.packets:
            return True
        name = op_name(target)
        return name is not None and op_matches(name, self.names)
