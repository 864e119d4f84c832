"""The history window: the steps for which the allocator's history is recorded, and the snapshots written from it."""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from lightning_memtrace.capture import cuda_history
from lightning_memtrace.capture.categories import NamedStorages
from lightning_memtrace.capture.config import RecorderConfig
from lightning_memtrace.capture.cuda_names import Naming, name_allocations, naming_of
from lightning_memtrace.capture.outputs import RecorderFiles
from lightning_memtrace.capture.tracker import AllocationTracker
from lightning_memtrace.files import step_snapshot_filename, window_snapshot_filename
from lightning_memtrace.schema import HEADER_KEY, build_header
from lightning_memtrace.types import STAGE_AFTER_PHASE, Phase, Stage

#: The key of torch's snapshot that holds ``record_function`` ranges (and MemTrace's phases).
ANNOTATIONS_KEY = "external_annotations"
#: Namings kept for a CUDA snapshot: a window's rows (five a step) with room to spare.
NAMINGS_KEPT = 64


def phase_annotations(
    marks: Iterable[tuple[int, str, int]], since_us: int, now_us: int, device_index: int
) -> list[dict[str, Any]]:
    """MemTrace's phases as torch's ``external_annotations``: a ``START`` and an ``END`` entry per stage of a step.

    Each phase mark ``(step, phase, time_us)`` starts the stage that follows it (:data:`STAGE_AFTER_PHASE`: forward
    from ``batch_start`` to ``after_forward``, backward, optimizer_step, after_step, validation) and ends the previous
    one; the last stage ends ``now_us``. ``outside`` is no range. Ranges that end before ``since_us`` are left out.
    """
    ordered = sorted((t, phase) for _, phase, t in marks)
    out: list[dict[str, Any]] = []
    for k, (start, phase) in enumerate(ordered):
        try:
            stage = STAGE_AFTER_PHASE[Phase(phase)]
        except ValueError:
            continue
        end = ordered[k + 1][0] if k + 1 < len(ordered) else now_us
        if stage is Stage.OUTSIDE or end < since_us:
            continue
        for stage_name, t in (("START", start), ("END", max(end, start))):
            out.append({"name": stage.value, "stage": stage_name, "time_us": t, "device": device_index})
    return out


def _first_time_us(snapshot: dict[str, Any]) -> int:
    """The time of the oldest event in the snapshot's traces (0 when none has a time)."""
    times = [
        e["time_us"]
        for trace in snapshot.get("device_traces") or []
        for e in trace[:1]
        if isinstance(e, dict) and isinstance(e.get("time_us"), int)
    ]
    return min(times, default=0)


def merge_annotations(snapshot: dict[str, Any], extra: list[dict[str, Any]]) -> None:
    """Add ``extra`` to the snapshot's ``external_annotations`` (torch's own, if any), ordered by time (in place).

    At equal times the order of the lists is kept: torch's entries first, then ``extra`` in its order (a phase's
    ``END`` before the next one's ``START``).
    """
    existing = snapshot.get(ANNOTATIONS_KEY)
    merged = [a for a in existing if isinstance(a, dict)] if isinstance(existing, list) else []
    merged.extend(extra)
    merged.sort(key=lambda a: a["time_us"] if isinstance(a.get("time_us"), int) else 0)
    snapshot[ANNOTATIONS_KEY] = merged


def cuda_allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" and torch.cuda.is_available() else 0


def cuda_reserved(device: torch.device) -> int:
    return torch.cuda.memory_reserved(device) if device.type == "cuda" and torch.cuda.is_available() else 0


