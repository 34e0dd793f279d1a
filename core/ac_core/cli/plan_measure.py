"""``ac-core plan --measure``: the plan applied to the preset built again on real tensors, one whole training
step (forward, loss, backward, the step budget's optimizer) run under :class:`~ac_core.measure.PeakMemory`, and
its measured peak set beside the predicted total.

The optimizer's state and the gradients are made before the measured step (gradients zeroed in place, as a
training loop after its first step holds them), so the measured peak is that of a step in the steady state: the
model states, the inputs, and everything the step makes.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch

from ..budget import CheckpointPlan
from ..budget.predict import StepPeak, without_kv_cache
from ..checkpointing import apply_activation_checkpointing
from ..measure import PeakMemory
from ..spec import AdapterSpec, ModelCase
from ..units import human_bytes
from ._common import CLIError

# The optimizers a measured step runs, by the step budget's name (8-bit Adam needs bitsandbytes and a GPU).
_OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum", "none")


def check_measure(args: argparse.Namespace) -> None:
    """CLIError naming the fix where ``--measure`` cannot measure what was asked."""
    if not args.measure:
        return
    if args.budget is not None or (args.memory is None and args.gpu is None):
        raise CLIError("--measure measures a step budget's plan: give --memory (or --gpu), not --budget")
    if args.device == "meta":
        raise CLIError(
            "--measure runs a real step: plan on real tensors with --device cpu (or cuda); meta allocates nothing"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda: no CUDA device here; measure with --device cpu")
    if (args.fsdp or 1) > 1:
        raise CLIError(
            f"--measure with --fsdp {args.fsdp}: one process cannot measure a sharded step; measure with --fsdp 1 "
            "(or leave it out), or measure the sharded step with ac-core train-fsdp2 on the GPUs"
        )
    if args.cp > 1:
        raise CLIError(
            f"--measure with --cp {args.cp}: one process cannot run a context-parallel step; measure with --cp 1, or "
            "run the ranks (examples/context_parallel_report.py measures each rank's peak)"
        )
    if (args.optimizer or "adamw") not in _OPTIMIZERS:
        raise CLIError(f"--measure with --optimizer {args.optimizer}: measure with one of {', '.join(_OPTIMIZERS)}")


@dataclass(frozen=True)
class MeasuredStep:
    """One whole step's measured peak (``peak``: states and inputs included) beside the plan's predicted
    ``total`` (its margin included) and ``memory``, the step budget."""

    peak: int
    base: int
    predicted: int
    total: int
    memory: int

    @property
    def ratio(self) -> float:
        """Measured over predicted peak (the margin left out: it is kept free, not used)."""
        return self.peak / self.predicted

    @property
    def within(self) -> bool:
        return self.peak <= self.memory

    def __str__(self) -> str:
        verdict = "within" if self.within else "ABOVE"
        return (
            f"measured step peak {human_bytes(self.peak, digits=2)} against {human_bytes(self.predicted, digits=2)} "
            f"predicted (ratio {self.ratio:.3f}; {human_bytes(self.total, digits=2)} with the margin): "
            f"{verdict} the {human_bytes(self.memory, digits=2)} budget"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak_bytes": self.peak,
            "base_bytes": self.base,
            "predicted_peak_bytes": self.predicted,
            "predicted_total_bytes": self.total,
            "memory_bytes": self.memory,
            "ratio": self.ratio,
            "within_budget": self.within,
        }


def _optimizer(name: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer | None:
    if name == "none":
        return None
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-4)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-4)
    return torch.optim.SGD(params, lr=1e-4, momentum=0.9 if name == "sgd-momentum" else 0.0)


def measure_step(
    case: ModelCase, adapter: AdapterSpec, plan: CheckpointPlan, predicted: StepPeak, optimizer: str, device: str
) -> MeasuredStep:
    """``plan`` applied to ``case`` (built again, not the one planned on), one whole step measured."""
    model = case.model
    apply_activation_checkpointing(model, plan, adapter=adapter)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    step = _optimizer(optimizer, params)
    if step is not None:
        step.step()  # its state made before the measured step, as after a first one
        step.zero_grad(set_to_none=False)
    grads = [p.grad for p in params]
    tracked = [model, grads, [v for v in case.inputs.values() if isinstance(v, torch.Tensor)]]
    if step is not None:
        tracked.append(step)
    peak = PeakMemory(device, track=tuple(tracked))
    with without_kv_cache(model), peak:
        loss = case.run()
        loss.backward()
        del loss
        if step is not None:
            step.step()
    total = peak.base_bytes + peak.bytes
    return MeasuredStep(total, peak.base_bytes, predicted.peak, predicted.total, predicted.memory)


__all__ = ["MeasuredStep", "check_measure", "measure_step"]
