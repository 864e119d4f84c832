"""Know before you run whether a training step fits: real training steps on fake tensors, measured by MemTrace.

:func:`estimate` copies a module onto fake tensors (``FakeTensorMode``: shapes, dtypes and devices, no data, no real
memory), builds its optimizer on the fake parameters and runs a few training steps in Lightning's order::

    batch_start -> forward -> zero_grad (set_to_none) -> backward -> optimizer step -> batch_end

with the same :class:`~lightning_memtrace.capture.recorder.MemoryRecorder` and
:class:`~lightning_memtrace.capture.tracker.AllocationTracker` that the :class:`~lightning_memtrace.MemTrace` callback uses on a
real run. So the estimate is a measurement of the real code path (the model's own forward, autograd's saved tensors,
the optimizer's own update), not a formula, and its rows have the same phases, categories and ``peak_bytes``
semantics as the callback's CSV.

Beside the measured figures, :class:`ClosedForm` holds the textbook ones (N·P parameters, N·P gradients, 2·N·P for
Adam/AdamW, N·P for SGD with momentum).

Fake tensors keep no storage of their own: the tracker counts them on the ``meta`` device (their storages' device),
while the recorder's category counter matches their fake device. Where the target is CUDA and this machine has no CUDA,
the steps run on fake CPU tensors with CUDA's defaults emulated (foreach optimizers, ``step`` tensors on the host, not
counted); autocast then uses CPU's op lists (see :func:`estimate`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_memtrace.atomic import atomic_write_text
from lightning_memtrace.capture.categories import CategoryCounter, StorageMap
from lightning_memtrace.capture.config import RecorderConfig
from lightning_memtrace.capture.recorder import MemoryRecorder, RecorderParts
from lightning_memtrace.capture.storages import unique_storages
from lightning_memtrace.capture.tracker import AllocationTracker
from lightning_memtrace.types import MEASURED_CATEGORIES, Category, Phase, PhaseRecord
from lightning_memtrace.units import format_bytes

__all__ = [
    "ClosedForm",
    "Estimate",
    "InputSpec",
    "MaxBatchResult",
    "OptimizerName",
    "Precision",
    "build_meta_model",
    "closed_form",
    "compare_estimate",
    "compare_phase_peaks",
    "comparison_path",
    "comparison_text",
    "estimate",
    "estimate_for_module",
    "estimate_from_config",
    "find_max_batch",
    "lm_batch",
    "write_comparison_csv",
]

#: The phases of a training batch, in order (the rows the callback takes).
TRAIN_PHASES = (
    Phase.BATCH_START,
    Phase.AFTER_FORWARD,
    Phase.AFTER_BACKWARD,
    Phase.AFTER_OPTIMIZER_STEP,
    Phase.BATCH_END,
)
#: Keys of a batch dict whose tensors are token ids (int64) when a batch is given as shapes.
TOKEN_KEYS = frozenset({"input_ids", "labels", "attention_mask", "position_ids", "token_type_ids"})
#: Name of the comparison CSV written beside the phases CSV.
COMPARISON_FILENAME = "estimate_vs_measured_rank{rank}.csv"
_ADAM_LIKE = ("Adam", "AdamW", "NAdam", "RAdam", "Adamax")


class Precision(str, Enum):
    """Lightning's precision settings that the estimate knows."""

    FP32 = "32-true"
    FP16_MIXED = "16-mixed"
    BF16_MIXED = "bf16-mixed"
    BF16_TRUE = "bf16-true"
    FP16_TRUE = "16-true"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: str | int | Precision) -> Precision:
        """Accept Lightning's spellings: ``32``, ``"32"``, ``"32-true"``, ``"bf16"``, ``"16"``..."""
        if isinstance(value, Precision):
            return value
        text = str(value).strip().lower()
        aliases = {
            "32": cls.FP32,
            "32-true": cls.FP32,
            "fp32": cls.FP32,
            "16": cls.FP16_MIXED,
            "16-mixed": cls.FP16_MIXED,
            "bf16": cls.BF16_MIXED,
            "bf16-mixed": cls.BF16_MIXED,
            "bf16-true": cls.BF16_TRUE,
            "16-true": cls.FP16_TRUE,
        }
        if text not in aliases:
            raise ValueError(f"unknown precision {value!r}; use one of {', '.join(p.value for p in cls)}")
        return aliases[text]

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return {Precision.FP16_MIXED: torch.float16, Precision.BF16_MIXED: torch.bfloat16}.get(self)

    @property
    def param_dtype(self) -> torch.dtype | None:
        return {Precision.BF16_TRUE: torch.bfloat16, Precision.FP16_TRUE: torch.float16}.get(self)


