"""The floor of exact counting on CPU: MemTrace's defaults beside the same run with MemTrace's own work cut out.

Usage: python benchmarks/overhead_floor.py [--rounds 3] [--steps 40] [--threads 1,2] [--batch-size 4] [--seq-len 128]

Same model, data, Trainer and start-to-start timing as ``benchmarks/overhead.py``, variants interleaved round by round,
each run in a process of its own:

- plain: no callback
- memtrace: ``MemTrace()`` defaults
- reads_only: the defaults, but the reports read at each drain are not counted (the rows' marks are still reached,
  so rows are written, with the bytes counted when MemTrace started); what is left is torch closing, reopening and
  handing over the allocator's reports, which every exact reading of them pays
- reads_only_no_naming: as ``reads_only``, and the rows name no storages either (no categories)

The two cut-down variants write wrong numbers: they exist to show how much of the defaults' cost is MemTrace's own
Python work and how much is the profiler session's, whatever MemTrace does with the reports.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # noqa: E402  (benchmarks/overhead.py: the same model, data and Trainer)

from lightning_memtrace.capture import reports_backend, rows  # noqa: E402
from lightning_memtrace.capture.allocation_state import RowMark  # noqa: E402
from lightning_memtrace.types import Category  # noqa: E402

VARIANTS = ("plain", "memtrace", "reads_only", "reads_only_no_naming")


def _reach_marks_only(self: reports_backend.ReportsBackend, reports: Any, other_threads: Any = None) -> None:
    self._reach_marks(len(self._marks))


def _defer_unnamed(self: rows.RowReader, place: rows.RowPlace) -> None:
    tracker = self.tracker
    assert tracker is not None
    row = RowMark(tracker.stage, tracker.metadata, payload=(place, dict.fromkeys(Category, 0)))
    tracker.mark(row)
    self.deferred.append(row)


#: What each cut-down variant replaces: (class, method name, replacement).
CUTS: dict[str, tuple[tuple[type, str, Any], ...]] = {
    "reads_only": ((reports_backend.ReportsBackend, "apply_columns", _reach_marks_only),),
    "reads_only_no_naming": (
        (reports_backend.ReportsBackend, "apply_columns", _reach_marks_only),
        (rows.RowReader, "defer", _defer_unnamed),
    ),
}


def cut_down(variant: str) -> str:
    """Patch MemTrace for a cut-down variant; returns the ``overhead.run`` variant to run.

    Raises:
        AttributeError: A method to replace is gone (renamed): the variant would otherwise time the full defaults.
    """
    for owner, name, replacement in CUTS.get(variant, ()):
        getattr(owner, name)
        setattr(owner, name, replacement)
    return "memtrace" if variant != "plain" else variant


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = overhead.parse_run_args(parser)
    if args.child:
        with TemporaryDirectory() as root:
            print(json.dumps(overhead.run(cut_down(args.child), args, root)))
        return 0
    overhead.measure_rounds(__file__, args.variants.split(","), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
