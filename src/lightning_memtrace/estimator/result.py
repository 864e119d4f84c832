"""The result of an estimate: the callback's rows on fake tensors, the closed-form figures, the table and JSON."""

from __future__ import annotations

import dataclasses
from typing import Any

from lightning_memtrace.analysis.caching_allocator import ROUND_LARGE as SEGMENT_UNIT
from lightning_memtrace.analysis.allocator_settings import AllocatorSettings
from lightning_memtrace.estimator.allocator_log import AllocatorLog, Served
from lightning_memtrace.estimator.closed_form import ClosedForm
from lightning_memtrace.types import SHARDED_CATEGORIES, Category, Phase, PhaseRecord
from lightning_memtrace.units import format_bytes


@dataclasses.dataclass(frozen=True, repr=False)
class Estimate:
    """What a training step takes, measured on fake tensors: the callback's rows plus closed-form figures.

    Attributes:
        records: One :class:`PhaseRecord` per phase of every estimated batch, as MemTrace writes them on a real run
            (``peak_bytes`` is the highest allocation since the previous row).
        closed_form: The textbook figures beside the measured ones.
        device: The device the estimate is for (``cpu`` or ``cuda``).
        precision: Lightning's precision setting.
        optimizer: The optimizer's class name.
        optimizer_detail: What the class name leaves out and memory depends on (``momentum 0.9`` for SGD with
            momentum, ``no momentum, no state`` for plain SGD), or empty.
        batch_size: Micro-batch size (first dimension of the first batch tensor), if known.
        seq_len: Sequence length (second dimension of token ids), if known.
        accumulate_grad_batches: Batches per optimizer step.
        gradient_checkpointing: Whether activation checkpointing was on.
        seconds: Wall time the estimate took.
        world_size: Ranks the run is sharded over (1: unsharded); the rows are rank zero's.
        sharding: How it was sharded, in words (``""`` unsharded).
        attention: The attention the estimate ran and, for SDPA, its kernel (``eager``, ``sdpa (flash kernel)``,
            ``sdpa (math kernel)``; for a CUDA target estimated on CPU, the CUDA kernel assumed), or empty for a
            model without attention.
        compiled: The module (or a submodule) was compiled with ``torch.compile``; the estimate ran it eagerly, and
            a compiled graph may save less for backward than the eager ops do.
        sparse_gradients: The model has an ``nn.Embedding`` or ``nn.EmbeddingBag`` with ``sparse=True``. Its gradient
            (and an optimizer's state made from it, SGD's momentum) is a sparse tensor whose size follows the rows a
            batch touches, which fake tensors do not know: the estimate counts it as empty.
        values_read: Where the step read a tensor value that the estimate answered without having it (``file:line in
            function``, at most 8), as in a usual run: a floating-point value with 0.0 (``loss.item()`` to log it), a
            NaN or infinity check as for finite values, ``bincount`` with ``minlength`` bins, CTC loss's longest
            target as the padded targets' width. Empty where the step read none.
        ddp_bucket_bytes: Bytes of DDP's gradient buckets the estimate holds alive throughout (``other`` in the rows;
            0 where the run is not DDP's or its gradients are views of the buckets).
        scratch_unmeasured: Operators whose CPU kernel's scratch (a convolution's im2col or reorder buffers, see
            :mod:`~lightning_memtrace.estimator.kernel_scratch`) could not be measured, each with why
            (``"convolution.default: ..."``): the peak may be higher by their scratch. Empty where every one was.
        blas_workspace_bytes: Bytes of the cuBLAS workspaces a CUDA run keeps from its first products on, one for the
            forward's thread and one for the backward's (``other`` in the rows; see
            :mod:`~lightning_memtrace.estimator.blas_workspace`); 0 for a CPU target.
        task: What a model built from a config is trained for, in words, where not a causal LM
            (``sequence-classification``, ``image-classification (3 x 224 x 224 images)``...; see
            :mod:`~lightning_memtrace.estimator.tasks`); empty otherwise.
        quantization: The model's quantized weights in words (``4-bit nf4 weights in 14 layers (bitsandbytes)``:
            QLoRA's base; see :mod:`~lightning_memtrace.estimator.quantization`); empty where none is.
        lora: The model's LoRA adapters (peft) in words (``LoRA r=16 on 8 layers, base frozen``); empty where it has
            none.
        allocator_log: For a CUDA target, the requests and frees the caching allocator's model served and its
            settings (see :meth:`allocator_fits`): the rows' ``allocated_bytes`` and ``peak_bytes`` are then the
            allocator's blocks and ``reserved_bytes`` its segments. None for a CPU target (reserved equals allocated).
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
    optimizer_detail: str = ""
    attention: str = ""
    world_size: int = 1
    sharding: str = ""
    compiled: bool = False
    values_read: tuple[str, ...] = ()
    sparse_gradients: bool = False
    ddp_bucket_bytes: int = 0
    scratch_unmeasured: tuple[str, ...] = ()
    blas_workspace_bytes: int = 0
    allocator_log: AllocatorLog | None = dataclasses.field(default=None, compare=False)
    task: str = ""
    quantization: str = ""
    lora: str = ""

    def __repr__(self) -> str:
        """One line, as :meth:`describe` with the peak (the rows are in ``records``, the table in :meth:`table`)."""
        return f"Estimate({self.describe()}: peak {format_bytes(self.peak_bytes)}, {len(self.records)} records)"

    __str__ = __repr__

    @property
    def peak_bytes(self) -> int:
        """The highest allocation of the whole estimated run."""
        return max((r.peak_bytes for r in self.records), default=0)

    @property
    def allocator(self) -> str:
        """The settings the caching allocator was modelled with, in words (``defaults``, ``expandable segments``...;
        see :mod:`~lightning_memtrace.analysis.caching_allocator`); empty for a CPU target."""
        return self.allocator_log.settings.describe() if self.allocator_log is not None else ""

    @property
    def peak_reserved_bytes(self) -> int | None:
        """The most the caching allocator reserves over the estimated run (``torch.cuda.max_memory_reserved()``),
        None where no allocator was modelled (a CPU target)."""
        if self.allocator_log is None:
            return None
        return max((r.reserved_bytes for r in self.records), default=0)

    @property
    def long_run(self) -> Served | None:
        """The caching allocator serving the run on past the estimated steps, nothing making it free its cache: the
        steady step's requests again, step after step, until the allocator's state repeats (see
        :mod:`~lightning_memtrace.estimator.allocator_log`); None for a CPU target."""
        return self.allocator_log.unhindered if self.allocator_log is not None else None

    @property
    def long_run_reserved_bytes(self) -> int | None:
        """The most the caching allocator reserves however long the run goes on (:attr:`long_run`): at least
        :attr:`peak_reserved_bytes`, more where blocks fragment over later steps; None for a CPU target."""
        long_run = self.long_run
        if long_run is None:
            return None
        return max(self.peak_reserved_bytes or 0, long_run.max_reserved_bytes)

    def allocator_fits(self, capacity: int) -> bool | None:
        """Whether CUDA's caching allocator, able to reserve ``capacity`` bytes (the device's memory less the CUDA
        context), serves every request of the run, the estimated steps and the steady step served on after them
        (:attr:`long_run`): fragmentation included, and the cache freed where it must be, as torch does before it
        raises out of memory. None where no allocator was modelled (a CPU target).
        """
        if self.allocator_log is None:
            return None
        if (self.long_run_reserved_bytes or 0) <= capacity:
            return True
        return self.allocator_log.serves_within(capacity)

    def allocator_needs(self, settings: AllocatorSettings | None = None) -> int | None:
        """The least ``capacity`` for which :meth:`allocator_fits` holds (a multiple of 2 MiB, as segments are), or
        would hold under other ``settings`` (``expandable_segments``...); None for a CPU target."""
        log = self.allocator_log
        if log is None:
            return None
        unit = SEGMENT_UNIT
        low = max(0, self.peak_bytes - 1) // unit  # below the peak: never serves
        high = max(1, -(-(self.long_run_reserved_bytes or 0) // unit))  # what the run reserved unhindered: serves
        while not log.serves_within(high * unit, settings):  # other settings may need more than these reserved
            low, high = high, 2 * high
        while high - low > 1:
            middle = (low + high) // 2
            if log.serves_within(middle * unit, settings):
                high = middle
            else:
                low = middle
        return high * unit

    def allocator_needs_expandable(self) -> int | None:
        """:meth:`allocator_needs` with ``expandable_segments:True`` where the run has them off, else None."""
        if self.allocator_log is None or self.allocator_log.settings.expandable_segments:
            return None
        return self.allocator_needs(dataclasses.replace(self.allocator_log.settings, expandable_segments=True))

    @property
    def peak_record(self) -> PhaseRecord | None:
        """The row whose ``peak_bytes`` is highest (the phase that ends the stretch where the peak falls).

        Among rows with the same peak, the last one: the steady step's, which the table shows.
        """
        best: PhaseRecord | None = None
        for record in self.records:
            if best is None or record.peak_bytes >= best.peak_bytes:
                best = record
        return best

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
        """Whether the peak fits in ``device_memory`` bytes (allocated bytes: leave room for the CUDA context; for a
        CUDA target, :meth:`allocator_fits` says whether the caching allocator, fragmentation included, serves it)."""
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
            "optimizer_detail": self.optimizer_detail,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "task": self.task,
            "quantization": self.quantization,
            "lora": self.lora,
            "accumulate_grad_batches": self.accumulate_grad_batches,
            "gradient_checkpointing": self.gradient_checkpointing,
            "attention": self.attention,
            "world_size": self.world_size,
            "sharding": self.sharding,
            "compiled": self.compiled,
            "values_read": list(self.values_read),
            "sparse_gradients": self.sparse_gradients,
            "ddp_bucket_bytes": self.ddp_bucket_bytes,
            "scratch_unmeasured": list(self.scratch_unmeasured),
            "blas_workspace_bytes": self.blas_workspace_bytes,
            "allocator": self.allocator,
            "peak_bytes": self.peak_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "long_run_reserved_bytes": self.long_run_reserved_bytes,
            "long_run_reserved_step": self._long_run_step("reserved_from_step"),
            "allocator_needs_bytes": self.allocator_needs(),
            "allocator_needs_expandable_bytes": self.allocator_needs_expandable(),
            "phase_peaks": {p.value: v for p, v in self.phase_peaks().items()},
            "categories": {c.value: v for c, v in self.category_bytes().items()},
            "closed_form": self.closed_form.as_dict(),
            "seconds": self.seconds,
        }

    def table(self) -> str:
        """Plain text: per phase of the steady step, peak, allocated and categories; then closed-form figures.

        Under gradient accumulation each micro-batch of the step is a block labelled ``micro-batch i/n``. The last
        line is the peak of all estimated steps, naming its step (and the shown step's own peak where they differ).
        """
        step = self.steady_step
        first = min((r.step for r in self.records), default=0)
        out = [f"estimate (rows of step {step}, steady state): {self.describe()}"]
        rows = [r for r in self.records if r.step == step]
        out.extend(_phase_lines(_micro_batches(rows, self.accumulate_grad_batches), reserved=self.allocator_log is not None))
        out.append("")
        out.extend(_closed_form_lines(self.category_bytes(), self.closed_form))
        out.append(self._peak_line(step, first, rows))
        reserved = self.peak_reserved_bytes
        if reserved is not None:
            above = reserved - self.peak_bytes
            out.append(
                f"reserved by the caching allocator ({self.allocator}): {format_bytes(reserved)} ({reserved:,} B) "
                f"over the estimated steps, {format_bytes(above)} above the peak (cached blocks, free space in its "
                f"segments){self._long_run_text(reserved)}"
            )
        return "\n".join(out)

    def _long_run_step(self, field: str) -> int | None:
        """:attr:`long_run`'s ``field`` (a step counted from 0) as the run numbers its steps."""
        if self.long_run is None or self.allocator_log is None:
            return None
        return self.allocator_log.step_number(getattr(self.long_run, field))

    def _long_run_text(self, reserved: int) -> str:
        long_run, log = self.long_run, self.allocator_log
        if long_run is None or log is None:
            return ""
        if log.step_repeat is None:
            return (
                "; the steady step could not be served on (it keeps more than it frees of the step before), so later "
                "steps may reserve more"
            )
        estimated = len(log.step_starts) - 1
        if long_run.steps <= estimated:
            return ""
        first, last = log.step_number(estimated), log.step_number(long_run.steps - 1)
        served = f"; served on over steps {first}-{last} (the steady step's requests again"
        if long_run.repeats_from is not None:
            served += f", until the allocator's state repeats step {log.step_number(long_run.repeats_from)}'s"
        total = self.long_run_reserved_bytes or 0
        if total <= reserved:
            return f"{served}), it reserves no more"
        since = log.step_number(long_run.reserved_from_step)
        return f"{served}), it reserves {format_bytes(total)} ({total:,} B) from step {since} on"

    def _peak_line(self, step: int, first: int, rows: list[PhaseRecord]) -> str:
        record = self.peak_record
        steps = f"step {step}" if first == step else f"steps {first}-{step}"
        line = f"peak of {steps}: {format_bytes(self.peak_bytes)} ({self.peak_bytes:,} B)"
        if record is None:
            return line
        line += f" in step {record.step}, in the stretch ending at {record.phase.value}"
        if record.step != step:
            own = max((r.peak_bytes for r in rows), default=0)
            line += f"; step {step} (shown above) peaks at {format_bytes(own)} ({own:,} B)"
        return line

    def describe(self) -> str:
        """One line: device, precision, optimizer, batch and options."""
        optimizer = f"{self.optimizer} ({self.optimizer_detail})" if self.optimizer_detail else self.optimizer
        parts = [self.device, self.precision, optimizer]
        if self.task:
            parts.append(self.task)
        if self.quantization:
            parts.append(self.quantization)
        if self.lora:
            parts.append(self.lora)
        if self.batch_size is not None:
            parts.append(f"batch {self.batch_size}" + (f" x {self.seq_len} tokens" if self.seq_len else ""))
        if self.accumulate_grad_batches > 1:
            parts.append(f"accumulate {self.accumulate_grad_batches}")
        if self.gradient_checkpointing:
            parts.append("gradient checkpointing")
        if self.attention:
            parts.append(f"attention {self.attention}")
        if self.world_size > 1:
            parts.append(f"FSDP2 over {self.world_size} ranks (rank 0)")
        if self.ddp_bucket_bytes:
            buckets = format_bytes(self.ddp_bucket_bytes)
            parts.append(f"DDP with gradient buckets of {buckets} (gradient_as_bucket_view=False)")
        if self.blas_workspace_bytes:
            parts.append(f"cuBLAS workspaces {format_bytes(self.blas_workspace_bytes)} (in other)")
        if self.compiled:
            parts.append("compiled module estimated eagerly (a compiled graph may save less)")
        if self.sparse_gradients:
            parts.append(
                "sparse gradients (Embedding(sparse=True)) counted as empty: their size follows the batch's rows"
            )
        if self.values_read:
            parts.append(f"tensor values read answered as in a usual run (at {'; '.join(self.values_read)})")
        if self.scratch_unmeasured:
            parts.append(
                f"the scratch of CPU kernels left out, the peak may be higher ({'; '.join(self.scratch_unmeasured)})"
            )
        return ", ".join(parts)


def _micro_batches(rows: list[PhaseRecord], accumulate: int) -> list[tuple[str, list[PhaseRecord]]]:
    """The rows of one step in blocks, one per micro-batch (``batch_idx``), labelled where there are several."""
    blocks: dict[int, list[PhaseRecord]] = {}
    for record in rows:
        blocks.setdefault(record.batch_idx, []).append(record)
    if len(blocks) <= 1:
        return [("", rows)]
    total = max(len(blocks), accumulate)
    return [
        (f"micro-batch {index}/{total} (batch_idx {batch_idx})", block)
        for index, (batch_idx, block) in enumerate(sorted(blocks.items()), start=1)
    ]


def _phase_lines(blocks: list[tuple[str, list[PhaseRecord]]], reserved: bool = False) -> list[str]:
    """Aligned columns: phase, peak, allocated (``reserved`` too where the caching allocator was modelled) and each
    category, a rule under the header; a label line above each labelled block."""
    records = [r for _, rows in blocks for r in rows]
    cats = [
        c for c in Category if c not in SHARDED_CATEGORIES or any(r.category_bytes()[c] for r in records)
    ]
    header = ["phase", "peak", "allocated", *(["reserved"] if reserved else []), *[c.value for c in cats]]
    lines: list[list[str] | str] = [header]
    for label, rows in blocks:
        if label:
            lines.append(label)
        for r in rows:
            values = r.category_bytes()
            lines.append(
                [
                    r.phase.value,
                    format_bytes(r.peak_bytes),
                    format_bytes(r.allocated_bytes),
                    *([format_bytes(r.reserved_bytes)] if reserved else []),
                    *[format_bytes(values[c]) for c in cats],
                ]
            )
    cells = [row for row in lines if isinstance(row, list)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    out = []
    for index, row in enumerate(lines):
        if isinstance(row, str):
            out.append(row)
            continue
        out.append(
            "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        )
        if index == 0:
            out.append("  ".join("-" * w for w in widths))
    return out


def _closed_form_lines(measured: dict[Category, int], cf: ClosedForm) -> list[str]:
    """Measured beside closed-form bytes for parameters, gradients and optimizer state."""
    out = [f"{'':22}{'measured':>24}{'closed form':>24}"]
    formula = [
        ("parameters", measured[Category.PARAMETERS], cf.parameters_bytes),
        ("gradients", measured[Category.GRADIENTS], cf.gradients_bytes),
        ("optimizer_state", measured[Category.OPTIMIZER_STATE], cf.optimizer_state_with_steps_bytes),
    ]
    for name, value, expected in formula:
        shown = f"{expected:,} B" if expected is not None else "n/a"
        out.append(f"{name:22}{value:>22,} B{shown:>24}")
    return out
