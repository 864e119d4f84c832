"""Where MemTrace's step time goes on CPU with the defaults: each part per step, beside the plain step, in one run.

Usage: python benchmarks/overhead_breakdown.py [--rounds 3] [--steps 40] [--threads 1,2] [--batch-size 4]
       [--seq-len 128]

Runs the tiny Qwen2 of ``benchmarks/overhead.py`` (AdamW, batch 4 x 128 by default) plain, plain with MemTrace's
session open (see "in the step" below) and with ``MemTrace()``, alternating round by round, each run in a process of
its own. In the MemTrace run every part below is timed in the process (wall time, after the warm-up steps) and
printed in ms per step (the mean over the steps: the reports are read about once a second) and as a share of the
plain step (also a mean):

- close: torch closing the allocator-reports session (C++, about 1 µs per report)
- read: reading the reports into Python (one event object, its fields object and three fields per report)
- count: counting them (allocated, peak, the marks where rows were taken, the history)
- reopen: opening the next session
- rows: naming the rows' storages (parameters, gradients, optimizer state, inputs, saved activations)
- gc: Python's garbage collections during the steps (inside MemTrace's hooks or not)
- other hooks: the rest of MemTrace's hooks (stages, marks, CSV lines)
- in the step: what is left of the difference between the two step times. The session's recording inside torch's
  operators is not it: the line "session step" is the plain run with the session open all along and nothing read
  (no MemTrace), within noise of the plain step. The line "page faults" shows what is: heap pages that the C library
  hands back to the system when MemTrace frees what it read (a free of 64 KiB or more, or one that joins free
  neighbours to that size, trims a large free top of the heap) and the next step faults in again, in the kernel

``close + read`` is the floor of reading every report exactly, whatever MemTrace does with the reports; the line
"floor" prints it as a ratio to the plain step.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import resource
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # noqa: E402  (benchmarks/overhead.py: the same model, data and Trainer)

import lightning.pytorch as pl  # noqa: E402
from lightning_memtrace.capture import recorder, reports_backend, rows, torch_private  # noqa: E402

#: (owner, method, part): the calls timed, each counted in its part.
_TIMED = (
    (torch_private.MemoryOnlySession, "disable", "close"),
    (reports_backend.AllocatorReports, "_events", "read"),
    (reports_backend.ReportsBackend, "apply_columns", "count"),
    (reports_backend.AllocatorReports, "_open", "reopen"),
    (rows.RowReader, "defer", "rows"),
    (rows.RowReader, "read", "rows"),
)
#: MemTrace's entry points from its hooks (a call inside another one is not counted twice).
_HOOKS = ("begin_batch", "mark_forward_done", "mark_backward_done", "_after_optimizer_step", "end_batch", "stop")
PARTS = ("close", "read", "count", "reopen", "rows", "gc", "other hooks", "in the step")


def _minor_page_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class _Parts:
    """Wall time per part, from the first step after the warm-up on."""

    def __init__(self) -> None:
        self.seconds: Counter[str] = Counter()
        self.reports = 0
        self.armed = False
        self._depth = 0
        self._gc_start = 0.0
        #: Minor page faults of the process from the first step after the warm-up to the end of training.
        self.faults = 0
        self._faults_at_arm = 0

    def wrap(self, owner: Any, name: str, part: str) -> None:
        method = getattr(owner, name)

        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.armed:
                return method(*args, **kwargs)
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start

        setattr(owner, name, timed)

    def wrap_hook(self, name: str) -> None:
        method = getattr(recorder.MemoryRecorder, name)

        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.armed or self._depth:
                return method(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self._depth -= 1
                self.seconds["hooks"] += time.perf_counter() - start

        setattr(recorder.MemoryRecorder, name, timed)

    def count_reports(self) -> None:
        apply_columns = reports_backend.ReportsBackend.apply_columns

        def counted(backend: Any, reports: Any, *args: Any, **kwargs: Any) -> Any:
            if self.armed:
                self.reports += len(reports.times)
            return apply_columns(backend, reports, *args, **kwargs)

        reports_backend.ReportsBackend.apply_columns = counted  # type: ignore[method-assign]

    def arm(self) -> None:
        self.armed = True
        self._faults_at_arm = _minor_page_faults()

    def end(self) -> None:
        if self.armed:
            self.faults = _minor_page_faults() - self._faults_at_arm

    def on_gc(self, phase: str, info: dict[str, int]) -> None:
        if not self.armed:
            return
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            seconds = time.perf_counter() - self._gc_start
            self.seconds["gc"] += seconds
            if self._depth:
                self.seconds["gc in hooks"] += seconds


class _Arm(pl.Callback):
    def __init__(self, parts: _Parts, warmup: int) -> None:
        self.parts, self.warmup = parts, warmup

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.warmup:
            self.parts.arm()

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.parts.end()


class _OpenSession(pl.Callback):
    """MemTrace's allocator-reports session, open from the start of training to its end and never read (no MemTrace):
    what recording the reports costs inside torch's operators."""

    def __init__(self) -> None:
        self.session: reports_backend.AllocatorReports | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        reports_backend.track_every_cpu_block()  # as MemTrace() does when it is made
        self.session = reports_backend.AllocatorReports(other_threads_blocks=False)
        self.session.start()

    def teardown(self, trainer: pl.Trainer, pl_module: Any, stage: str) -> None:
        # after the last step's timing: reading what the whole run recorded is not the recording's cost
        if self.session is not None:
            self.session.stop()
            self.session = None


