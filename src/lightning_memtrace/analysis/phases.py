"""Reading MemTrace's per-phase table back: :func:`load_phases` (pandas) and the per-step pivot of its peaks."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from lightning_memtrace.files import MEMTRACE_DIR, PHASES_GLOB, matching_files, rank_of
from lightning_memtrace.types import BYTE_COLUMNS, PHASE_COLUMNS, PHASE_ORDER

INT_COLUMNS = ["step", "epoch", "batch_idx", "rank", *BYTE_COLUMNS, "dataloader_idx"]
#: Columns added after the first release, with the value a CSV written before them means.
LATER_COLUMNS = {"unsharded_parameters_bytes": 0, "unsharded_gradients_bytes": 0, "dataloader_idx": 0}


def _phase_files(path: str | os.PathLike) -> list[Path]:
    target = Path(path)
    if target.is_file():
        return [target]
    candidates = matching_files(target, PHASES_GLOB, os.path.join(MEMTRACE_DIR, PHASES_GLOB))
    if not candidates:
        candidates = matching_files(target, os.path.join("**", MEMTRACE_DIR, PHASES_GLOB), recursive=True)
    return sorted(set(candidates), key=lambda p: (rank_of(p.name) or 0, str(p)))


def load_phases(path_or_log_dir: str | os.PathLike) -> pd.DataFrame:
    """Read MemTrace's per-phase table.

    Args:
        path_or_log_dir: A ``phases_rank<R>.csv`` file, a ``memtrace`` folder, or a log directory holding one (the
            logger's ``log_dir``); every rank's file found there is read and concatenated.

    Returns:
        A DataFrame with the columns of :class:`~lightning_memtrace.types.PhaseRecord`; byte columns are ``int64``.
        Rows with a missing field (a line cut by a crash) are dropped.

    Raises:
        FileNotFoundError: No phases file was found.
    """
    files = _phase_files(path_or_log_dir)
    if not files:
        raise FileNotFoundError(f"no MemTrace phases CSV (phases_rank<R>.csv) found at {path_or_log_dir}")
    frames = []
    for file in files:
        try:
            frame = pd.read_csv(file, on_bad_lines="skip")
        except pd.errors.EmptyDataError:
            raise ValueError(f"{file} is empty, not a MemTrace phases CSV") from None
        except UnicodeDecodeError:
            raise ValueError(f"{file} is not text, not a MemTrace phases CSV") from None
        if "run" not in frame.columns:  # a CSV from before run ids: its folder tells its run apart
            frame["run"] = str(file.parent)
        for column, value in LATER_COLUMNS.items():
            if column not in frame.columns:
                frame[column] = value
        missing = [c for c in PHASE_COLUMNS if c not in frame.columns]
        if missing:
            raise ValueError(f"{file} is not a MemTrace phases CSV: missing columns {missing}")
        frame = frame[PHASE_COLUMNS]
        for column in INT_COLUMNS:
            frame[column] = pd.to_numeric(frame[column], errors="coerce")
        frame["time_s"] = pd.to_numeric(frame["time_s"], errors="coerce")
        frame = frame.dropna(subset=[*INT_COLUMNS, "time_s"])
        frame = frame.astype({c: "int64" for c in INT_COLUMNS})
        frame["phase"] = frame["phase"].astype(str)
        frame["run"] = frame["run"].fillna("").astype(str)
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)


def runs_in(phases: pd.DataFrame | None) -> list[set[str]]:
    """The runs of a phases table (a folder's), oldest first, each as the run ids its ranks wrote.

    Each rank's file holds its runs one after the other; the k-th run of every rank is one run, whether the ranks
    shared an id (the callback broadcasts it) or not (plain loops, one recorder per rank).
    """
    if phases is None or phases.empty:
        return []
    per_rank: list[list[str]] = []
    for _, rows in phases.groupby("rank", sort=True):
        firsts = rows.groupby("run", sort=False)["time_s"].min().sort_values()
        per_rank.append([str(run) for run in firsts.index])
    count = max(len(runs) for runs in per_rank)
    return [{runs[k] for runs in per_rank if k < len(runs)} for k in range(count)]


def phase_peaks_table(phases: pd.DataFrame, max_steps: int = 60) -> pd.DataFrame:
    """Per-step, per-phase peak bytes (max over ranks) from MemTrace's phases table, phases in table order; at most
    ``max_steps`` steps (those with the highest peaks, in step order)."""
    pivot = phases.pivot_table(index="step", columns="phase", values="peak_bytes", aggfunc="max")
    order = [p.value for p in PHASE_ORDER if p.value in pivot.columns]
    pivot = pivot[order + [c for c in pivot.columns if c not in order]]
    if len(pivot) > max_steps:
        top = pivot.max(axis=1).nlargest(max_steps).index
        pivot = pivot.loc[sorted(top)]
    return pivot
