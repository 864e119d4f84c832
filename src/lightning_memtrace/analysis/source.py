"""What a report, ``memtrace summary`` and ``memtrace diff`` read: one snapshot file, or every MemTrace file of a log
folder, replayed."""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from lightning_memtrace.analysis.loader import DEFAULT_MAX_BYTES, SnapshotError, load_snapshot
from lightning_memtrace.analysis.model import Replay
from lightning_memtrace.analysis.phases import load_phases
from lightning_memtrace.analysis.replay import replay
from lightning_memtrace.files import MEMTRACE_DIR, SNAPSHOT_PATTERNS, is_oom_file, rank_of


@dataclasses.dataclass
class LoadedSnapshot:
    """One snapshot of a source, replayed."""

    path: Path
    replay: Replay
    rank: int | None = None
    kind: str = "snapshot"  # "snapshot" or "oom"
    oom_text: str | None = None


@dataclasses.dataclass
class ReportSource:
    """What a report reads: one snapshot file, or every file of a MemTrace log folder.

    Attributes:
        path: What the user passed.
        snapshots: Replayed snapshots (may be empty for a log folder with only the phases CSV).
        phases: MemTrace's phases table, or None.
    """

    path: Path
    snapshots: list[LoadedSnapshot]
    phases: pd.DataFrame | None

    @property
    def main(self) -> LoadedSnapshot | None:
        """The snapshot with the highest peak."""
        if not self.snapshots:
            return None
        return max(self.snapshots, key=lambda s: s.replay.peak.live_bytes)


def _memtrace_dir(path: Path) -> Path:
    return path / MEMTRACE_DIR if (path / MEMTRACE_DIR).is_dir() else path


def _load_oom_text(file: Path) -> str | None:
    txt = file.with_suffix(".txt")
    return txt.read_text(encoding="utf-8", errors="replace")[:20000] if txt.is_file() else None


def _load_folder_phases(folder: Path) -> pd.DataFrame | None:
    try:
        return load_phases(folder)
    except FileNotFoundError:
        return None
    except ValueError as error:
        raise SnapshotError(f"{folder}: {error}") from None


def load_source(
    path: str | os.PathLike[str],
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    progress: Callable[[int, int], None] | None = None,
) -> ReportSource:
    """Load a snapshot file, or a MemTrace log folder (``<log_dir>`` or ``<log_dir>/memtrace``).

    Args:
        path: Snapshot (pickle, gzip pickle, memory_viz HTML) or folder.
        max_bytes: Size limit per file.
        progress: Progress callback for large files (see :func:`load_snapshot`).

    Returns:
        The :class:`ReportSource`.

    Raises:
        SnapshotError: Unreadable input, or a folder without MemTrace files.
    """
    target = Path(path)
    if not target.exists():
        raise SnapshotError(f"{target}: no such file or directory")
    if not target.is_dir():
        snap = load_snapshot(target, max_bytes=max_bytes, progress=progress)
        return ReportSource(target, [LoadedSnapshot(target, replay(snap), rank=rank_of(target.name))], None)
    folder = _memtrace_dir(target)
    files: list[Path] = []
    for pattern in SNAPSHOT_PATTERNS:
        files.extend(Path(p) for p in glob.glob(str(folder / pattern)))
    files = sorted(set(files), key=lambda p: ((rank_of(p.name) or 0), p.name))
    files = [f for f in files if not f.name.endswith(".tmp")]
    phases = _load_folder_phases(folder)
    if not files and phases is None:
        raise SnapshotError(
            f"{target}: a directory without MemTrace files (phases_rank<R>.csv, snapshot_rank<R>_*.pickle)"
        )
    snapshots = []
    for file in files:
        snap = load_snapshot(file, max_bytes=max_bytes, progress=progress)
        kind = "oom" if is_oom_file(file.name) else "snapshot"
        text = _load_oom_text(file) if kind == "oom" else None
        snapshots.append(LoadedSnapshot(file, replay(snap, source=file.name), rank_of(file.name), kind, text))
    return ReportSource(target, snapshots, phases)