def child(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    parts = _Parts()
    extra: tuple[pl.Callback, ...] = (_Arm(parts, args.warmup),)
    if variant == "session":
        variant, extra = "plain", (*extra, _OpenSession())
    if variant == "memtrace":
        parts.count_reports()
        for owner, name, part in _TIMED:
            parts.wrap(owner, name, part)
        for name in _HOOKS:
            parts.wrap_hook(name)
    gc.callbacks.append(parts.on_gc)
    with TemporaryDirectory() as root:
        times = overhead.run(variant, args, root, extra_callbacks=extra)
    steps = max(1, len(times))
    seconds = {part: total / steps for part, total in parts.seconds.items()}
    return {"times": times, "seconds": seconds, "reports": parts.reports / steps, "faults": parts.faults / steps}


def report(
    plain: list[dict[str, Any]],
    session: list[dict[str, Any]],
    traced: list[dict[str, Any]],
    threads: int,
    args: argparse.Namespace,
) -> None:
    # means, as the parts are: the reports are read about once a second, in a few steps of the run
    plain_step = statistics.fmean(t for run in plain for t in run["times"])
    session_step = statistics.fmean(t for run in session for t in run["times"])
    traced_step = statistics.fmean(t for run in traced for t in run["times"])
    per_step = {key: statistics.median(run["seconds"].get(key, 0.0) for run in traced) for key in traced[0]["seconds"]}
    parts = {key: per_step.get(key, 0.0) for key in ("close", "read", "count", "reopen", "rows", "gc")}
    hooks, gc_in_hooks = per_step.get("hooks", 0.0), per_step.get("gc in hooks", 0.0)
    parts["other hooks"] = max(0.0, hooks - gc_in_hooks - sum(parts[k] for k in PARTS[:5]))
    parts["in the step"] = traced_step - plain_step - hooks - (parts["gc"] - gc_in_hooks)
    reports = statistics.median(run["reports"] for run in traced)
    print(
        f"device=cpu torch={torch.__version__} threads={threads} rounds={args.rounds} "
        f"steps/round={args.steps - args.warmup} batch={args.batch_size}x{args.seq_len} reports/step={reports:,.0f}"
    )
    print(f"{'':<14}{'ms/step':>10}{'of plain':>10}")
    print(f"{'plain step':<14}{plain_step * 1e3:>10.2f}{1:>10.3f}")
    print(f"{'session step':<14}{session_step * 1e3:>10.2f}{session_step / plain_step:>10.3f}")
    print(f"{'defaults step':<14}{traced_step * 1e3:>10.2f}{traced_step / plain_step:>10.3f}")
    for key in PARTS:
        print(f"{key:<14}{parts[key] * 1e3:>10.2f}{parts[key] / plain_step:>10.1%}")
    floor = parts["close"] + parts["read"]
    print(f"{'floor':<14}{floor * 1e3:>10.2f}{1 + floor / plain_step:>10.3f}  (close + read, as a ratio)")
    plain_faults = statistics.median(run["faults"] for run in plain)
    traced_faults = statistics.median(run["faults"] for run in traced)
    print(f"{'page faults':<14}{plain_faults:>10,.0f}{traced_faults:>10,.0f}  (minor, per step: plain, defaults)",
          flush=True)


def main() -> int:
    args = overhead.parse_run_args(argparse.ArgumentParser())
    if args.child:
        print(json.dumps(child(args.child, args)))
        return 0
    for threads in [int(t) for t in args.threads.split(",")]:
        runs: dict[str, list[dict[str, Any]]] = {"plain": [], "session": [], "memtrace": []}
        for _ in range(args.rounds):
            for variant, results in runs.items():
                result = overhead.run_child(__file__, variant, threads, args)
                if result is not None:
                    results.append(result)
        if not all(runs.values()):
            print(f"threads={threads}: a run failed", file=sys.stderr)
            return 1
        report(runs["plain"], runs["session"], runs["memtrace"], threads, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
