"""``ac-core bench``: one training step per adapter x model class x policy, measured side by side."""

from __future__ import annotations

import argparse
import types
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median
from typing import Any

import torch
from torch import nn

from .._versions import version_supported
from ..checkpointing import apply_activation_checkpointing, checkpointed_blocks, remove_activation_checkpointing
from ..measure import StepMeasurement, compare_grads, measure_step, time_steps
from ..offload import OffloadConfig, apply_activation_offload
from ..ops import DEFAULT_RETAINED_OPS
from ..policy import CheckpointType
from ..spec import AdapterSpec, ModelCase, ModelSpec
from ._common import (
    TINY,
    CLIError,
    ac_core_logs_to,
    build_case,
    environment,
    missing_library,
    models_for,
    presets_of,
    select_adapters,
    split_names,
    stderr,
    stdout,
)

NONE, LIBRARY = "none", "library"
POLICIES = (NONE, *(t.value for t in CheckpointType), LIBRARY)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICES = ("cpu", "cuda")

# The model library's own checkpointing, duck-typed: the first (enable, disable) pair the model has.
LIBRARY_METHODS = (
    ("activation_checkpointing_enable", "activation_checkpointing_disable"),  # transformers >= 5
    ("gradient_checkpointing_enable", "gradient_checkpointing_disable"),  # transformers
    ("enable_gradient_checkpointing", "disable_gradient_checkpointing"),  # diffusers
)


class SkipRow(Exception):
    """A row that cannot run on this model, with the reason."""


@dataclass(frozen=True)
class Variant:
    """How one row's model is set up: the policy, and whether activations leave the device.

    ``offload`` is ac-core's activation offload (with ``policy == "none"`` it runs without checkpointing);
    ``save_on_cpu`` is the synchronous baseline: ``full`` with torch's ``save_on_cpu(pin_memory=True)``
    around the forward, as trainers that wrap it (FastVideo's seed) do.
    """

    policy: str
    n_layer: int = 1
    offload: OffloadConfig | None = None
    save_on_cpu: bool = False

    @property
    def label(self) -> str:
        base = f"{self.policy}(n={self.n_layer})" if self.policy == CheckpointType.BLOCK_SKIP.value else self.policy
        return base + ("+offload" if self.offload else "") + ("+save_on_cpu" if self.save_on_cpu else "")

    def setup(self, model: nn.Module, adapter: AdapterSpec) -> str:
        """Set ``model`` up for this row; returns what was done, in words. Raises SkipRow if it cannot."""
        if self.save_on_cpu:
            device = next(model.parameters()).device
            if device.type != "cuda":
                raise SkipRow(f"save_on_cpu(pin_memory=True) needs CUDA (the model is on {device.type})")
            apply_activation_checkpointing(model, self.policy, self.n_layer, adapter=adapter)
            model.__dict__[_SAVE_ON_CPU_ATTR] = model.__dict__.get("forward")
            model.__dict__["forward"] = types.MethodType(_forward_saving_on_cpu, model)
            return f"{len(checkpointed_blocks(model))} blocks checkpointed, forward under save_on_cpu"
        if self.policy == NONE:
            if self.offload is None:
                return "no checkpointing"
            apply_activation_offload(model, self.offload, adapter=adapter)
            return f"no checkpointing, offload from {self.offload.min_tokens} tokens"
        if self.policy == LIBRARY:
            for enable, disable in LIBRARY_METHODS:
                if callable(getattr(model, enable, None)) and callable(getattr(model, disable, None)):
                    try:
                        getattr(model, enable)()
                    except (ValueError, NotImplementedError) as exc:
                        raise SkipRow(f"{enable}() refused: {exc}") from None
                    return f"{enable}()"
            names = ", ".join(f"{enable}()" for enable, _ in LIBRARY_METHODS)
            raise SkipRow(f"{type(model).__name__} has no library checkpointing ({names})")
        apply_activation_checkpointing(model, self.policy, self.n_layer, adapter=adapter, offload=self.offload)
        offloaded = f", offload from {self.offload.min_tokens} tokens" if self.offload else ""
        return f"{len(checkpointed_blocks(model))} blocks checkpointed{offloaded}"

    def teardown(self, model: nn.Module) -> None:
        """Undo :meth:`setup`, leaving ``model`` plain for the next row."""
        if self.policy == LIBRARY:
            for enable, disable in LIBRARY_METHODS:
                if callable(getattr(model, enable, None)) and callable(getattr(model, disable, None)):
                    getattr(model, disable)()
                    return
        if _SAVE_ON_CPU_ATTR in model.__dict__:
            previous = model.__dict__.pop(_SAVE_ON_CPU_ATTR)
            if previous is None:
                model.__dict__.pop("forward", None)
            else:
                model.__dict__["forward"] = previous
        remove_activation_checkpointing(model)  # removes offload too


