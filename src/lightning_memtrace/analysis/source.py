"""What a report, ``memtrace summary`` and ``memtrace diff`` read: one snapshot file, or every MemTrace file of a log
folder, replayed, one :class:`ReportSource` per run.

A folder holds several runs when it is a parent of several log folders (``lightning_logs`` with ``version_0`` and
``version_1``) or when several fits wrote into one folder (their rows tell them apart by the CSV's ``run`` column,
their snapshots by the header's ``run``).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from lightning_memtrace.analysis.loader import DEFAULT_MAX_BYTES, SnapshotError, load_snapshot
from lightning_memtrace.analysis.model import Replay
from lightning_memtrace.analysis.phases import load_phases, runs_in
from lightning_memtrace.analysis.replay import replay
from lightning_memtrace.analysis.rules import CategoryRules, RulesLike
from lightning_memtrace.files import MEMTRACE_DIR, PHASES_GLOB, SNAPSHOT_PATTERNS, is_oom_file, matching_files, rank_of
from lightning_memtrace.schema import header_run


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
        path: What the user passed, or the run's folder when the user passed a parent of several.
        snapshots: Replayed snapshots (may be empty for a log folder with only the phases CSV).
        phases: MemTrace's phases table (this run's rows only), or None.
        run: The run id (the CSV's ``run`` column), or ``""`` when unknown (a snapshot file, older files).
        label: What the run is called where several are shown: its folder (``lightning_logs/version_1``), with the
            run id when one folder holds several runs.
    """

    path: Path
    snapshots: list[LoadedSnapshot]
    phases: pd.DataFrame | None
    run: str = ""
    label: str = ""

    @property
    def main(self) -> LoadedSnapshot | None:
        """The snapshot with the highest peak."""
        if not self.snapshots:
            return None
        return max(self.snapshots, key=lambda s: s.replay.peak.live_bytes)


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


