"""The per-phase CSV: one flushed line per row, appended on resume, and :func:`load_phases` to read it back."""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path

import pandas as pd

from lightning_memtrace.types import PhaseRecord

COLUMNS = PhaseRecord.columns()
BYTE_COLUMNS = [c for c in COLUMNS if c.endswith("_bytes")]
INT_COLUMNS = ["step", "epoch", "batch_idx", "rank", *BYTE_COLUMNS]
_HEADER = ",".join(COLUMNS) + "\n"
# One format for a whole line (floats as %.6f, the rest as they print): a row is written many times per step.
_LINE = ",".join("%.6f" if c == "time_s" else "%s" for c in COLUMNS) + "\n"
_FIELDS = tuple(COLUMNS)
_PHASE_INDEX = _FIELDS.index("phase")


def phases_filename(rank: int) -> str:
    return f"phases_rank{rank}.csv"


class PhaseCsvWriter:
    """Writes :class:`PhaseRecord` rows to a CSV file.

    Each row is a single ``write`` of one whole line on an unbuffered file, so a process killed mid-run leaves only
    whole lines. The header is written once; an existing file with the same header is appended to (resume). At most
    ``max_rows`` rows are written by this writer.
    """

    def __init__(self, path: str | os.PathLike, max_rows: int | None = None) -> None:
        self.path = Path(path)
        self.max_rows = max_rows
        self.rows_written = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() and self.path.stat().st_size > 0:
            with open(self.path, encoding="utf-8", errors="replace") as handle:
                first = handle.readline()
            if first != _HEADER:
                # A file from another version or tool: keep it, start ours beside it.
                self.path.rename(self.path.with_name(self.path.name + ".old"))
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)  # as open() under the umask
        if os.fstat(self._fd).st_size == 0:
            os.write(self._fd, _HEADER.encode())
        else:
            self._repair_partial_line()

    def _repair_partial_line(self) -> None:
        # A line cut by a crash of an earlier run would glue onto our first row: end it first.
        with open(self.path, "rb") as handle:
            handle.seek(-1, os.SEEK_END)
            last = handle.read(1)
        if last != b"\n":
            os.write(self._fd, b"\n")

    @property
    def full(self) -> bool:
        return self.max_rows is not None and self.rows_written >= self.max_rows

    def write(self, record: PhaseRecord) -> bool:
        """Write one row; False once the row cap is reached."""
        return self.write_many([record]) == 1

    def write_many(self, records: list[PhaseRecord]) -> int:
        """Write rows, each as one ``write`` of a whole line, as many as the row cap allows; returns how many."""
        written = 0
        for record in records:
            if self._fd < 0 or self.full:
                break
            values = [getattr(record, c) for c in _FIELDS]
            values[_PHASE_INDEX] = str(record.phase)
            os.write(self._fd, (_LINE % tuple(values)).encode())
            self.rows_written += 1
            written += 1
        return written

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


def _phase_files(path: str | os.PathLike) -> list[Path]:
    target = Path(path)
    if target.is_file():
        return [target]
    candidates = []
    for folder in (target, target / "memtrace"):
        candidates.extend(Path(p) for p in glob.glob(str(folder / "phases_rank*.csv")))
    if not candidates:
        candidates = [Path(p) for p in glob.glob(str(target / "**" / "memtrace" / "phases_rank*.csv"), recursive=True)]
    return sorted(set(candidates), key=_rank_of)


def _rank_of(path: Path) -> tuple[int, str]:
    found = re.search(r"rank(\d+)", path.name)
    return (int(found.group(1)) if found else 0, str(path))


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
        frame = pd.read_csv(file, on_bad_lines="skip")
        missing = [c for c in COLUMNS if c not in frame.columns]
        if missing:
            raise ValueError(f"{file} is not a MemTrace phases CSV: missing columns {missing}")
        frame = frame[COLUMNS]
        for column in INT_COLUMNS:
            frame[column] = pd.to_numeric(frame[column], errors="coerce")
        frame["time_s"] = pd.to_numeric(frame["time_s"], errors="coerce")
        frame = frame.dropna(subset=[*INT_COLUMNS, "time_s"])
        frame = frame.astype({c: "int64" for c in INT_COLUMNS})
        frame["phase"] = frame["phase"].astype(str)
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)
