"""An estimate beside a real run's measurement: per category, per phase, and the comparison CSV."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from lightning_memtrace.atomic import atomic_write_text
from lightning_memtrace.estimator.result import Estimate
from lightning_memtrace.types import TRAIN_PHASES, Category, Phase
from lightning_memtrace.units import format_bytes

#: Name of the comparison CSV written beside the phases CSV.
COMPARISON_FILENAME = "estimate_vs_measured_rank{rank}.csv"


def _training_rows(phases: Any, run: str | None = None) -> Any:
    """The rows of training phases (validation rows left out) of one run: ``run``, or where the table holds several
    (fits into one folder append to its CSV), the newest, as the report tells runs apart (:func:`runs_in`)."""
    from lightning_memtrace.analysis.phases import runs_in

    rows = phases[phases["phase"].astype(str).isin([p.value for p in TRAIN_PHASES])]
    if "run" not in rows.columns or rows.empty:
        return rows
    runs = rows["run"].astype(str)
    ids = {str(run)} if run is not None else runs_in(rows)[-1]
    return rows[runs.isin(ids)]


def _compared(est: Any, measured: Any, name: str, column: str, phase: Phase | str | None) -> dict[str, Any]:
    """One row of :func:`compare_estimate`: ``column`` at ``phase`` (default: where the estimate holds most of it)."""
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
    return {
        "category": name,
        "phase": at,
        "estimated_bytes": est_value,
        "measured_bytes": meas_value,
        "error_bytes": error,
        "error_percent": percent,
    }


def _served_on(row: dict[str, Any], reserved: int) -> None:
    if reserved > row["estimated_bytes"]:
        row["estimated_bytes"] = reserved
        row["error_bytes"] = reserved - row["measured_bytes"]
        row["error_percent"] = 100.0 * row["error_bytes"] / row["measured_bytes"] if row["measured_bytes"] else math.nan


def compare_estimate(
    estimate: Estimate, phases: Any, phase: Phase | str | None = None, run: str | None = None
) -> Any:
    """Estimate beside measurement, per category (and for the peak), with the error in percent.

    Args:
        estimate: The estimate of the run.
        phases: The run's phases table (``load_phases(...)`` or the recorder's rows as a DataFrame); validation rows
            are ignored.
        phase: Compare at this phase only; default: for each category, the phase where the estimate holds most of it.
        run: Compare with the rows of this run id (the ``run`` column); default: the table's newest run (a folder
            that several fits wrote into holds all their rows).

    Returns:
        A DataFrame with columns ``category``, ``phase``, ``estimated_bytes``, ``measured_bytes`` (the most of that
        category over the run at the same phase), ``error_bytes`` (estimated - measured) and ``error_percent``
        (relative to measured; NaN where measured is 0). Rows: each category in :class:`Category` order, then
        ``peak`` (``peak_bytes``), then, where the estimate modelled CUDA's caching allocator, ``reserved``
        (``reserved_bytes``; for a run with more steps than the estimate, the most the allocator reserves up to the
        run's last step with the steady step served on, see :attr:`Estimate.long_run`).
    """
    import pandas as pd

    measured = _training_rows(phases, run)
    est = estimate.to_dataframe()
    columns = [(c.value, f"{c.value}_bytes") for c in Category] + [("peak", "peak_bytes")]
    if estimate.allocator:
        columns.append(("reserved", "reserved_bytes"))
    compared = [_compared(est, measured, name, column, phase) for name, column in columns]
    long_run, log = estimate.long_run, estimate.allocator_log
    if long_run is not None and log is not None and len(measured) and "step" in measured.columns:
        # a run longer than the estimate: its allocator may have reserved more in the later steps, served on
        _served_on(compared[-1], long_run.reserved_through(log.served_step(int(measured["step"].max()))))
    frame = pd.DataFrame(compared)
    for column in ("estimated_bytes", "measured_bytes", "error_bytes"):
        frame[column] = frame[column].astype("int64")
    return frame


def compare_phase_peaks(estimate: Estimate, phases: Any, run: str | None = None) -> Any:
    """Per (step, batch_idx, phase) of the estimate, its ``peak_bytes`` beside the run's and the error in percent.

    Rows are matched on ``step``, ``batch_idx`` and ``phase`` (estimate the same number of steps as compared), in
    the rows of ``run`` (default: the table's newest run, as :func:`compare_estimate`).
    """
    import pandas as pd

    keys = ["step", "batch_idx", "phase"]
    est = estimate.to_dataframe()[[*keys, "peak_bytes"]]
    measured = _training_rows(phases, run)
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