class OptimizerName(str, Enum):
    """Optimizers the config-based estimate (and the CLI) can build."""

    ADAMW = "adamw"
    ADAM = "adam"
    SGD = "sgd"

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """A batch tensor given by shape and dtype only (nothing is allocated)."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32


def lm_batch(batch_size: int, seq_len: int) -> dict[str, InputSpec]:
    """The batch of a causal LM as shapes: ``{"input_ids": (batch_size, seq_len) int64}``."""
    return {"input_ids": InputSpec((int(batch_size), int(seq_len)), torch.int64)}


@dataclasses.dataclass(frozen=True)
class ClosedForm:
    """The textbook figures: N·P parameters and gradients, optimizer state from the optimizer's kind.

    Attributes:
        parameter_count: N, distinct parameters (tied weights once).
        trainable_count: Parameters that require gradients.
        parameter_tensors: Distinct parameter tensors (one Adam ``step`` scalar each).
        parameters_bytes: N·P.
        gradients_bytes: Trainable N·P (gradients have the parameters' dtype).
        optimizer_state_bytes: 2·N·P for Adam-like optimizers, N·P for SGD with momentum, 0 for plain SGD,
            None for an optimizer the formula does not know. Without the ``step`` scalars.
        step_tensor_bytes: The ``step`` scalars that sit on the measured device (CPU runs), else 0.
    """

    parameter_count: int
    trainable_count: int
    parameter_tensors: int
    parameters_bytes: int
    gradients_bytes: int
    optimizer_state_bytes: int | None
    step_tensor_bytes: int

    @property
    def optimizer_state_with_steps_bytes(self) -> int | None:
        if self.optimizer_state_bytes is None:
            return None
        return self.optimizer_state_bytes + self.step_tensor_bytes

    def as_dict(self) -> dict[str, int | None]:
        return dataclasses.asdict(self)


def closed_form(model: nn.Module, optimizer: Any = None, steps_on_device: bool = False) -> ClosedForm:
    """Closed-form figures for a model (real, meta or fake tensors) and its optimizer.

    Args:
        model: The module; tied parameters count once.
        optimizer: A ``torch.optim.Optimizer`` (its class and ``momentum`` decide the state), an
            :class:`OptimizerName`, or None (no optimizer state).
        steps_on_device: Whether Adam's ``step`` scalars live on the measured device (true on CPU runs).
    """
    storages: dict[int, tuple[Tensor, bool]] = {}
    for param in model.parameters():
        key = param.untyped_storage()._cdata
        if key not in storages:
            storages[key] = (param, param.requires_grad)
    count = sum(p.numel() for p, _ in storages.values())
    trainable = sum(p.numel() for p, grad in storages.values() if grad)
    param_bytes = sum(p.numel() * p.element_size() for p, _ in storages.values())
    grad_bytes = sum(p.numel() * p.element_size() for p, grad in storages.values() if grad)
    trainable_tensors = sum(1 for _, grad in storages.values() if grad)
    state: int | None
    steps = 0
    kind = _optimizer_kind(optimizer)
    if kind == "adam":
        state = 2 * grad_bytes
        steps = 4 * trainable_tensors if steps_on_device else 0
    elif kind == "sgd_momentum":
        state = grad_bytes
    elif kind in ("sgd", "none"):
        state = 0
    else:
        state = None
    return ClosedForm(count, trainable, len(storages), param_bytes, grad_bytes, state, steps)


def _optimizer_kind(optimizer: Any) -> str:
    if optimizer is None:
        return "none"
    if isinstance(optimizer, (str, OptimizerName)):
        name = OptimizerName(str(optimizer).lower())
        return "sgd" if name is OptimizerName.SGD else "adam"
    name = type(optimizer).__name__
    if name in _ADAM_LIKE:
        return "adam"
    if name == "SGD":
        groups = getattr(optimizer, "param_groups", [])
        return "sgd_momentum" if any(g.get("momentum", 0) for g in groups) else "sgd"
    return "unknown"


@dataclasses.dataclass(frozen=True)
class Estimate:
    """What a training step takes, measured on fake tensors: the callback's rows plus closed-form figures.

    Attributes:
        records: One :class:`PhaseRecord` per phase of every estimated batch, as MemTrace writes them on a real run
            (``peak_bytes`` is the highest allocation since the previous row).
        closed_form: The textbook figures beside the measured ones.
        device: The device the estimate is for (``cpu`` or ``cuda``).
        precision: Lightning's precision setting.
        optimizer: The optimizer's class name.
        batch_size: Micro-batch size (first dimension of the first batch tensor), if known.
        seq_len: Sequence length (second dimension of token ids), if known.
        accumulate_grad_batches: Batches per optimizer step.
        gradient_checkpointing: Whether activation checkpointing was on.
        seconds: Wall time the estimate took.
    """

    records: tuple[PhaseRecord, ...]
    closed_form: ClosedForm
    device: str
    precision: str
    optimizer: str
    batch_size: int | None = None
    seq_len: int | None = None
    accumulate_grad_batches: int = 1
    gradient_checkpointing: bool = False
    seconds: float = 0.0

    @property
    def peak_bytes(self) -> int:
        """The highest allocation of the whole estimated run."""
        return max((r.peak_bytes for r in self.records), default=0)

    @property
    def peak_record(self) -> PhaseRecord | None:
        """The row whose ``peak_bytes`` is highest (the phase that ends the stretch where the peak falls)."""
        return max(self.records, key=lambda r: r.peak_bytes, default=None)

    @property
    def steady_step(self) -> int:
        """The last estimated step: gradients of the previous step and optimizer state are alive (steady state)."""
        return max((r.step for r in self.records), default=0)

    def phase_peaks(self) -> dict[Phase, int]:
        """Per phase, the highest ``peak_bytes`` over the estimated steps."""
        out: dict[Phase, int] = {}
        for record in self.records:
            out[record.phase] = max(out.get(record.phase, 0), record.peak_bytes)
        return out

    def category_bytes(self, phase: Phase | str | None = None) -> dict[Category, int]:
        """Per category, the most bytes seen (at one phase, or over all phases)."""
        wanted = Phase(phase) if phase is not None else None
        out = {category: 0 for category in Category}
        for record in self.records:
            if wanted is not None and record.phase != wanted:
                continue
            for category, value in record.category_bytes().items():
                out[category] = max(out[category], value)
        return out

    def fits(self, device_memory: int) -> bool:
        """Whether the peak fits in ``device_memory`` bytes (allocated bytes: leave room for the CUDA context)."""
        return self.peak_bytes <= int(device_memory)

    def to_dataframe(self) -> Any:
        """The rows as a pandas DataFrame with the columns of the phases CSV."""
        import pandas as pd

        return pd.DataFrame([r.as_dict() for r in self.records], columns=PhaseRecord.columns())

    def as_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "precision": self.precision,
            "optimizer": self.optimizer,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "accumulate_grad_batches": self.accumulate_grad_batches,
            "gradient_checkpointing": self.gradient_checkpointing,
            "peak_bytes": self.peak_bytes,
            "phase_peaks": {p.value: v for p, v in self.phase_peaks().items()},
            "categories": {c.value: v for c, v in self.category_bytes().items()},
            "closed_form": self.closed_form.as_dict(),
            "seconds": self.seconds,
        }

    def table(self) -> str:
        """Plain text: per phase of the steady step, peak, allocated and categories; then closed-form figures."""
        step = self.steady_step
        rows = [r for r in self.records if r.step == step]
        cats = [c for c in Category]
        header = ["phase", "peak", "allocated", *[c.value for c in cats]]
        lines = [header]
        for r in rows:
            values = r.category_bytes()
            lines.append(
                [
                    r.phase.value,
                    format_bytes(r.peak_bytes),
                    format_bytes(r.allocated_bytes),
                    *[format_bytes(values[c]) for c in cats],
                ]
            )
        widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
        out = [f"estimate (step {step}, steady state): {self.describe()}"]
        for index, row in enumerate(lines):
            out.append(
                "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
            )
            if index == 0:
                out.append("  ".join("-" * w for w in widths))
        measured = self.category_bytes()
        cf = self.closed_form
        out.append("")
        out.append(f"{'':22}{'measured':>24}{'closed form':>24}")
        formula = [
            ("parameters", measured[Category.PARAMETERS], cf.parameters_bytes),
            ("gradients", measured[Category.GRADIENTS], cf.gradients_bytes),
            ("optimizer_state", measured[Category.OPTIMIZER_STATE], cf.optimizer_state_with_steps_bytes),
        ]
        for name, value, expected in formula:
            shown = f"{expected:,} B" if expected is not None else "n/a"
            out.append(f"{name:22}{value:>22,} B{shown:>24}")
        record = self.peak_record
        where = f" (in the stretch ending at {record.phase.value}, step {record.step})" if record is not None else ""
        out.append(f"peak: {format_bytes(self.peak_bytes)} ({self.peak_bytes:,} B){where}")
        return "\n".join(out)

    def describe(self) -> str:
        parts = [self.device, self.precision, self.optimizer]
        if self.batch_size is not None:
            parts.append(f"batch {self.batch_size}" + (f" x {self.seq_len} tokens" if self.seq_len else ""))
        if self.accumulate_grad_batches > 1:
            parts.append(f"accumulate {self.accumulate_grad_batches}")
        if self.gradient_checkpointing:
            parts.append("gradient checkpointing")
        return ", ".join(parts)


# ------------------------------------------------------------------------------------------------ fake tensors
def _fake_mode() -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=False)


def _fake_tensor(tensor: Tensor, mode: Any, device: torch.device, dtype: torch.dtype | None = None) -> Tensor:
    with mode:
        return torch.empty_strided(
            tuple(tensor.shape), tuple(tensor.stride()), dtype=dtype or tensor.dtype, device=device
        )


def _fake_copy(
    module: nn.Module, mode: Any, device: torch.device, param_dtype: torch.dtype | None, in_place: bool
) -> nn.Module:
    """The module with every parameter and buffer replaced by a fake tensor (tied tensors stay tied)."""
    memo: dict[int, Any] = {}

    def cast(t: Tensor) -> torch.dtype | None:
        return param_dtype if param_dtype is not None and t.is_floating_point() else None

    for param in module.parameters():
        if id(param) not in memo:
            memo[id(param)] = nn.Parameter(
                _fake_tensor(param, mode, device, cast(param)), requires_grad=param.requires_grad
            )
    for buffer in module.buffers():
        if id(buffer) not in memo:
            memo[id(buffer)] = _fake_tensor(buffer, mode, device, cast(buffer))
    if in_place:
        for sub in module.modules():
            for name, value in list(sub._parameters.items()):
                if value is not None:
                    sub._parameters[name] = memo[id(value)]
            for name, value in list(sub._buffers.items()):
                if value is not None:
                    sub._buffers[name] = memo[id(value)]
        return module
    trainer = getattr(module, "_trainer", None)
    if trainer is not None:
        memo[id(trainer)] = None
    for sub in module.modules():
        for name in ("_fabric", "_trainer"):
            value = sub.__dict__.get(name)
            if value is not None:
                memo[id(value)] = None
        for param in list(sub._parameters.values()):
            if param is not None and param.grad is not None:
                memo[id(param.grad)] = None
    try:
        return copy.deepcopy(module, memo)
    except Exception as error:
        raise ValueError(
            f"cannot copy {type(module).__name__} onto fake tensors: {type(error).__name__}: {error}"
        ) from error


def _fake_batch(batch: Any, mode: Any, device: torch.device, float_dtype: torch.dtype | None) -> Any:
    """The batch with each tensor (real, meta or fake) or :class:`InputSpec` replaced by a fake tensor on ``device``."""

    def one(leaf: Tensor | InputSpec) -> Tensor:
        if isinstance(leaf, InputSpec):
            dtype = leaf.dtype
            if float_dtype is not None and dtype.is_floating_point:
                dtype = float_dtype
            with mode:
                return torch.empty(leaf.shape, dtype=dtype, device=device)
        dtype = float_dtype if float_dtype is not None and leaf.is_floating_point() else leaf.dtype
        with mode:
            return torch.empty(tuple(leaf.shape), dtype=dtype, device=device)

    return _map_batch(batch, one)


def _map_batch(obj: Any, fn: Callable[[Any], Any], depth: int = 0) -> Any:
    if depth > 32:
        return obj
    if isinstance(obj, (Tensor, InputSpec)):
        return fn(obj)
    if isinstance(obj, Mapping):
        mapped = {k: _map_batch(v, fn, depth + 1) for k, v in obj.items()}
        try:
            return type(obj)(mapped)
        except Exception:  # noqa: BLE001 - a mapping type that cannot be rebuilt from a dict
            return mapped
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*[_map_batch(v, fn, depth + 1) for v in obj])
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_batch(v, fn, depth + 1) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(
            obj, **{f.name: _map_batch(getattr(obj, f.name), fn, depth + 1) for f in dataclasses.fields(obj) if f.init}
        )
    return obj


def _batch_dims(batch: Any) -> tuple[int | None, int | None]:
    leaves: list[tuple[int, ...]] = []

    def collect(leaf: Any) -> Any:
        leaves.append(tuple(leaf.shape))
        return leaf

    _map_batch(batch, collect)
    if not leaves or not leaves[0]:
        return None, None
    first = leaves[0]
    seq = None
    if isinstance(batch, Mapping) and "input_ids" in batch:
        ids = batch["input_ids"]
        if len(ids.shape) >= 2:
            seq = int(ids.shape[1])
    return int(first[0]), seq


# ------------------------------------------------------------------------------------------------ the steps
def _is_lightning_module(module: nn.Module) -> bool:
    try:
        import lightning.pytorch as pl
    except ImportError:  # pragma: no cover - lightning is a dependency
        return False
    return isinstance(module, pl.LightningModule)


def _first_optimizer(configured: Any) -> torch.optim.Optimizer:
    """The optimizer out of whatever ``configure_optimizers`` returned."""
    if isinstance(configured, torch.optim.Optimizer):
        return configured
    if isinstance(configured, Mapping):
        return _first_optimizer(configured.get("optimizer"))
    if isinstance(configured, (list, tuple)) and configured:
        return _first_optimizer(configured[0])
    optimizer = getattr(configured, "optimizer", None)
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    raise ValueError(f"no optimizer in what configure_optimizers returned ({type(configured).__name__})")


def _default_training_step(model: nn.Module, batch: Any) -> Tensor:
    if isinstance(batch, Mapping):
        if "input_ids" in batch and "labels" not in batch and hasattr(model, "config"):
            out = model(**batch, labels=batch["input_ids"])
        else:
            out = model(**batch)
    elif isinstance(batch, (list, tuple)):
        out = model(*batch)
    else:
        out = model(batch)
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if loss is None and isinstance(out, Tensor):
        loss = out.float().mean()
    if not isinstance(loss, Tensor):
        raise TypeError("the model's output has no loss: pass training_step=")
    return loss


def _enable_gradient_checkpointing(model: nn.Module) -> None:
    for sub in model.modules():
        enable = getattr(sub, "activation_checkpointing_enable", None)  # transformers >= 5
        if callable(enable):
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            enable = getattr(sub, "gradient_checkpointing_enable", None)
            if callable(enable):
                enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if callable(enable):
            config = getattr(sub, "config", None)
            if config is not None and hasattr(config, "use_cache"):
                config.use_cache = False
            return
    raise ValueError(
        f"{type(model).__name__} has no gradient_checkpointing_enable(): enable checkpointing in the module"
    )


@contextlib.contextmanager
def _autocast(device_type: str, dtype: torch.dtype | None) -> Iterator[None]:
    if dtype is None:
        yield
        return
    # As Lightning's MixedPrecision plugin: no cache of cast weights (they would stay alive through the forward).
    with torch.autocast(device_type=device_type, dtype=dtype, cache_enabled=False):
        yield


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    if dtype is None:
        yield
        return
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _loss_of(output: Any) -> Tensor | None:
    if isinstance(output, Tensor):
        return output
    if isinstance(output, Mapping):
        loss = output.get("loss")
        if not isinstance(loss, Tensor):
            raise TypeError("training_step returned a dict without a 'loss' tensor")
        return loss
    if output is None:
        return None
    raise ValueError(f"training_step returned {type(output).__name__}: return a loss tensor or a dict with 'loss'")


def _step_tensors(optimizer: torch.optim.Optimizer) -> dict[int, torch.UntypedStorage]:
    steps: list[Tensor] = []
    for state in optimizer.state.values():
        value = state.get("step") if isinstance(state, Mapping) else None
        if isinstance(value, Tensor):
            steps.append(value)
    return unique_storages(steps)


def estimate(
    module: nn.Module,
    batch: Any,
    *,
    optimizer_factory: Callable[[nn.Module], Any] | None = None,
    training_step: Callable[[nn.Module, Any], Any] | None = None,
    precision: str | int | Precision = "32-true",
    accumulate_grad_batches: int = 1,
    gradient_checkpointing: bool = False,
    device: torch.device | str | None = None,
    steps: int = 2,
    copy_module: bool = True,
    prefetch: bool = False,
) -> Estimate:
    """Estimate the memory of training ``module`` on ``batch`` by running real steps on fake tensors.

    Nothing real is allocated for parameters, gradients, optimizer state, batch or activations: a 1.5B-parameter
    model estimates on a laptop. The module's own ``forward`` (or ``training_step``) runs, autograd saves what it
    saves, the optimizer's own ``step`` runs, and :class:`~lightning_memtrace.capture.recorder.MemoryRecorder` takes the same
    rows the callback takes on a real run, in Lightning's order (``zero_grad`` after the forward, so the previous
    step's gradients are alive through the next forward; with accumulation, ``zero_grad`` on the first batch of a
    window and a step on its last).

    Args:
        module: A LightningModule (its ``training_step`` and ``configure_optimizers`` are used) or any ``nn.Module``.
            Its tensors may be real, meta or fake; it is copied (``copy_module``) and never changed.
        batch: An example batch (tensors, nested in dicts/lists/tuples/dataclasses) or shapes: each leaf may be a
            real tensor, a meta tensor or an :class:`InputSpec`. Only shapes and dtypes are used.
        optimizer_factory: ``factory(model) -> optimizer`` (or anything ``configure_optimizers`` may return). Default:
            the LightningModule's ``configure_optimizers``; for a plain module, AdamW(lr=1e-3).
        training_step: ``fn(model, batch) -> loss`` for a plain module. Default: the LightningModule's
            ``training_step(batch, batch_idx)``, else ``model(**batch).loss`` (labels = input_ids for a causal LM),
            ``model(*batch)`` or ``model(batch)``, reduced with ``mean`` if it is a tensor.
        precision: ``32-true``, ``16-mixed``, ``bf16-mixed``, ``bf16-true`` or ``16-true`` (Lightning's meaning:
            mixed autocasts the forward and keeps fp32 weights; true casts the weights and float inputs).
        accumulate_grad_batches: Batches per optimizer step.
        gradient_checkpointing: Turn on activation checkpointing (Hugging Face ``gradient_checkpointing_enable``,
            non-reentrant) before estimating. False leaves the module as it is.
        device: The device to estimate for. Default: the module's device (``meta`` counts as ``cuda``).
            For ``cuda`` on a machine without CUDA, fake CPU tensors stand in: the optimizer uses foreach kernels
            (CUDA's default), Adam's ``step`` scalars are left out (host memory on CUDA) and autocast follows CPU's
            op lists.
        steps: Optimizer steps to run (at least 2: the second is the steady state).
        copy_module: Copy the module onto fake tensors (False: replace the module's own tensors; only for modules
            made for the estimate).
        prefetch: Keep the next batch alive during each step, as Lightning's fetcher does for a data loader without
            a length (an iterable dataset) on CPU. Sized loaders are not prefetched.

    Returns:
        An :class:`Estimate` with the callback's rows for every estimated batch and the closed-form figures.
    """
    started = time.perf_counter()
    precision = Precision.parse(precision)
    accumulate = max(1, int(accumulate_grad_batches))
    steps = max(2, int(steps))
    target = _target_device(module, device)
    fake_device = target if target.type == "cpu" or torch.cuda.is_available() else torch.device("cpu")
    emulate_cuda = target.type == "cuda" and fake_device.type != "cuda"
    if fake_device.type == "cuda" and fake_device.index is None:
        fake_device = torch.device("cuda", torch.cuda.current_device())
    lightning = _is_lightning_module(module)

    mode = _fake_mode()
    with warnings.catch_warnings(), _outer_modes_paused():
        warnings.simplefilter("ignore")
        model = _fake_copy(module, mode, fake_device, precision.param_dtype, in_place=not copy_module)
        model.train()
        if gradient_checkpointing:
            _enable_gradient_checkpointing(model)
        with mode:
            if optimizer_factory is not None:
                optimizer = _first_optimizer(optimizer_factory(model))
            elif lightning:
                optimizer = _first_optimizer(model.configure_optimizers())
            else:
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if target.type == "cuda":
            # torch picks foreach kernels for plain CUDA tensors only; fake tensors would get the single-tensor path.
            _use_cuda_defaults(optimizer)
        if lightning and not getattr(model, "automatic_optimization", True):
            raise ValueError("manual optimization is not supported by the estimate: use automatic optimization")
        records = _run(
            model,
            optimizer,
            batch,
            mode,
            fake_device,
            precision,
            accumulate,
            steps,
            lightning,
            training_step,
            prefetch=prefetch and not emulate_cuda and fake_device.type == "cpu",
        )
    if emulate_cuda:
        records = _without_host_steps(records, optimizer)
    batch_size, seq_len = _batch_dims(batch)
    return Estimate(
        records=tuple(records),
        closed_form=closed_form(
            model, optimizer, steps_on_device=target.type == "cpu" or not _steps_on_host(optimizer)
        ),
        device=target.type,
        precision=precision.value,
        optimizer=type(optimizer).__name__,
        batch_size=batch_size,
        seq_len=seq_len,
        accumulate_grad_batches=accumulate,
        gradient_checkpointing=bool(gradient_checkpointing or _checkpointing_on(model)),
        seconds=time.perf_counter() - started,
    )


@contextlib.contextmanager
def _outer_modes_paused() -> Iterator[None]:
    """Take the dispatch modes already active (a running MemTrace's tracker) off the stack while estimating.

    The estimate stays invisible to a real run's measurement, and the real run's tracker does not see the fake
    computations (which it would ignore, at a cost).
    """
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


def _steps_on_host(optimizer: torch.optim.Optimizer) -> bool:
    return not any(g.get("capturable") or g.get("fused") for g in optimizer.param_groups)


def _checkpointing_on(model: nn.Module) -> bool:
    return any(getattr(sub, "gradient_checkpointing", False) is True for sub in model.modules())


def _target_device(module: nn.Module, device: torch.device | str | None) -> torch.device:
    if device is not None:
        target = torch.device(device)
    else:
        target = next((t.device for t in module.parameters()), torch.device("cpu"))
        if target.type == "meta":
            target = torch.device("cuda")
    if target.type not in ("cpu", "cuda"):
        raise ValueError(f"the estimate supports cpu and cuda targets, not {target.type}")
    return target


def _use_cuda_defaults(optimizer: torch.optim.Optimizer) -> None:
    """Where CUDA would default to foreach kernels, use them on the stand-in CPU tensors too."""
    for group in optimizer.param_groups:
        if "foreach" in group and group["foreach"] is None and not group.get("fused"):
            group["foreach"] = True


def _without_host_steps(records: list[PhaseRecord], optimizer: torch.optim.Optimizer) -> list[PhaseRecord]:
    """On CUDA, Adam's ``step`` scalars are host tensors: take them out of the stand-in CPU measurement."""
    if not _steps_on_host(optimizer):
        return records
    host = sum(s.nbytes() for s in _step_tensors(optimizer).values())
    if host == 0:
        return records
    out = []
    seen = False
    for record in records:
        if not seen and record.optimizer_state_bytes >= host and record.phase == Phase.AFTER_OPTIMIZER_STEP:
            seen = True
        if seen:
            record = dataclasses.replace(
                record,
                allocated_bytes=record.allocated_bytes - host,
                reserved_bytes=record.reserved_bytes - host,
                peak_bytes=record.peak_bytes - host,
                optimizer_state_bytes=record.optimizer_state_bytes - host,
            )
        out.append(record)
    return out


class _FakeCategoryCounter(CategoryCounter):
    """The callback's category counter for fake tensors, whose storages sit on ``meta`` whatever their device.

    Inputs and saved activations were matched to the device by their tensors already (``input_storages`` and
    ``SavedTensorsRecorder`` check the tensor's device); only the storage-device check is left out here.
    """

    def classify(
        self, inputs: StorageMap | None = None, saved: StorageMap | None = None
    ) -> dict[int, tuple[Category, torch.UntypedStorage]]:
        out = super().classify()
        for category, storages in ((Category.INPUTS, inputs), (Category.ACTIVATIONS, saved)):
            for key, storage in (storages or {}).items():
                if key not in out:
                    out[key] = (category, storage)
        return out


def _run(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    mode: Any,
    device: torch.device,
    precision: Precision,
    accumulate: int,
    steps: int,
    lightning: bool,
    training_step: Callable[[nn.Module, Any], Any] | None,
    prefetch: bool,
) -> list[PhaseRecord]:
    """Lightning's automatic optimization loop, step for step, with MemTrace's recorder taking the rows."""
    # Built for the meta device, so that it touches no real allocator (on CUDA, CudaCounters would reset the real
    # device's peak statistics under a running training), then pointed at the fake device.
    recorder = _meta_recorder(model, optimizer, device)
    loop = _LightningLoop(model, optimizer, recorder, device, precision, accumulate, lightning, training_step)
    float_dtype = precision.param_dtype

    def new_batch() -> Any:
        return _fake_batch(batch, mode, device, float_dtype)

    with mode:
        recorder.start()
        try:
            buffer: list[Any] = [new_batch()] if prefetch else []
            for batch_idx in range(steps * accumulate):
                if prefetch:
                    # Lightning's prefetching fetcher: the next batch is fetched before this one starts.
                    current = buffer.pop(0)
                    buffer.append(new_batch())
                else:
                    # On an accelerator only the current batch is on the device (moved in `batch_to_device`).
                    current = new_batch()
                loop.run_batch(current, batch_idx)
                del current
            del buffer
        finally:
            loop.clear()
            recorder.stop()
    return list(recorder.records)


def _meta_recorder(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> MemoryRecorder:
    """MemTrace's recorder counting fake tensors on ``device``.

    Fake tensors' storages live on the meta device: the tracker counts there, without stacks (no history is written),
    and no real allocator is touched (on CUDA, allocator counters would reset the real device's peak statistics
    under a running training).
    """
    parts = RecorderParts(
        tracker=AllocationTracker("meta", max_entries=1, frames_min_bytes=1 << 62),
        categories=_FakeCategoryCounter(device, model, [optimizer]),
    )
    config = RecorderConfig(track_allocations=True, history=False, post_mortem=False)
    return MemoryRecorder(model, [optimizer], config, device=device, parts=parts)


class _LightningLoop:
    """One training batch as Lightning's automatic optimization runs it, with the recorder's rows at its hooks."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        recorder: MemoryRecorder,
        device: torch.device,
        precision: Precision,
        accumulate: int,
        lightning: bool,
        training_step: Callable[[nn.Module, Any], Any] | None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.recorder = recorder
        self.device = device
        self.precision = precision
        self.accumulate = accumulate
        self.lightning = lightning
        self.step_fn = training_step or _default_training_step
        self.global_step = 0
        self.scale: Tensor | None = None  # GradScaler's scale, alive from the first backward on (16-mixed)
        self.batch: Any = None
        self.batch_idx = 0
        self.result: dict[str, Any] = {}

    def clear(self) -> None:
        self.batch = None
        self.result = {}

    def run_batch(self, batch: Any, batch_idx: int) -> None:
        self.batch, self.batch_idx, self.result = batch, batch_idx, {}
        should_step = (batch_idx + 1) % self.accumulate == 0
        self.recorder.begin_batch(batch, step=self.global_step, batch_idx=batch_idx)
        if should_step:
            if self.precision is Precision.FP16_MIXED:
                # Lightning's AMP plugin runs the closure outside optimizer.step, then unscales and steps.
                self.closure()
                self._unscale()
                self.optimizer.step()
            else:
                self.optimizer.step(self.closure)
            self.global_step += 1
        else:
            self.closure()
        # closure.consume_result(): only the detached loss (and any extra outputs) reach on_train_batch_end.
        self.result.pop("closure_loss", None)
        self.recorder.end_batch(next_step=self.global_step)
        self.clear()

    def closure(self) -> Tensor | None:
        """Lightning's ``Closure``: training_step, zero_grad on the first batch of a window, backward."""
        recorder, result = self.recorder, self.result
        with _autocast(self.device.type, self.precision.autocast_dtype), _default_dtype(self.precision.param_dtype):
            if self.lightning:
                output = self.model.training_step(self.batch, self.batch_idx)
            else:
                output = self.step_fn(self.model, self.batch)
        loss = _loss_of(output)
        if isinstance(output, Mapping):
            # ClosureResult keeps what training_step returned beside the loss until the batch ends.
            result["extra"] = {k: v for k, v in output.items() if k != "loss"}
        del output
        if loss is None:
            return None
        closure_loss = loss / self.accumulate
        del loss
        result["closure_loss"] = closure_loss
        result["loss"] = closure_loss.detach().clone()
        if self.batch_idx % self.accumulate == 0:
            recorder.mark_forward_done()  # on_before_zero_grad
            self.optimizer.zero_grad(set_to_none=True)
        recorder.mark_forward_done()  # on_before_backward
        to_backward = closure_loss
        if self.precision is Precision.FP16_MIXED:
            if self.scale is None:
                self.scale = torch.full((), 65536.0, dtype=torch.float32, device=self.device)
            to_backward = closure_loss * self.scale
        to_backward.backward()
        del to_backward, closure_loss
        recorder.mark_backward_done()  # on_after_backward
        return result["loss"]

    def _unscale(self) -> None:
        grads = [p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        if grads and self.scale is not None:
            inv_scale = self.scale.double().reciprocal().float()
            torch._foreach_mul_(grads, inv_scale)


def _module_device(module: nn.Module) -> torch.device:
    return next((t.device for t in module.parameters()), torch.device("cpu"))


def estimate_for_module(
    pl_module: nn.Module,
    batch: Any,
    precision: str | int | Precision = "32-true",
    accumulate_grad_batches: int = 1,
    optimizers_factory: Callable[[nn.Module], Any] | None = None,
    gradient_checkpointing: bool = False,
    device: torch.device | str | None = None,
    steps: int = 3,
) -> Estimate:
    """The estimate for the callback: the real LightningModule and its first batch, copied onto fake tensors.

    Args:
        pl_module: The module being trained (real weights are not touched; nothing real is allocated).
        batch: Its first batch (as ``on_train_batch_start`` receives it).
        precision: The Trainer's precision (``trainer.precision``).
        accumulate_grad_batches: ``trainer.accumulate_grad_batches``.
        optimizers_factory: ``factory(fake_module) -> optimizer``; default: the module's ``configure_optimizers``.
        gradient_checkpointing: Turn checkpointing on in the copy (False keeps the module's own setting).
        device: Device to estimate for; default the module's.
        steps: Optimizer steps to estimate; 3 covers the callback's default window.
    """
    return estimate(
        pl_module,
        batch,
        optimizer_factory=optimizers_factory,
        precision=precision,
        accumulate_grad_batches=accumulate_grad_batches,
        gradient_checkpointing=gradient_checkpointing,
        device=device if device is not None else _module_device(pl_module),
        steps=steps,
    )


# ------------------------------------------------------------------------------------------------ from a config
def _build_meta_causal_lm(config: str | os.PathLike | Mapping[str, Any], dtype: torch.dtype | None) -> nn.Module:
    from lightning_memtrace.models import _TRANSFORMERS_AVAILABLE, load_config_dict

    if not _TRANSFORMERS_AVAILABLE:
        raise ModuleNotFoundError(str(_TRANSFORMERS_AVAILABLE))
    from transformers import AutoConfig, AutoModelForCausalLM

    if isinstance(config, Mapping):
        data = dict(config)
        hf_config = AutoConfig.for_model(**data)
    else:
        path = Path(config).expanduser()
        text = str(config)
        if not path.exists() and (
            text.endswith(".json") or text.startswith((".", "/", "~")) or os.sep + os.sep in text
        ):
            raise FileNotFoundError(f"no such config file or folder: {text}")
        if path.exists():
            data = load_config_dict(path)
            hf_config = AutoConfig.for_model(**data)
        else:
            hf_config = AutoConfig.from_pretrained(str(config))  # a hub id, where the network allows
    hf_config.use_cache = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager", dtype=torch.float32)
    if dtype is not None:
        model.to(dtype)
    return model


def estimate_from_config(
    config: str | os.PathLike | Mapping[str, Any],
    batch_size: int,
    seq_len: int,
    *,
    optimizer: str | OptimizerName = OptimizerName.ADAMW,
    precision: str | int | Precision = "32-true",
    gradient_checkpointing: bool = False,
    accumulate_grad_batches: int = 1,
    device: torch.device | str = "cuda",
    lr: float = 1e-3,
    steps: int = 2,
    model: nn.Module | None = None,
) -> Estimate:
    """Estimate a Hugging Face causal LM from its config alone (a dict, a ``config.json``, a folder or a hub id).

    The model is built on the meta device (no weights, no download of weights), trained on ``input_ids`` of shape
    ``(batch_size, seq_len)`` with ``labels=input_ids``, eager attention.

    Args:
        config: The Hugging Face config.
        batch_size: Micro-batch size.
        seq_len: Tokens per sequence.
        optimizer: ``adamw``, ``adam`` or ``sgd`` (momentum 0.9).
        precision: Lightning's precision setting.
        gradient_checkpointing: Non-reentrant activation checkpointing.
        accumulate_grad_batches: Batches per optimizer step.
        device: The device to estimate for (``cuda`` by default).
        lr: Learning rate (it does not change memory).
        steps: Optimizer steps to run.
        model: A meta model built before (from :func:`build_meta_model`), to reuse across batch sizes.
    """
    name = OptimizerName(str(optimizer).lower())
    precision = Precision.parse(precision)
    built = model if model is not None else _build_meta_causal_lm(config, None)

    def factory(fake_model: nn.Module) -> torch.optim.Optimizer:
        params = [p for p in fake_model.parameters() if p.requires_grad]
        if name is OptimizerName.ADAMW:
            return torch.optim.AdamW(params, lr=lr)
        if name is OptimizerName.ADAM:
            return torch.optim.Adam(params, lr=lr)
        return torch.optim.SGD(params, lr=lr, momentum=0.9)

    return estimate(
        built,
        lm_batch(batch_size, seq_len),
        optimizer_factory=factory,
        precision=precision,
        accumulate_grad_batches=accumulate_grad_batches,
        gradient_checkpointing=gradient_checkpointing,
        device=device,
        steps=steps,
    )


def build_meta_model(config: str | os.PathLike | Mapping[str, Any]) -> nn.Module:
    """A Hugging Face causal LM on the meta device, to pass to :func:`estimate_from_config` many times."""
    return _build_meta_causal_lm(config, None)


# ------------------------------------------------------------------------------------------------ max batch
@dataclasses.dataclass(frozen=True)
class MaxBatchResult:
    """The largest micro-batch whose estimated peak fits.

    Attributes:
        batch_size: The largest fitting batch size, 0 if even ``low`` does not fit.
        device_memory: The budget, bytes.
        peaks: Estimated peak per batch size tried.
        capped: True if ``high`` fits (the answer may be larger).
    """

    batch_size: int
    device_memory: int
    peaks: dict[int, int]
    capped: bool = False


def find_max_batch(
    peak_for: Callable[[int], int | Estimate],
    device_memory: int,
    *,
    low: int = 1,
    high: int = 1 << 16,
) -> MaxBatchResult:
    """The largest batch size ``b`` in ``[low, high]`` with ``peak_for(b) <= device_memory``.

    Doubles from ``low`` until a size does not fit, then bisects: O(log b) estimates. The peak grows with the batch
    size, so the answer is monotone: a larger budget never gives a smaller batch.

    Args:
        peak_for: ``fn(batch_size)`` returning a peak in bytes or an :class:`Estimate`.
        device_memory: The budget in bytes.
        low: Smallest batch size to try.
        high: Largest batch size to try.
    """
    peaks: dict[int, int] = {}

    def fits(size: int) -> bool:
        if size not in peaks:
            value = peak_for(size)
            peaks[size] = value.peak_bytes if isinstance(value, Estimate) else int(value)
        return peaks[size] <= device_memory

    low, high = max(1, int(low)), max(1, int(high))
    if not fits(low):
        return MaxBatchResult(0, int(device_memory), dict(sorted(peaks.items())))
    good, bad = low, None
    size = low
    while bad is None:
        size = min(size * 2, high)
        if fits(size):
            good = size
            if size == high:
                return MaxBatchResult(good, int(device_memory), dict(sorted(peaks.items())), capped=True)
        else:
            bad = size
    while bad - good > 1:
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return MaxBatchResult(good, int(device_memory), dict(sorted(peaks.items())))


# ------------------------------------------------------------------------------------------------ comparison
def compare_estimate(estimate: Estimate, phases: Any, phase: Phase | str | None = None) -> Any:
    """Estimate beside measurement, per category (and for the peak), with the error in percent.

    Args:
        estimate: The estimate of the run.
        phases: The run's phases table (``load_phases(...)`` or the recorder's rows as a DataFrame); validation rows
            are ignored.
        phase: Compare at this phase only; default: for each category, the phase where the estimate holds most of it.

    Returns:
        A DataFrame with columns ``category``, ``phase``, ``estimated_bytes``, ``measured_bytes`` (the most of that
        category over the run at the same phase), ``error_bytes`` (estimated - measured) and ``error_percent``
        (relative to measured; NaN where measured is 0). Rows: each category in :class:`Category` order, then
        ``peak`` (``peak_bytes``).
    """
    import pandas as pd

    measured = phases[phases["phase"].astype(str).isin([p.value for p in TRAIN_PHASES])]
    est = estimate.to_dataframe()
    rows = []
    columns = [(c.value, f"{c.value}_bytes") for c in Category] + [("peak", "peak_bytes")]
    for name, column in columns:
        if phase is not None:
            at = Phase(phase).value
        else:
            by_phase = est.groupby("phase")[column].max()
            at = str(by_phase.idxmax()) if len(by_phase) else Phase.AFTER_FORWARD.value
        est_value = int(est.loc[est["phase"] == at, column].max()) if (est["phase"] == at).any() else 0
        meas_rows = measured.loc[measured["phase"].astype(str) == at, column]
        meas_value = int(meas_rows.max()) if len(meas_rows) else 0
        error = est_value - meas_value
        percent = 100.0 * error / meas_value if meas_value else math.nan
        rows.append(
            {
                "category": name,
                "phase": at,
                "estimated_bytes": est_value,
                "measured_bytes": meas_value,
                "error_bytes": error,
                "error_percent": percent,
            }
        )
    frame = pd.DataFrame(rows)
    for column in ("estimated_bytes", "measured_bytes", "error_bytes"):
        frame[column] = frame[column].astype("int64")
    return frame


def compare_phase_peaks(estimate: Estimate, phases: Any) -> Any:
    """Per (step, batch_idx, phase) of the estimate, its ``peak_bytes`` beside the run's and the error in percent.

    Rows are matched on ``step``, ``batch_idx`` and ``phase`` (estimate the same number of steps as compared).
    """
    import pandas as pd

    keys = ["step", "batch_idx", "phase"]
    est = estimate.to_dataframe()[[*keys, "peak_bytes"]]
    measured = phases[phases["phase"].astype(str).isin([p.value for p in TRAIN_PHASES])]
    measured = measured.assign(phase=measured["phase"].astype(str))[[*keys, "peak_bytes"]]
    merged = pd.merge(est, measured, on=keys, suffixes=("_estimated", "_measured"))
    merged["error_percent"] = (
        100.0 * (merged.peak_bytes_estimated - merged.peak_bytes_measured) / merged.peak_bytes_measured
    )
    return merged


def comparison_text(comparison: Any) -> str:
    """:func:`compare_estimate`'s table as aligned text (for the log and the report)."""
    lines = [f"{'category':16} {'phase':22} {'estimated':>14} {'measured':>14} {'error':>9}"]
    for row in comparison.itertuples(index=False):
        error = "n/a" if math.isnan(row.error_percent) else f"{row.error_percent:+.2f}%"
        lines.append(
            f"{row.category:16} {row.phase:22} {format_bytes(row.estimated_bytes):>14} "
            f"{format_bytes(row.measured_bytes):>14} {error:>9}"
        )
    return "\n".join(lines)


def write_comparison_csv(comparison: Any, path: str | os.PathLike) -> Path:
    """Write :func:`compare_estimate`'s table as CSV atomically (temporary file, then rename)."""
    text = comparison.to_csv(index=False, float_format="%.3f")
    return atomic_write_text(path, text)


def comparison_path(folder: str | os.PathLike, rank: int = 0) -> Path:
    """Where the callback writes the comparison: ``<folder>/estimate_vs_measured_rank<R>.csv``."""
    return Path(folder) / COMPARISON_FILENAME.format(rank=rank)


def categories_of(records: Sequence[PhaseRecord]) -> dict[Category, int]:
    """The most bytes of each measured category over some rows."""
    out = {category: 0 for category in MEASURED_CATEGORIES}
    for record in records:
        for category in MEASURED_CATEGORIES:
            out[category] = max(out[category], getattr(record, f"{category.value}_bytes"))
    return out
