"""Pass: keep the outputs of the collectives that move activations (Ulysses' all-to-alls), never a parameter's.

As eager ``ops`` does (see :mod:`ac_core.collectives`): a collective is told apart by what it moves, not by its name
alone. In the joint graph the parameters and buffers are the primal inputs AOTAutograd lists as static
(``static_lifetime_input_indices``, which it hands the partitioner); a value made from them alone (a weight shard's
view, its cast, its all-gather) is parameter data, and a collective of parameter data (FSDP's all-gather of a
shard) is never kept: its output would pin a gathered weight until backward. Without the static indices nothing is
kept by name. A kept collective's ``wait_tensor`` is kept with it: saved alone it would leave the collective to run
again in backward, never waited on.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from ..collectives import WAIT_TENSOR, is_keepable_collective
from ..op_names import op_matches
from .forward_part import forward_ops, is_backward_input
from .save_ops import op_name


def parameter_data(graph: fx.Graph, static: Collection[int]) -> set[fx.Node]:
    """The nodes whose values are made from parameters and buffers alone: the primal placeholders at ``static``
    and every op whose inputs are all such nodes."""
    primals = [node for node in graph.nodes if node.op == "placeholder" and not is_backward_input(node)]
    made = {primals[i] for i in static if 0 <= i < len(primals)}
    for node in graph.nodes:
        if node.op == "call_function" and node.all_input_nodes and all(n in made for n in node.all_input_nodes):
            made.add(node)
    return made


def save_activation_collectives(
    graph: fx.Graph, kept_names: Callable[[fx.Node], frozenset[str]], static: Collection[int] | None
) -> int:
    """Tag MUST_SAVE each forward collective named in ``kept_names(node)`` (the names kept where it ran: every
    block's, or its block decision's) that moves no parameter data, then the ``wait_tensor`` of every collective
    kept, by this pass or an earlier one (a plan's kept occurrence). ``static``: the primal indices of parameters
    and buffers (None: unknown, so no collective is kept by name). Returns the collectives this pass kept."""
    nodes = forward_ops(graph)
    made = parameter_data(graph, static) if static is not None else set()
    kept = 0
    for node in nodes:
        name = op_name(node.target)
        if name is None or not is_keepable_collective(name):
            continue
        if node.meta.get("recompute") != CheckpointPolicy.MUST_SAVE:
            if static is None or node in made or not op_matches(name, kept_names(node)):
                continue
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            kept += 1
        for user in node.users:
            if (op_name(user.target) or "").partition(".")[0] == WAIT_TENSOR:
                user.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    return kept
