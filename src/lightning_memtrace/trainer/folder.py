"""Where MemTrace writes in a fit: in the logger's folder, never into a folder a ``ModelCheckpoint`` saves into."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import lightning.pytorch as pl

from lightning_memtrace.files import MEMTRACE_DIR, TEMP_FOLDER


def memtrace_folder(trainer: pl.Trainer, run_id: str) -> tuple[Path, Path | None]:
    """``<trainer.log_dir>/memtrace`` (with ``logger=False``, Lightning's ``log_dir`` is ``default_root_dir``), and
    None; or, where a ``ModelCheckpoint`` saves into that very folder, ``<temp>/lightning_memtrace/<run_id>`` and the
    folder kept clear.

    A checkpoint folder holds checkpoints only (scripts and tests list it, or take its newest entry, to find the last
    checkpoint), so MemTrace puts no folder there. ``trainer.log_dir`` broadcasts across ranks: call this where every
    rank is (``setup``), never in an exception handler.
    """
    parent = Path(trainer.log_dir or trainer.default_root_dir)
    if _checkpoints_saved_into(trainer, parent):
        return Path(tempfile.gettempdir()) / TEMP_FOLDER / run_id, parent
    return parent / MEMTRACE_DIR, None


def _checkpoints_saved_into(trainer: pl.Trainer, folder: Path) -> bool:
    here = os.path.realpath(folder)
    for callback in trainer.checkpoint_callbacks:
        dirpath = getattr(callback, "dirpath", None)  # None until its setup where not given: never the log folder
        if dirpath is not None and os.path.realpath(str(dirpath)) == here:
            return True
    return False
