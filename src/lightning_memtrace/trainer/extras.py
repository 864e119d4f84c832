"""What MemTrace adds around a fit: the estimate before the first step, the estimate-vs-measured CSV and the report
at the end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_memtrace.files import PHASES_GLOB, phases_filename
from lightning_memtrace.units import MIB


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


def compare_with_run(estimate: Any, folder: Path | None, rank: int) -> Any:
    """Write ``estimate_vs_measured_rank<R>.csv`` next to the rank's phases CSV; returns the comparison (or None)."""
    csv = folder / phases_filename(rank) if folder is not None else None
    if not estimate or csv is None or not csv.is_file():
        return None
    from lightning_memtrace.analysis.phases import load_phases
    from lightning_memtrace.estimator import compare_estimate, comparison_path, write_comparison_csv

    try:
        comparison = compare_estimate(estimate, load_phases(csv))
        write_comparison_csv(comparison, comparison_path(folder, rank))
    except Exception as error:
        rank_zero_warn(f"MemTrace could not compare the estimate with the run: {error}")
        return None
    return comparison


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
