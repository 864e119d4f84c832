"""What MemTrace adds around a fit: the estimate before the first step, the estimate-vs-measured CSV, the what-if
(at the end, and in an out-of-memory post-mortem) and the report at the end."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_memtrace.atomic import atomic_write_text
from lightning_memtrace.capture.ddp_buckets import bucket_bytes, has_gradient_buckets, keeps_first_buckets
from lightning_memtrace.capture.oom import say_what_if_runs
from lightning_memtrace.files import PHASES_GLOB, phases_filename, what_if_filename
from lightning_memtrace.units import MIB

#: How to give the what-if more time, said where the budget stopped it.
WHAT_IF_HINT = "raise MemTrace(what_if_budget_s=...)"


def estimate_run(trainer: pl.Trainer, batch: Any) -> tuple[Any, dict[str, float] | None]:
    """The estimate of this run on fake tensors from the real module and its first batch (printed), and its metrics:
    ``memtrace/estimate/<category>`` and ``memtrace/estimate/peak`` (MiB). ``(False, None)`` if it cannot be made."""
    from lightning_memtrace.estimator import estimate_for_module

    try:
        estimate = estimate_for_module(
            trainer.lightning_module,
            batch,
            precision=trainer.precision,
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            ddp_buckets=has_ddp_buckets(trainer),
        )
    except Exception as error:
        rank_zero_warn(f"MemTrace could not estimate this run ({type(error).__name__}: {error}); measuring only.")
        return False, None
    rank_zero_info(f"MemTrace estimate (fake tensors, before the first step):\n{estimate.table()}")
    metrics = {
        f"memtrace/estimate/{getattr(name, 'value', name)}": value / MIB
        for name, value in estimate.category_bytes().items()
    }
    metrics["memtrace/estimate/peak"] = estimate.peak_bytes / MIB
    return estimate, metrics


def has_ddp_buckets(trainer: pl.Trainer) -> bool:
    """Whether the Trainer's model is DDP's with gradient buckets beside the gradients (see
    :mod:`~lightning_memtrace.capture.ddp_buckets`)."""
    return has_gradient_buckets(getattr(trainer.strategy, "model", None))


def ddp_bucket_bytes(trainer: pl.Trainer) -> int:
    """The bytes of DDP's gradient buckets beside the gradients on this rank (0 where there are none)."""
    if not has_ddp_buckets(trainer):
        return 0
    return bucket_bytes(trainer.strategy.model.module)


def ddp_keeps_first_buckets(trainer: pl.Trainer) -> bool:
    """Whether the Trainer's DDP keeps, for the whole run, the gradient buckets it made before MemTrace started."""
    return has_ddp_buckets(trainer) and keeps_first_buckets(trainer.strategy.model)


def compare_with_run(estimate: Any, folder: Path | None, rank: int, run: str | None) -> Any:
    """Write ``estimate_vs_measured_rank<R>.csv`` next to the rank's phases CSV, compared with the rows of ``run`` (the
    CSV also holds the rows of earlier fits into the same folder); returns the comparison (or None)."""
    csv = folder / phases_filename(rank) if folder is not None else None
    if not estimate or csv is None or not csv.is_file():
        return None
    from lightning_memtrace.analysis.phases import load_phases
    from lightning_memtrace.estimator import compare_estimate, comparison_path, write_comparison_csv

    try:
        comparison = compare_estimate(estimate, load_phases(csv), run=run)
        write_comparison_csv(comparison, comparison_path(folder, rank))
    except Exception as error:
        rank_zero_warn(f"MemTrace could not compare the estimate with the run: {error}")
        return None
    return comparison


def batch_shapes(batch: Any) -> Any:
    """The batch as shapes and dtypes (what the estimate reads of it), so that it can be kept for the end of fit
    without keeping its tensors alive."""
    from lightning_memtrace.estimator.budget import batch_shapes as shapes

    return shapes(batch)


def _makes_what_if(batch: Any, budget_s: float) -> bool:
    """Whether :func:`what_if_for_fit` makes a what-if (its callers say so first)."""
    return budget_s > 0 and batch is not None