def _natural_key(path: Path) -> list[Any]:
    """``version_2`` before ``version_10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def _holds_memtrace_files(folder: Path) -> bool:
    return bool(matching_files(folder, PHASES_GLOB, *SNAPSHOT_PATTERNS))


#: How deep below the folder passed the search for ``memtrace`` folders goes (``lightning_logs/version_0/memtrace`` is
#: 3 deep), and how many folders it looks into before it gives up: a home folder or ``/`` is not a log folder.
SEARCH_DEPTH = 8
SEARCH_FOLDERS_MAX = 20_000


def run_folders(path: str | os.PathLike[str]) -> list[Path]:
    """The MemTrace folders under ``path``: itself (or its ``memtrace`` folder) when it holds MemTrace files, else every
    ``memtrace`` folder below it that does, in natural order (``version_2`` before ``version_10``).

    The search goes at most :data:`SEARCH_DEPTH` folders deep, skips hidden folders, follows links to folders once
    each, and looks into at most :data:`SEARCH_FOLDERS_MAX` folders.

    Raises:
        SnapshotError: More folders below ``path`` than that.
    """
    target = Path(path)
    for folder in (target / MEMTRACE_DIR, target):
        if folder.is_dir() and _holds_memtrace_files(folder):
            return [folder]
    found: list[Path] = []
    seen: set[tuple[int, int]] = set()
    top = len(target.parts)
    for visited, (dirpath, dirnames, _) in enumerate(os.walk(target, followlinks=True), start=1):
        if visited > SEARCH_FOLDERS_MAX:
            raise SnapshotError(
                f"{target}: over {SEARCH_FOLDERS_MAX:,} folders to search for MemTrace's; pass a log folder (the "
                "logger's, or a parent of a few)"
            )
        here = Path(dirpath)
        try:
            status = here.stat()
        except OSError:
            dirnames[:] = []
            continue
        if (status.st_dev, status.st_ino) in seen:  # a link back to a folder searched already
            dirnames[:] = []
            continue
        seen.add((status.st_dev, status.st_ino))
        if here.name == MEMTRACE_DIR and _holds_memtrace_files(here):
            found.append(here)
        if len(here.parts) - top >= SEARCH_DEPTH:
            dirnames[:] = []
        else:
            dirnames[:] = [name for name in dirnames if not name.startswith(".")]
    return sorted(found, key=_natural_key)


def _folder_files(folder: Path) -> list[Path]:
    files = set(matching_files(folder, *SNAPSHOT_PATTERNS))
    return sorted((f for f in files if not f.name.endswith(".tmp")), key=lambda p: ((rank_of(p.name) or 0), p.name))


def _load_file(
    file: Path, max_bytes: int, progress: Callable[[int, int], None] | None, rules: RulesLike = None
) -> LoadedSnapshot:
    snap = load_snapshot(file, max_bytes=max_bytes, progress=progress)
    kind = "oom" if is_oom_file(file.name) else "snapshot"
    text = _load_oom_text(file) if kind == "oom" else None
    return LoadedSnapshot(file, replay(snap, source=file.name, rules=rules), rank_of(file.name), kind, text)


def _folder_sources(
    folder: Path,
    label: str,
    max_bytes: int,
    progress: Callable[[int, int], None] | None,
    rules: RulesLike = None,
) -> list[ReportSource]:
    """One source per run written into ``folder``; snapshots without a known run id go with the newest run."""
    phases = _load_folder_phases(folder)
    snapshots = [_load_file(file, max_bytes, progress, rules) for file in _folder_files(folder)]
    if phases is not None and phases.empty:  # every line cut short or not numbers: there is nothing to show of it
        if not snapshots:
            raise SnapshotError(f"{folder}: its phases CSV has no complete row (a field missing or not a number)")
        phases = None
    runs = runs_in(phases)
    if len(runs) <= 1:
        return [ReportSource(folder, snapshots, phases, min(runs[0]) if runs else "", label)]
    assert phases is not None

    def run_of(snapshot: LoadedSnapshot) -> int:
        run = header_run(snapshot.replay.memtrace)
        return next((k for k, ids in enumerate(runs) if run in ids), len(runs) - 1)

    sources = []
    for k, ids in enumerate(runs):
        own = [s for s in snapshots if run_of(s) == k]
        rows = phases[phases["run"].isin(ids)].reset_index(drop=True)
        name = str(rows.loc[rows["rank"].idxmin(), "run"])  # rank zero's id
        sources.append(ReportSource(folder, own, rows, name, f"{label} · run {name}"))
    return sources


def load_sources(
    path: str | os.PathLike[str],
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    progress: Callable[[int, int], None] | None = None,
    rules: RulesLike = None,
) -> list[ReportSource]:
    """Every run of a snapshot file, a MemTrace log folder, or a parent of several (``lightning_logs``), oldest first.

    Args:
        path: Snapshot (pickle, gzip pickle, memory_viz HTML) or folder.
        max_bytes: Size limit per file.
        progress: Progress callback for large files (see :func:`load_snapshot`).
        rules: User rules for categories (``--rule``), applied to every snapshot before its header's own
            ``category_rules`` (see :mod:`~lightning_memtrace.analysis.rules`).

    Returns:
        One :class:`ReportSource` per run (one for a snapshot file).

    Raises:
        SnapshotError: Unreadable input, or a folder without MemTrace files.
        RuleError: A rule is not usable (a ``ValueError``, one line naming it), checked before any file is read.
    """
    rules = CategoryRules.of(rules)
    target = Path(path)
    if not target.exists():
        raise SnapshotError(f"{target}: no such file or directory")
    if target.is_file() and fnmatch.fnmatch(target.name, PHASES_GLOB):
        target = target.parent  # a rank's phases table stands for its log folder
    if not target.is_dir():
        snapshot = LoadedSnapshot(
            target, replay(load_snapshot(target, max_bytes=max_bytes, progress=progress), rules=rules)
        )
        snapshot.rank = rank_of(target.name)
        return [ReportSource(target, [snapshot], None, header_run(snapshot.replay.memtrace), target.name)]
    folders = run_folders(target)
    if not folders:
        raise SnapshotError(
            f"{target}: a directory without MemTrace files (phases_rank<R>.csv, snapshot_rank<R>_*.pickle), "
            "here or in any memtrace folder below it"
        )
    sources = []
    for folder in folders:
        sources.extend(_folder_sources(folder, run_label(folder, target), max_bytes, progress, rules))
    if len(folders) == 1:  # what the user passed names the run (a report's title, the JSON's source)
        for source in sources:
            source.path = target
    return sources


def run_name(path: Path) -> str:
    """The name a run goes by: a snapshot's file name; a log folder's run (``lightning_logs/version_0`` for
    ``lightning_logs/version_0/memtrace``, never ``memtrace``)."""
    path = Path(path)
    if not path.is_dir():
        return path.name
    folder = path.resolve()
    if folder.name == MEMTRACE_DIR and folder.parent != folder:
        folder = folder.parent
    if folder.name.startswith("version_") and folder.parent.name:  # a logger's version folder: name its experiment too
        return f"{folder.parent.name}/{folder.name}"
    return folder.name


def run_label(folder: Path, root: Path) -> str:
    """A run folder as the user knows it: relative to what they passed (``version_1``), else its :func:`run_name`."""
    run = folder.parent if folder.name == MEMTRACE_DIR else folder
    try:
        relative = run.resolve().relative_to(root.resolve())
    except ValueError:
        relative = None
    if relative is not None and str(relative) not in ("", "."):
        return relative.as_posix()
    return run_name(run)


def load_source(
    path: str | os.PathLike[str],
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    progress: Callable[[int, int], None] | None = None,
    rules: RulesLike = None,
) -> ReportSource:
    """The one run of a snapshot file or a MemTrace log folder (see :func:`load_sources`).

    Raises:
        SnapshotError: Unreadable input, a folder without MemTrace files, or a folder holding several runs (the
            message names them: pass one).
    """
    sources = load_sources(path, max_bytes=max_bytes, progress=progress, rules=rules)
    if len(sources) > 1:
        names = ", ".join(s.label for s in sources[:6]) + (" …" if len(sources) > 6 else "")
        raise SnapshotError(f"{path}: holds {len(sources)} runs ({names}); pass one run's folder")
    return sources[0]