@dataclasses.dataclass(eq=False)
class HistoryWindow:
    """Opens the window ``history_skip_steps`` steps into the run, for ``history_steps`` steps, once per recorder (in
    a run known to end before that, over its last ``history_steps`` steps).

    Inside it the tracker (or, on CUDA, the caching allocator) records every allocation with its stack; at its end the
    snapshot ``snapshot_rank<R>_steps<a>-<b>.pickle`` is written with MemTrace's own header (``snapshot["memtrace"]``:
    steps, device, rank, category totals, the phases' times).

    Args:
        config: The recorder's settings (``history``, ``history_skip_steps``, ``history_steps``, ``max_entries``).
        device: The measured device.
        rank: Put in the header and the file name.
        tracker: The allocation tracker, or None (CUDA records its own history).
        files: Where snapshots are written.
        classify: Names the live storages now (for the header's category totals).
        sync: Takes in the allocator's reports so far.
        warn: Called once per kind of problem with ``(kind, message)``.
        run_id: The run the snapshots go with (put in the header).
    """

    config: RecorderConfig
    device: torch.device
    rank: int
    tracker: AllocationTracker | None
    files: RecorderFiles
    classify: Callable[[], NamedStorages]
    sync: Callable[[], None]
    warn: Callable[[str, str], None]
    run_id: str = ""
    #: The last step the run will reach, where known (the Trainer's ``estimated_stepping_batches`` less one): a run
    #: that ends before the window would open gets one over its last steps instead of none.
    run_last_step: int | None = None
    #: DDP's gradient buckets beside the gradients (see :mod:`~lightning_memtrace.capture.ddp_buckets`), put in the
    #: header.
    ddp_bucket_bytes: int = 0
    _first_step: int | None = dataclasses.field(default=None, init=False)
    # The step of the latest training batch: validation after the last one takes rows at the next step's number.
    _last_training_step: int | None = dataclasses.field(default=None, init=False)
    _open: tuple[int, int, int] | None = dataclasses.field(default=None, init=False)  # (first, last step, time_us)
    _start_allocated: int = dataclasses.field(default=0, init=False)
    _done: bool = dataclasses.field(default=False, init=False)
    # The user records the CUDA allocator's history already: the window reads it and leaves it on, as it is.
    _users_history: bool = dataclasses.field(default=False, init=False)

    def __post_init__(self) -> None:
        #: ``(step, phase, time_us)`` of every row, for the snapshot header's phase bands.
        self.phase_marks: deque[tuple[int, str, int]] = deque(maxlen=max(1000, self.config.max_entries // 10))
        #: The live storages' addresses by category at each naming inside the window (CUDA without the tracker).
        self.namings: deque[Naming] = deque(maxlen=NAMINGS_KEPT)

    @property
    def is_open(self) -> bool:
        return self._open is not None

    def last_step(self) -> int | None:
        return self._open[1] if self._open is not None else None

    def maybe_open(self, step: int) -> None:
        """At the start of a training batch: open the window if this step is its first."""
        if self._first_step is None:
            self._first_step = step
        self._last_training_step = step
        config = self.config
        if not config.history or config.history_steps == 0 or self._done or self._open is not None:
            return
        first = self._first_step + config.history_skip_steps
        if self.run_last_step is not None and first > self.run_last_step:
            first = max(self._first_step, self.run_last_step - config.history_steps + 1)
        if step < first:
            return
        now_us = time.time_ns() // 1000
        try:
            if not self._start_recording():
                return
        except Exception as error:
            self._done = True
            self.warn("history", f"could not start recording memory history: {error!r}")
            return
        last = first + config.history_steps - 1
        if self.run_last_step is not None and step <= self.run_last_step:
            # Closed after the run's last step, not at the end of the fit: validation after it is not in the window.
            last = min(last, self.run_last_step)
        self._open = (step, last, now_us)

    def _start_recording(self) -> bool:
        if self.device.type == "cuda" and self.tracker is None:
            if not cuda_history.cuda_history_supported():
                self._done = True
                self.warn("history", "this torch cannot record the CUDA allocator's history: no snapshot")
                return False
            self._users_history = cuda_history.cuda_history_enabled()
            if not self._users_history:
                cuda_history.start_cuda_history(self.config.max_entries)
        elif self.tracker is not None:
            self.tracker.record_history(True)
            self._start_allocated = self.tracker.counters()[0]  # record_history took the reports in
        else:
            self._done = True
            return False
        return True

    def close(self, step: int) -> Path | None:
        """Stop recording and write the window's snapshot (its last step is ``step`` if the run ended early, or the
        last training batch's, where validation ran after it)."""
        window, self._open = self._open, None
        if window is None:
            return None
        self._done = True
        first, planned_last, since_us = window
        if self._last_training_step is not None:
            step = min(step, self._last_training_step)
        last = max(first, min(planned_last, step))
        try:
            snapshot = self.snapshot_now(since_us)
            snapshot[HEADER_KEY] = self.header(first, last, since_us)
        finally:
            if self.tracker is not None:
                self.tracker.record_history(False)
            elif self.device.type == "cuda":
                cuda_history.tag_allocations("")
                if not self._users_history:
                    cuda_history.stop_cuda_history()
        return self.files.write_snapshot(window_snapshot_filename(self.rank, first, last), snapshot)

    def note_names(self, named: NamedStorages, time_us: int) -> None:
        """The live storages were named at ``time_us``: kept while the window records the CUDA allocator's history,
        for its snapshot's categories (:mod:`~lightning_memtrace.capture.cuda_names`)."""
        if self._open is not None:
            self.namings.append(naming_of(named, time_us))

    def snapshot_now(self, since_us: int = 0, naming: Naming | None = None) -> dict[str, Any]:
        """The allocator's state now and the history its ring buffer holds (since ``since_us``), memory_viz's format.

        ``external_annotations`` holds the ``record_function`` ranges (torch's own on CUDA, the tracker's on CPU) and
        MemTrace's phases (:func:`phase_annotations`), ordered by time. On CUDA its allocations get the categories of
        the namings kept (and ``naming``, one made now).
        """
        now_us = time.time_ns() // 1000
        device_index = self.device.index or 0
        if self.tracker is not None:
            snapshot = self.tracker.snapshot(since_us=since_us, device_index=device_index)
        elif self.device.type == "cuda" and cuda_history.cuda_history_supported():
            snapshot = cuda_history.cuda_snapshot()
            self._name_allocations(snapshot, device_index, [*self.namings, *([naming] if naming else [])])
        else:
            snapshot = {"segments": [], "device_traces": []}
        # Phases before the oldest event the snapshot holds (a step snapshot after a long run) are left out.
        since_us = max(since_us, _first_time_us(snapshot))
        merge_annotations(snapshot, phase_annotations(self.phase_marks, since_us, now_us, device_index))
        return snapshot

    def _name_allocations(self, snapshot: dict[str, Any], device_index: int, namings: list[Naming]) -> None:
        try:
            name_allocations(snapshot, namings, device_index)
        except Exception as error:  # noqa: BLE001 - the snapshot stands without them: readers infer categories
            self.warn("snapshot_categories", f"could not put the rows' categories on the CUDA snapshot: {error!r}")

    def header(self, first: int, last: int, since_us: int) -> dict[str, Any]:
        """MemTrace's part of a snapshot (``snapshot["memtrace"]``)."""
        self.sync()
        totals = self.classify().totals
        tracker = self.tracker
        return build_header(
            device=str(self.device),
            rank=self.rank,
            steps=(first, last),
            allocated_bytes=tracker.counters()[0] if tracker is not None else cuda_allocated(self.device),
            allocated_at_start_bytes=self._start_allocated if tracker is not None else None,
            categories={c.value: v for c, v in totals.items()},
            phases=[
                {"step": step, "phase": phase, "time_us": t} for step, phase, t in self.phase_marks if t >= since_us
            ],
            run=self.run_id,
            category_rules=dict(self.config.category_rules or ()),
            ddp_bucket_bytes=self.ddp_bucket_bytes,
        )

    def write_snapshot(self, step: int, name: str | None = None) -> Path | None:
        """Write the current state (and the history the ring buffer holds) as a snapshot pickle now."""
        snapshot = self.snapshot_now()
        snapshot[HEADER_KEY] = self.header(step, step, 0)
        return self.files.write_snapshot(name or step_snapshot_filename(self.rank, step), snapshot)
