"""The per-phase CSV writer: whole lines as the rows come, appended on resume (no pandas: a training run imports it).

:func:`lightning_memtrace.analysis.phases.load_phases` reads it back.
"""

from __future__ import annotations

import os
from operator import attrgetter
from pathlib import Path

from lightning_memtrace.types import PHASE_COLUMNS, PhaseRecord

_HEADER = ",".join(PHASE_COLUMNS) + "\n"
# One format for a whole line (floats as %.6f, the rest as they print): a row is written many times per step.
_LINE = ",".join("%.6f" if c == "time_s" else "%s" for c in PHASE_COLUMNS) + "\n"
# A row's values in column order, at C speed ("%s" prints a phase as its value).
_VALUES = attrgetter(*PHASE_COLUMNS)


class PhaseCsvWriter:
    """Writes :class:`PhaseRecord` rows to a CSV file.

    The rows handed over together (the recorder gathers them for about a second) are a single ``write`` of whole
    lines on an unbuffered file, so a process killed mid-run leaves only whole lines. The header is written once; an
    existing file with the same header is appended to (resume). At most ``max_rows`` rows are written by this writer.
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
        """Write rows, as many as the row cap allows, in one ``write`` of whole lines; returns how many."""
        if self._fd < 0:
            return 0
        if self.max_rows is not None:
            records = records[: max(0, self.max_rows - self.rows_written)]
        if not records:
            return 0
        data = "".join([_LINE % _VALUES(record) for record in records]).encode()
        while data:  # a regular file takes it whole but on a full disk; then the OSError comes from the next write
            data = data[os.write(self._fd, data) :]
        self.rows_written += len(records)
        return len(records)

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