def what_if_for_fit(trainer: pl.Trainer, batch: Any, budget_s: float) -> Any:
    """What would fit for the Trainer's module and ``batch`` (fake tensors: the module's real parameters, gradients
    and optimizer state are not touched), at the Trainer's precision and accumulation, against the device's memory
    (CUDA: the device's total; CPU: the physical RAM), within ``budget_s`` seconds: a
    :class:`~lightning_memtrace.estimator.budget.BudgetedWhatIf`. None where ``budget_s`` is 0 or there is no
    batch. Never raises."""
    if not _makes_what_if(batch, budget_s):
        return None
    from lightning_memtrace.estimator.budget import device_memory_bytes, what_if_within

    module = trainer.lightning_module
    return what_if_within(
        module,
        batch,
        budget_s=budget_s,
        device_memory=device_memory_bytes(module.device),
        precision=str(trainer.precision),
        accumulate_grad_batches=trainer.accumulate_grad_batches,
        hint=WHAT_IF_HINT,
        ddp_buckets=has_ddp_buckets(trainer),
    )


def what_if_after_oom(trainer: pl.Trainer, batch: Any, budget_s: float) -> dict[str, Any] | None:
    """The post-mortem's what-if for the batch the run died on, as plain data (see
    :attr:`~lightning_memtrace.analysis.postmortem.PostMortem.what_if`), or None. One line on stderr says so first:
    the error's traceback waits for it."""
    if _makes_what_if(batch, budget_s):
        say_what_if_runs(trainer.global_rank, budget_s, "MemTrace(what_if_budget_s=0)")
    made = what_if_for_fit(trainer, batch, budget_s)
    return made.as_dict() if made is not None else None


def write_what_if(trainer: pl.Trainer, batch: Any, folder: Path | None, rank: int, budget_s: float) -> Path | None:
    """At the end of a fit with ``estimate=True``: ``what_if_rank<R>.csv`` (the columns of
    :meth:`~lightning_memtrace.estimator.what_if_results.WhatIf.to_dataframe`: ``remedy``, ``peak_bytes``, ``saved_bytes``,
    ``fits``, ``max_micro_batch``, ``kind``, ``price``, ``<category>_bytes``; bytes as ints) and
    ``what_if_rank<R>.json`` (everything, see :meth:`~lightning_memtrace.estimator.budget.BudgetedWhatIf.as_dict`)
    next to the estimate-vs-measured CSV, for the first batch; returns the CSV (None where none was written). A stop
    or failure is one warning."""
    if folder is None or not _makes_what_if(batch, budget_s):
        return None
    # the fit has ended on the console: without a word, tens of seconds of estimates would look like a hang
    rank_zero_info(
        f"MemTrace: estimating what would fit (each remedy, its largest micro-batch), for up to {budget_s:g} s; "
        "MemTrace(what_if_budget_s=0) skips this"
    )
    started = time.monotonic()
    made = what_if_for_fit(trainer, batch, budget_s)
    if made is None:
        return None
    if made.note:
        rank_zero_warn(f"MemTrace {made.note}")
    if made.result is None:
        return None
    try:
        csv = atomic_write_text(folder / what_if_filename(rank), made.to_dataframe().to_csv(index=False))
        atomic_write_text(folder / what_if_filename(rank, ".json"), json.dumps(made.as_dict(), indent=2) + "\n")
    except Exception as error:  # noqa: BLE001 - a file that cannot be written is one warning
        rank_zero_warn(f"MemTrace could not write the what-if in {folder}: {error}")
        return None
    rank_zero_info(f"MemTrace: what would fit: {csv} ({time.monotonic() - started:.0f} s)")
    return csv


def write_fit_report(trainer: pl.Trainer, folder: Path | None, log_image: bool = True) -> Path | None:
    """``report.html`` and ``timeline.png`` in ``folder``; with ``log_image``, the PNG is logged to TensorBoard as
    ``memtrace/timeline``."""
    if folder is None or not folder.is_dir() or not any(folder.glob(PHASES_GLOB)):
        return None
    from lightning_memtrace.report import write_report

    try:
        report_path = write_report(folder, folder / "report.html", folder / "timeline.png")
    except Exception as error:
        rank_zero_warn(f"MemTrace could not write the report in {folder}: {error}")
        return None
    png = folder / "timeline.png"
    for logger in trainer.loggers if log_image else ():
        experiment = getattr(logger, "experiment", None)
        if png.is_file() and hasattr(experiment, "add_image"):
            import matplotlib.image

            image = matplotlib.image.imread(str(png))[..., :3]
            experiment.add_image("memtrace/timeline", image, global_step=trainer.global_step, dataformats="HWC")
    return report_path
