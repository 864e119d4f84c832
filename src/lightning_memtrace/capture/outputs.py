"""The files one recorder writes: the phases CSV, snapshot pickles (rotated) and post-mortem text.

A failure to write (unwritable folder, full disk) becomes one warning and ends the writing for the run; training and
measuring go on.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_memtrace.atomic import atomic_write_pickle, atomic_write_text
from lightning_memtrace.capture.phases_writer import PhaseCsvWriter
from lightning_memtrace.files import numbered_name, phases_filename
from lightning_memtrace.types import PhaseRecord


@dataclasses.dataclass(eq=False)
class RecorderFiles:
    """Writes into ``output_dir`` (None: writes nothing).

    Args:
        output_dir: The folder.
        rank: Put in every file name.
        max_rows: Most rows written to the CSV (None: no cap).
        max_snapshots: Most rotated snapshots kept (oldest removed).
        warn: Called once per kind of problem with ``(kind, message)``.
    """

    output_dir: Path | None
    rank: int
    max_rows: int | None
    max_snapshots: int
    warn: Callable[[str, str], None]
    files: list[Path] = dataclasses.field(default_factory=list, init=False)
    snapshots: list[Path] = dataclasses.field(default_factory=list, init=False)
    rows_written: int = dataclasses.field(default=0, init=False)
    _csv: PhaseCsvWriter | None = dataclasses.field(default=None, init=False)
    #: Names this recorder wrote (it may write them again).
    _names: set[str] = dataclasses.field(default_factory=set, init=False)

    def __post_init__(self) -> None:
        self.ok = self.output_dir is not None

    @property
    def csv_path(self) -> Path | None:
        return self.output_dir / phases_filename(self.rank) if self.output_dir is not None else None

    def write_rows(self, records: list[PhaseRecord]) -> None:
        if not self.ok or self.output_dir is None:
            return
        try:
            if self._csv is None:
                self._csv = PhaseCsvWriter(self.output_dir / phases_filename(self.rank), max_rows=self.max_rows)
            written = self._csv.write_many(records)
            self.rows_written += written
            if written < len(records) and self._csv.full:
                self.warn("rows", f"the CSV reached max_rows={self.max_rows}; further rows are not written")
        except OSError as error:
            self._failed("the phases CSV", error)

    def unclaimed_base(self, base: str, suffixes: tuple[str, ...]) -> str:
        """``base``, or ``<base>.<n>`` with the smallest free ``n``, where an earlier fit left a file ``base + suffix``
        in the folder (a fit into a folder that holds another run's files appends its rows to the CSV; it never
        replaces that run's snapshots or post-mortem)."""
        if self.output_dir is None:
            return base
        candidate, n = base, 0
        while any(self._left_by_another_fit(candidate + suffix) for suffix in suffixes):
            n += 1
            candidate = numbered_name(base, n)
        return candidate

    def _left_by_another_fit(self, name: str) -> bool:
        return name not in self._names and self.output_dir is not None and os.path.lexists(self.output_dir / name)

    def write_snapshot(self, name: str, snapshot: dict[str, Any], rotate: bool = True) -> Path | None:
        """Write a snapshot pickle atomically (under a free name, see :meth:`unclaimed_base`); a rotated one counts
        towards ``max_snapshots``."""
        stem, suffix = os.path.splitext(name)
        path = self._write(self.unclaimed_base(stem, (suffix,)) + suffix, atomic_write_pickle, snapshot)
        if path is not None and rotate:
            self.snapshots.append(path)
            while len(self.snapshots) > self.max_snapshots:
                self._remove(self.snapshots.pop(0))
        return path

    def write_text(self, name: str, text: str) -> Path | None:
        stem, suffix = os.path.splitext(name)
        return self._write(self.unclaimed_base(stem, (suffix,)) + suffix, atomic_write_text, text)

    def _write(self, name: str, write: Callable[[Path, Any], Path], content: Any) -> Path | None:
        if not self.ok or self.output_dir is None:
            return None
        try:
            path = write(self.output_dir / name, content)
        except OSError as error:
            self._failed(name, error)
            return None
        self.files.append(path)
        self._names.add(name)
        return path

    def close(self) -> None:
        csv, self._csv = self._csv, None
        if csv is not None:
            csv.close()

    @staticmethod
    def _remove(path: Path) -> None:
        try:
            path.unlink()
        except OSError:
            pass  # already gone, or the folder became read-only: the next rotation tries no harder

    def _failed(self, what: str, error: BaseException) -> None:
        self.ok = False
        try:
            self.close()
        except OSError:
            pass  # the file is being given up on after a failed write: closing it can fail the same way
        self.warn(
            "output",
            f"could not write {what} in {self.output_dir} ({type(error).__name__}: {error}); MemTrace stops writing "
            "files for this run, training goes on.",
        )
