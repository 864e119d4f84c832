"""Every file name MemTrace writes or looks for, and :func:`rank_of` to read the rank back from one."""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path

#: The folder under a logger's ``log_dir`` that MemTrace writes into.
MEMTRACE_DIR = "memtrace"
#: The folder in the system's temporary folder that holds a fit's folder (named by its run id) where its ``log_dir``
#: is a ``ModelCheckpoint``'s or a profiler's folder (see ``trainer/folder.py``).
TEMP_FOLDER = "lightning_memtrace"

#: The per-phase table of a rank, and the pattern that finds every rank's.
PHASES_GLOB = "phases_rank*.csv"
#: Snapshots and post-mortem pickles a report reads from a log folder.
SNAPSHOT_PATTERNS: tuple[str, ...] = (
    "snapshot_rank*.pickle",
    "snapshot_rank*.pickle.gz",
    "snapshot_rank*.pkl",
    "oom_rank*.pickle",
    "oom_rank*.pickle.gz",
    "oom_rank*.pkl",
)
#: The estimate-vs-measured tables a report shows (searched recursively under a log folder).
ESTIMATE_COMPARISON_GLOB = "**/estimate_vs_measured_rank*.csv"
#: The what-if tables of a fit with ``estimate=True`` a report shows (searched recursively under a log folder).
WHAT_IF_GLOB = "**/what_if_rank*.csv"
#: Prefix of post-mortem files (``oom_rank<R>_step<N>.pickle`` and ``.txt``).
OOM_PREFIX = "oom_"

_RANK = re.compile(r"rank(\d+)")


def phases_filename(rank: int) -> str:
    """``phases_rank<R>.csv``."""
    return f"phases_rank{rank}.csv"


def what_if_filename(rank: int, suffix: str = ".csv") -> str:
    """``what_if_rank<R>.csv`` (one row per remedy) and ``.json`` (all of it: combination, snippet, notes)."""
    return f"what_if_rank{rank}{suffix}"


def window_snapshot_filename(rank: int, first: int, last: int) -> str:
    """``snapshot_rank<R>_steps<a>-<b>.pickle``: the history window of steps ``a`` to ``b``."""
    return f"snapshot_rank{rank}_steps{first}-{last}.pickle"


def step_snapshot_filename(rank: int, step: int) -> str:
    """``snapshot_rank<R>_step<N>.pickle``: a snapshot taken on request."""
    return f"snapshot_rank{rank}_step{step}.pickle"


def oom_basename(rank: int, step: int) -> str:
    """``oom_rank<R>_step<N>``: the post-mortem's pickle and text add ``.pickle`` and ``.txt``."""
    return f"{OOM_PREFIX}rank{rank}_step{step}"


def numbered_name(base: str, n: int) -> str:
    """``<base>.<n>``: what a fit names its file (``base`` + the extension) where an earlier fit's file of that name
    is in the folder, with the smallest free ``n`` from 1 (``snapshot_rank0_steps1-2.1.pickle``)."""
    return f"{base}.{n}"


def is_oom_file(name: str) -> bool:
    return name.startswith(OOM_PREFIX)


def matching_files(folder: str | os.PathLike[str], *patterns: str, recursive: bool = False) -> list[Path]:
    """The files below ``folder`` that match any of ``patterns`` (``glob`` patterns, ``**`` with ``recursive``).

    The folder's own name is a name, never a pattern: a log folder named ``run [a]`` is searched as it is.
    """
    here = glob.escape(os.fspath(folder))
    return [Path(p) for pattern in patterns for p in glob.glob(os.path.join(here, pattern), recursive=recursive)]


def rank_of(name: str) -> int | None:
    """The rank a MemTrace file name carries (``..._rank3...`` → 3), or None."""
    found = _RANK.search(name)
    return int(found.group(1)) if found else None