_SAVE_ON_CPU_ATTR = "_ac_core_bench_save_on_cpu"


def _forward_saving_on_cpu(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    previous = self.__dict__[_SAVE_ON_CPU_ATTR]
    with torch.autograd.graph.save_on_cpu(pin_memory=True):
        return previous(*args, **kwargs) if previous is not None else type(self).forward(self, *args, **kwargs)


@dataclass
class Row:
    """Every figure of one benchmark row; ``None`` where a figure does not apply (a skipped row)."""

    adapter: str
    model: str  # AdapterSpec.model_label: the class name, told apart where a class is declared twice
    policy: str | None
    label: str | None
    status: str  # "ok", "skipped" or "error"
    reason: str | None = None
    detail: str | None = None
    tokens: int | None = None
    loss: float | None = None
    activation_peak_bytes: int | None = None
    held_for_backward_bytes: int | None = None
    flops: int | None = None
    attention_flops: int | None = None
    recompute_overhead: float | None = None
    attention_forward_calls: int | None = None
    attention_recomputed: int | None = None
    step_time_s: float | None = None
    step_times_s: list[float] | None = None
    time_ratio: float | None = None
    grad_max_abs_diff: float | None = None
    grad_ok: bool | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


ROW_FIELDS = tuple(Row.__dataclass_fields__)


def variants(policies: Sequence[str], n_layer: int, offload: OffloadConfig | None = None) -> list[Variant]:
    """The rows to measure for each model, ``none`` first (the reference every other row is compared with).

    With ``offload``, each chosen policy but ``library`` gets a ``+offload`` row after it, and ``full``
    (when chosen) a synchronous ``+save_on_cpu`` row, the baseline offload is measured against.
    """
    chosen = [NONE, *(p for p in POLICIES if p in policies and p != NONE)]
    rows: list[Variant] = []
    for policy in chosen:
        n = n_layer if policy == CheckpointType.BLOCK_SKIP.value else 1
        rows.append(Variant(policy, n))
        if offload is not None and policy != LIBRARY:
            rows.append(Variant(policy, n, offload=offload))
        if offload is not None and policy == CheckpointType.FULL.value:
            rows.append(Variant(policy, n, save_on_cpu=True))
    return rows


def steps_per_model(args: argparse.Namespace, rows: int) -> int:
    """Forward+backward passes one model costs: warm-up once, then per row one measured step and the timed ones."""
    return args.warmup + rows * (1 + args.steps)


def _build(model: ModelSpec, args: argparse.Namespace) -> ModelCase:
    case = build_case(model, args.preset, layers=args.layers, seq=args.seq)
    dtype = DTYPES[args.dtype]
    current = next((p.dtype for p in case.model.parameters() if p.is_floating_point()), dtype)
    # Cast only when needed: diffusers warns on any dtype passed to .to().
    case.to(args.device, dtype if dtype != current else None)
    case.model.train()
    return case


def _fill(row: Row, measured: StepMeasurement, times: list[float], reference: tuple | None) -> None:
    row.loss = measured.loss
    row.activation_peak_bytes = measured.activation_peak_bytes
    row.held_for_backward_bytes = measured.held_for_backward_bytes
    row.flops = measured.flops
    row.attention_flops = measured.attention_flops
    row.attention_forward_calls = measured.attention_forward_calls
    row.attention_recomputed = measured.attention_recomputed
    row.step_times_s = times
    row.step_time_s = median(times)
    if reference is None:  # 'none' failed: nothing to compare with
        return
    ref_step, ref_time = reference
    row.recompute_overhead = measured.flops / ref_step.flops - 1 if ref_step.flops else None
    row.time_ratio = row.step_time_s / ref_time if ref_time else None
    check = compare_grads(measured.grads, ref_step.grads)
    row.grad_max_abs_diff, row.grad_ok = check.max_abs_diff, check.ok


def _case_rows(
    adapter: AdapterSpec,
    model: ModelSpec,
    rows_to_run: list[Variant],
    args: argparse.Namespace,
    advance: Callable[[int], None],
) -> list[Row]:
    """Build one model and measure every variant on it, 'none' first."""
    label = adapter.model_label(model)
    supported, installed = version_supported(model.versions)
    if not supported:
        advance(steps_per_model(args, len(rows_to_run)))
        reason = f"installed {installed or 'nothing'}, adapter declares {model.versions}: {adapter.install_hint}"
        return [Row(adapter.name, label, None, None, "skipped", reason)]
    try:
        case = _build(model, args)
        # Warm up once, plain, so that lazily built state (caches, allocator pools) is not counted as
        # activations; each row's timed steps then follow its measured step, which warms up its own path.
        if args.warmup:
            time_steps(case, args.warmup, on_step=lambda: advance(1))
    except Exception as exc:
        advance(steps_per_model(args, len(rows_to_run)))
        return [Row(adapter.name, label, None, None, "error", f"building the model failed: {exc!r}")]
    tokens = adapter.token_count(case.model, case.inputs) if adapter.token_count else None
    attention_ops = DEFAULT_RETAINED_OPS | adapter.retained_ops()
    rows: list[Row] = []
    reference = None
    for variant in rows_to_run:
        row = Row(adapter.name, label, variant.policy, variant.label, "ok", tokens=tokens)
        rows.append(row)
        done = 0

        def step_done() -> None:
            nonlocal done
            done += 1
            advance(1)

        try:
            row.detail = variant.setup(case.model, adapter)
            measured = measure_step(case, attention_ops, keep_grads=True)
            step_done()
            times = time_steps(case, args.steps, on_step=step_done)
        except SkipRow as exc:
            row.status, row.reason = "skipped", str(exc)
            continue
        except Exception as exc:
            row.status, row.reason = "error", repr(exc)
            continue
        finally:
            advance(1 + args.steps - done)
            variant.teardown(case.model)
        if variant.policy == NONE:
            reference = (measured, median(times))
        _fill(row, measured, times, reference)
    return rows


def _validate(args: argparse.Namespace) -> tuple[list[tuple[AdapterSpec, list[ModelSpec]]], list[str]]:
    adapters = select_adapters(args.adapter)
    policies: list[str] = []
    for name in split_names(args.policy):
        if name == "all":
            policies.extend(POLICIES)
        elif name in POLICIES:
            policies.append(name)
        else:
            raise CLIError(f"unknown policy {name!r}; valid values: all, {', '.join(POLICIES)}")
    if not policies:
        raise CLIError(f"--policy names no policy; valid values: all, {', '.join(POLICIES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise CLIError(f"--device cuda: CUDA is not available here (torch {torch.__version__}); valid values: cpu")
    if args.preset == TINY and (args.layers is not None or args.seq is not None):
        raise CLIError(
            "--layers and --seq size a real-width preset; the tiny preset has a fixed config. Choose a preset: "
            f"{', '.join(presets_of(adapters)[1:]) or 'none is offered by these adapters'}"
        )
    selected = [(adapter, models_for(adapter, args.preset)) for adapter in adapters]
    if args.adapter.strip() == "all":
        selected = [(adapter, models) for adapter, models in selected if models]
    lacking = [adapter for adapter, models in selected if not models]
    if lacking or not selected:
        names = ", ".join(adapter.name for adapter in lacking) or args.adapter
        raise CLIError(
            f"preset {args.preset!r} is not offered by adapter(s) {names}; "
            f"valid values: {', '.join(presets_of(lacking or adapters))}"
        )
    if args.plot is not None:
        if args.plot.suffix.lower() != ".png":
            raise CLIError(f"--plot writes a PNG; give a file name ending in .png, not {args.plot.name!r}")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise CLIError("--plot needs matplotlib: pip install 'ac-core[plot]'") from None
    for path in (args.json, args.plot):
        if path is not None and not path.parent.exists():
            raise CLIError(f"cannot write {path}: folder {path.parent} does not exist")
    return selected, policies


def _offload_config(args: argparse.Namespace) -> OffloadConfig | None:
    return None if args.offload is None else OffloadConfig(min_tokens=args.offload)


def run(args: argparse.Namespace) -> int:
    selected, policies = _validate(args)
    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, selected, policies)
    finally:
        torch.set_num_threads(threads)  # main() may be called in-process (tests, notebooks)


def _run(args: argparse.Namespace, selected: list[tuple[AdapterSpec, list[ModelSpec]]], policies: list[str]) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ._report import print_table, write_json, write_plot

    rows_to_run = variants(policies, args.n_layer, _offload_config(args))
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    total = sum(len(models) for _, models in selected) * steps_per_model(args, len(rows_to_run))
    rows: list[Row] = []
    err = stderr()
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    )
    with progress, ac_core_logs_to(err):
        task = progress.add_task("steps", total=total)
        for adapter, models in selected:
            missing = missing_library(adapter)
            for model in models:
                if missing:
                    progress.advance(task, steps_per_model(args, len(rows_to_run)))
                    rows.append(Row(adapter.name, adapter.model_label(model), None, None, "skipped", missing))
                    continue
                progress.update(task, description=f"{adapter.name} {adapter.model_label(model)}")
                rows.extend(_case_rows(adapter, model, rows_to_run, args, lambda n: progress.advance(task, n)))
    env = environment(
        device,
        dtype,
        preset=args.preset,
        seq=args.seq,
        layers=args.layers,
        steps=args.steps,
        warmup=args.warmup,
        n_layer=args.n_layer,
        offload_min_tokens=args.offload,
    )
    print_table(stdout(), rows, env)
    if args.json is not None:
        write_json(args.json, rows, env)
    if args.plot is not None:
        write_plot(args.plot, rows, env)
    failed = any(r.status == "error" or r.grad_ok is False for r in rows)
    return 1 if failed else 0


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def _non_negative(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {number}")
    return number


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="measure memory, FLOPs, recompute and step time of every policy",
        description=(
            "One training step (forward, loss, backward) per adapter x model class x policy, measured side by side: "
            "activation memory (peak beyond parameters and gradients; bytes held for backward), FLOPs and the "
            "recompute overhead over 'none', attention kernels re-run in backward, median step time and its ratio "
            "to 'none', and gradients checked against 'none' (always measured first, as the reference). "
            "Exits with 1 when a row fails or its gradients differ from 'none''s."
        ),
    )
    parser.add_argument("--adapter", default="all", help="adapter name(s), comma-separated, or 'all' (default)")
    parser.add_argument(
        "--policy", default="all", help=f"policies, comma-separated, or 'all' (default): {', '.join(POLICIES)}"
    )
    parser.add_argument("--n-layer", type=_positive, default=2, help="block_skip checkpoints every n-th block (2)")
    parser.add_argument("--preset", default=TINY, help="'tiny' (default) or a real-width preset, e.g. wan2.1-1.3b")
    parser.add_argument("--seq", type=_positive, default=None, help="main-stream tokens of a preset (its default)")
    parser.add_argument("--layers", type=_positive, default=None, help="blocks per container of a preset (4)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--device", choices=DEVICES, default="cpu")
    parser.add_argument("--steps", type=_positive, default=3, help="timed steps per row; the median is reported (3)")
    parser.add_argument(
        "--warmup", type=_non_negative, default=1, help="untimed steps per model before its first row (1)"
    )
    parser.add_argument(
        "--offload",
        type=_positive,
        default=None,
        metavar="MIN_TOKENS",
        help="also measure each policy with activation offload from MIN_TOKENS tokens, and full with torch's "
        "synchronous save_on_cpu (CUDA only)",
    )
    parser.add_argument("--threads", type=_positive, default=None, help="CPU threads for torch (its default)")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="write every figure as JSON")
    parser.add_argument("--plot", type=Path, default=None, metavar="FILE.png", help="plot memory against recompute")
    parser.set_defaults(run=run, command_name=parser.prog.split()[-1])
