"""Where MemTrace writes in a fit: in the logger's folder, never into a folder that another writer of the Trainer was
given as its own (a ``ModelCheckpoint``'s, a file-writing profiler's)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import NamedTuple

import lightning.pytorch as pl

from lightning_memtrace.capture.recorder import RUN_ID_PATTERN
from lightning_memtrace.files import MEMTRACE_DIR, TEMP_FOLDER

#: How many runs' folders the temporary folder keeps: where a new run starts there, the oldest beyond these go.
TEMP_RUNS_KEPT = 20


class MemTraceFolder(NamedTuple):
    """The folder MemTrace writes into, and where that is not the usual one, the folder kept clear and why."""

    path: Path
    #: The folder MemTrace would have written under and keeps out of (None where it writes there).
    kept_clear: Path | None = None
    #: What saves into ``kept_clear``, as said in the warning ("a ModelCheckpoint", "the Trainer's profiler").
    owner: str | None = None


def memtrace_folder(trainer: pl.Trainer, run_id: str) -> MemTraceFolder:
    """``<trainer.log_dir>/memtrace`` (with ``logger=False``, Lightning's ``log_dir`` is ``default_root_dir``); or,
    where another writer saves into that very folder, ``<temp>/lightning_memtrace/<run_id>``, where the oldest runs'
    folders beyond :data:`TEMP_RUNS_KEPT` go as this one starts.

    Such a folder holds that writer's files only: scripts and tests list a checkpoint folder, or take its newest entry,
    to find the last checkpoint, and list a profiler's folder to find its reports. A logger's folder is shared by
    design (the logger's files, a profiler's, MemTrace's side by side), so a profiler writing into it is no reason to
    keep out. ``trainer.log_dir`` broadcasts across ranks: call this where every rank is (``setup``), never in an
    exception handler.
    """
    parent = Path(trainer.log_dir or trainer.default_root_dir)
    owner = _owner_of(trainer, os.path.realpath(parent))
    if owner is not None:
        runs = Path(tempfile.gettempdir()) / TEMP_FOLDER
        if trainer.is_global_zero:
            _drop_oldest_runs(runs, keep=TEMP_RUNS_KEPT - 1, current=run_id)
        return MemTraceFolder(runs / run_id, parent, owner)
    return MemTraceFolder(parent / MEMTRACE_DIR)


def _drop_oldest_runs(runs: Path, keep: int, current: str) -> None:
    """Remove the run folders there but the newest ``keep`` (never the current run's), so that the temporary folder
    does not grow run after run; anything else there is left alone, and a folder that cannot be removed stays."""
    try:
        with os.scandir(runs) as entries:
            folders = [entry.name for entry in entries if entry.is_dir(follow_symlinks=False)]
    except OSError:  # no such folder yet, or unreadable: nothing to drop
        return
    names = sorted(name for name in folders if name != current and RUN_ID_PATTERN.fullmatch(name))
    for name in names[: max(0, len(names) - keep)]:  # run ids sort by their start time
        shutil.rmtree(runs / name, ignore_errors=True)


def _owner_of(trainer: pl.Trainer, here: str) -> str | None:
    for callback in trainer.checkpoint_callbacks:
        if _writes_into(callback, here):  # a dirpath is None until its setup where not given: never the log folder
            return "a ModelCheckpoint"
    # Lightning sets the profiler up before the callbacks: its folder is known here (the one given, else log_dir).
    if not trainer.loggers and getattr(trainer.profiler, "filename", None) and _writes_into(trainer.profiler, here):
        return "the Trainer's profiler"
    return None


def _writes_into(writer: object, here: str) -> bool:
    dirpath = getattr(writer, "dirpath", None)
    return dirpath is not None and os.path.realpath(str(dirpath)) == here
