"""The recorder: MemTrace's core, independent of Lightning.

Use it as a context manager around a plain PyTorch loop::

    with MemoryRecorder(model, [optimizer], output_dir="memtrace") as recorder:
        for step, batch in enumerate(loader):
            recorder.begin_batch(batch, step=step)
            loss = model(batch).loss
            recorder.mark_forward_done()
            loss.backward()
            recorder.mark_backward_done()
            optimizer.step()          # a step post-hook takes the after_optimizer_step row
            optimizer.zero_grad()
            recorder.end_batch()

The Lightning callback :class:`~lightning_memtrace.MemTrace` maps Lightning's hooks onto the same calls.
"""

from __future__ import annotations

import os
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_memtrace import cuda_history
from lightning_memtrace.atomic import atomic_write_pickle, atomic_write_text
from lightning_memtrace.categories import CategoryCounter, SavedTensorsRecorder, input_storages, normalize_device
from lightning_memtrace.counters import MemoryCounters, TrackerCounters, allocator_counters
from lightning_memtrace.analysis.postmortem import LiveBlock, PostMortem, largest_blocks_from_snapshot, render_post_mortem
from lightning_memtrace.capture.phases_writer import PhaseCsvWriter
from lightning_memtrace.files import oom_basename, phases_filename, step_snapshot_filename, window_snapshot_filename
from lightning_memtrace.schema import HEADER_KEY, build_header, format_tag
from lightning_memtrace.tracker import (
    AllocationTracker,
    OutOfMemoryEvent,
    RowMark,
    is_out_of_memory,
    requested_bytes_from_message,
)
from lightning_memtrace.types import STAGE_AFTER_PHASE, Category, Phase, PhaseRecord, Stage

#: Deferred rows (see :meth:`MemoryRecorder.flush`) are read at the end of every training batch, and during
#: validation once this many are waiting or this many seconds have passed.
_DEFERRED_ROWS_MAX = 256
_DEFERRED_SECONDS_MAX = 2.0
_CATEGORY_NAMES = {category: category.value for category in Category}


class MemTraceWarning(UserWarning):
    """A problem of MemTrace's own (it never stops training)."""


def _device_of(model: nn.Module | None) -> torch.device:
    if model is not None:
        for tensor in model.parameters():
            return tensor.device
        for tensor in model.buffers():
            return tensor.device
    return torch.device("cpu")


class MemoryRecorder:
    """Measures memory at the phases of each step, records the allocator's history and writes post-mortems.

    Args:
        model: The module being trained (its parameters and their gradients are categorized).
        optimizers: The optimizers; a step post-hook on each takes the ``after_optimizer_step`` row.
        device: The device to measure; defaults to the model's.
        rank: Put in every row and file name.
        output_dir: Folder for ``phases_rank<R>.csv``, snapshots and post-mortems; None writes no files.
        track_allocations: Use an :class:`AllocationTracker` for allocated/peak. None turns it on
            where the device's allocator has no counters (CPU) and off elsewhere.
        history: Record the allocator's history for a window of steps and write a snapshot at its end.
        history_skip_steps: Steps of this run to let pass before the window opens.
        history_steps: Steps in the window.
        max_entries: Ring-buffer size of the history (events).
        frames_min_bytes: Outside the window, the tracker records stacks only for allocations this large.
        post_mortem: Write ``oom_rank<R>_step<N>.pickle`` and ``.txt`` on out-of-memory.
        max_rows: Most rows written to the CSV in one run.
        every_n_steps: Take rows only on steps divisible by this.
        max_snapshots: Most snapshot pickles kept in ``output_dir`` by this recorder (oldest removed).
        on_record: Called with each :class:`PhaseRecord` taken (the callback logs them).
        allocation_backend: How the tracker sees allocations (see :class:`AllocationTracker`): ``"auto"`` reads the
            CPU allocator's own reports where it can (no Python work per operator) and falls back to the dispatch
            mode; ``"dispatch"`` always uses the dispatch mode (for a run profiled with ``torch.profiler``);
            ``"reports"`` insists on the reports.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        *,
        device: torch.device | str | None = None,
        rank: int = 0,
        output_dir: str | os.PathLike | None = None,
        track_allocations: bool | None = None,
        history: bool = True,
        history_skip_steps: int = 1,
        history_steps: int = 2,
        max_entries: int = 100_000,
        frames_min_bytes: int = 16 * 1024**2,
        post_mortem: bool = True,
        max_rows: int | None = 1_000_000,
        every_n_steps: int = 1,
        max_snapshots: int = 10,
        on_record: Callable[[PhaseRecord], None] | None = None,
        allocation_backend: str = "auto",
    ) -> None:
        self.model = model
        self.device = normalize_device(device if device is not None else _device_of(model))
        self.rank = rank
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.history = history
        self.history_skip_steps = max(0, int(history_skip_steps))
        self.history_steps = max(0, int(history_steps))
        self.max_entries = max_entries
        self.post_mortem_enabled = post_mortem
        self.max_rows = max_rows
        self.every_n_steps = max(1, int(every_n_steps))
        self.max_snapshots = max(1, int(max_snapshots))
        self.on_record = on_record

        self._allocator_counters = allocator_counters(self.device)
        if track_allocations is None:
            track_allocations = self._allocator_counters is None
        self.tracker: AllocationTracker | None = (
            AllocationTracker(
                self.device, max_entries=max_entries, frames_min_bytes=frames_min_bytes, backend=allocation_backend
            )
            if track_allocations
            else None
        )
        self.counters: MemoryCounters | None = (
            self._allocator_counters if self._allocator_counters is not None
            else TrackerCounters(self.tracker) if self.tracker is not None else None
        )
        self.categories = CategoryCounter(self.device, model, optimizers)
        self.saved = SavedTensorsRecorder(self.device)

        self.step = 0
        self.epoch = 0
        self.batch_idx = 0
        self.stage = Stage.OUTSIDE
        self.training = False
        self.started = False
        self.records: deque[PhaseRecord] = deque(maxlen=2048)
        self.phase_marks: deque[tuple[int, str, int]] = deque(maxlen=max(1000, max_entries // 10))
        self.files: list[Path] = []
        self.snapshots: list[Path] = []
        self.rows_written = 0

        self._inputs: dict[int, weakref.ref] = {}
        self._in_batch = False
        self._forward_marked = False
        self._stepped_this_batch = False
        self._take_rows = True
        self._step_hooks: list[Any] = []
        self._step_depth: dict[int, int] = {}
        self._csv: PhaseCsvWriter | None = None
        self._outputs_ok = self.output_dir is not None
        self._warned: set[str] = set()
        self._first_step: int | None = None
        self._window: tuple[int, int, int] | None = None  # (first step, last step, start time_us)
        self._window_start_allocated = 0
        self._history_done = False
        self._oom: dict[str, Any] | None = None
        self._deferred: deque[RowMark] = deque()
        # Validation rows: the model states (parameters, gradients, optimizer state) named once per validation run,
        # with their totals and labels (nothing trains meanwhile), and the inputs named per row.
        self._model_states: tuple[dict, dict[Category, int], list, list] | None = None
        self._last_sync = time.monotonic()

    # ------------------------------------------------------------------------------------------------ lifecycle
    def start(self) -> MemoryRecorder:
        if self.started:
            return self
        self.started = True
        if self.tracker is not None:
            self.tracker.oom_listeners.append(self._on_tracker_oom)
            self.tracker.start()
            if self.tracker.fallback_reason is not None:
                self._warn(
                    "backend",
                    f"counting CPU memory with the dispatch mode (slower) instead of the allocator's reports: "
                    f"{self.tracker.fallback_reason}",
                )
        for optimizer in self.categories.optimizers:
            self._hook_optimizer(optimizer)
        if self.post_mortem_enabled and self.device.type == "cuda":
            cuda_history.add_cuda_oom_listener(self)
        self._adopt_known()
        if self.counters is not None:
            self.counters.read()
        return self

    def stop(self) -> None:
        """Write the open history window, remove every hook and leave the dispatch mode. Safe to call twice."""
        if not self.started:
            return
        self.started = False
        try:
            if self._window is not None:
                self._close_window()
        finally:
            self.saved.pop()
            for handle in self._step_hooks:
                handle.remove()
            self._step_hooks.clear()
            cuda_history.remove_cuda_oom_listener(self)
            if self.tracker is not None:
                if self._on_tracker_oom in self.tracker.oom_listeners:
                    self.tracker.oom_listeners.remove(self._on_tracker_oom)
                self.tracker.stop()
                self._emit_deferred()
            if self._csv is not None:
                self._csv.close()
                self._csv = None

    def __enter__(self) -> MemoryRecorder:
        return self.start()

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        try:
            if exc is not None and is_out_of_memory(exc):
                self.write_post_mortem(exc)
        finally:
            self.stop()

    def add_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        for optimizer in optimizers:
            if optimizer not in self.categories.optimizers:
                self.categories.optimizers.append(optimizer)
                self.categories.refresh()
                if self.started:
                    self._hook_optimizer(optimizer)

    def _hook_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        register = getattr(optimizer, "register_step_post_hook", None)
        register_pre = getattr(optimizer, "register_step_pre_hook", None)
        if register is None or register_pre is None:
            self._warn("hooks", f"{type(optimizer).__name__} has no step hooks: no after_optimizer_step rows")
            return
        self._step_hooks.append(register_pre(self._before_optimizer_step))
        self._step_hooks.append(register(self._after_optimizer_step))

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # A subclass whose step() calls super().step() fires the hooks twice, nested: count the depth.
        self._step_depth[id(optimizer)] = self._step_depth.get(id(optimizer), 0) + 1

    # ------------------------------------------------------------------------------------------------ phases
    def begin_batch(self, batch: Any = None, step: int = 0, epoch: int = 0, batch_idx: int = 0, training: bool = True) -> None:
        """Take the ``batch_start`` (or ``val_batch_start``) row; in training, start collecting saved activations."""
        self.step, self.epoch, self.batch_idx, self.training = int(step), int(epoch), int(batch_idx), training
        self._in_batch = True
        self._forward_marked = not training
        self._stepped_this_batch = False
        self._take_rows = self.step % self.every_n_steps == 0
        self.saved.pop()
        self.saved.clear()
        if training or self._model_states is None:
            self._model_states = None
            self.categories.refresh()
        self._inputs = {
            key: weakref.ref(storage) for key, storage in input_storages(batch, self.device).items()
        } if batch is not None else {}
        if training:
            if self._first_step is None:
                self._first_step = self.step
            self._maybe_open_window()
        self._record(Phase.BATCH_START if training else Phase.VAL_BATCH_START)
        if training and torch.is_grad_enabled() and not self.saved.push():
            self._warn("saved", f"activations are not measured: {self.saved.unavailable_reason}")

    def mark_forward_done(self) -> None:
        """Take the ``after_forward`` row (once per batch; later calls are ignored)."""
        if not self._in_batch or self._forward_marked:
            return
        self._forward_marked = True
        self.saved.pop()
        self._record(Phase.AFTER_FORWARD)

    def mark_backward_done(self) -> None:
        """Take the ``after_backward`` row."""
        if not self._in_batch:
            return
        self.mark_forward_done()
        self._record(Phase.AFTER_BACKWARD)

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        depth = self._step_depth.get(id(optimizer), 1) - 1
        self._step_depth[id(optimizer)] = max(0, depth)
        if depth > 0:
            return
        try:
            self._stepped_this_batch = True
            self._record(Phase.AFTER_OPTIMIZER_STEP)
        except Exception as error:  # a hook inside torch: never let it break the step
            self._warn("internal", f"MemTrace failed after the optimizer step and stops measuring: {error!r}")
            self.stop()

    def end_batch(self, next_step: int | None = None) -> None:
        """Take the ``batch_end`` (or ``val_batch_end``) row; close the history window when its last step is done.

        Args:
            next_step: The step number after this batch (Lightning's ``global_step``); defaults to ``step + 1`` if an
                optimizer stepped in this batch, else ``step``.
        """
        if not self._in_batch:
            return
        self.saved.pop()
        self._record(Phase.BATCH_END if self.training else Phase.VAL_BATCH_END)
        self._in_batch = False
        self._inputs = {}
        self.saved.clear()
        if self._deferred and (
            self.training
            or len(self._deferred) >= _DEFERRED_ROWS_MAX
            or time.monotonic() - self._last_sync >= _DEFERRED_SECONDS_MAX
        ):
            self._sync()
        if self.training:
            if next_step is None:
                next_step = self.step + (1 if self._stepped_this_batch else 0)
            if self._window is not None and next_step > self._window[1]:
                self._close_window()

    # ------------------------------------------------------------------------------------------------ measuring
    def _live_inputs(self) -> dict[int, torch.UntypedStorage]:
        out = {}
        for key, ref in self._inputs.items():
            storage = ref()
            if storage is not None:
                out[key] = storage
        return out

    def _adopt_known(self) -> dict[int, tuple[Category, torch.UntypedStorage]]:
        classified = self.categories.classify(
            inputs=self._live_inputs(), saved=self.saved.live_storages() if self.training else None
        )
        if self.tracker is not None:
            self.tracker.label(classified)
        return classified

    def measure(self, phase: Phase) -> PhaseRecord:
        """Measure now, without writing: allocated, reserved, peak since the last measurement, and categories."""
        self._sync()
        return self._measure(phase)

    def flush(self) -> None:
        """Read the allocator's reports now and deliver every row still waiting for them (CSV, ``on_record``).

        With the CPU allocator's reports (the default on CPU, outside the history window), a row is taken where it
        happens but its allocated and peak bytes are read from the report stream later: at the end of each training
        batch, during validation every few hundred rows or seconds, and here.
        """
        self._sync()

    def _sync(self) -> None:
        tracker = self.tracker
        if tracker is None:
            return
        tracker.sync()
        self._last_sync = time.monotonic()
        if tracker.session_lost:
            self._warn(
                "session",
                "another profiler took over the profiling session MemTrace reads the CPU allocator's reports "
                "from; allocated/peak miss what was freed meanwhile (pass allocation_backend='dispatch' to "
                "profile and measure together).",
            )
        self._emit_deferred()

    def _measure(self, phase: Phase) -> PhaseRecord:
        if self.training or self.tracker is not None:
            totals = CategoryCounter.totals(self._adopt_known())
            if not self.training:
                totals[Category.ACTIVATIONS] = 0
        else:
            totals = self._validation_totals()
        named = sum(totals.values())
        if self.counters is not None:
            allocated, reserved, peak = self.counters.read()
        else:
            allocated = reserved = peak = named
        return PhaseRecord(
            step=self.step,
            epoch=self.epoch,
            batch_idx=self.batch_idx,
            rank=self.rank,
            phase=phase,
            time_s=time.time(),
            allocated_bytes=int(allocated),
            reserved_bytes=int(reserved),
            peak_bytes=int(max(peak, allocated)),
            parameters_bytes=totals[Category.PARAMETERS],
            gradients_bytes=totals[Category.GRADIENTS],
            optimizer_state_bytes=totals[Category.OPTIMIZER_STATE],
            activations_bytes=totals[Category.ACTIVATIONS],
            inputs_bytes=totals[Category.INPUTS],
            other_bytes=max(0, int(allocated) - named),
        )

    def _record(self, phase: Phase) -> PhaseRecord | None:
        tracker = self.tracker
        deferring = tracker is not None and tracker.deferring
        if tracker is not None and not deferring:
            self._sync()  # allocations reported since the last row belong to the stage that is ending
        self._set_stage(STAGE_AFTER_PHASE[phase])
        now_us = time.time_ns() // 1000
        self.phase_marks.append((self.step, phase.value, now_us))
        if deferring:
            assert tracker is not None
            self._defer_row(tracker, phase, now_us / 1e6)
            return None
        if not self._take_rows:
            return None
        record = self._measure(phase)
        self._deliver([record])
        return record

    def _defer_row(self, tracker: AllocationTracker, phase: Phase, time_s: float) -> None:
        """Take a row whose categories are named now and whose allocated/peak bytes are read at its mark."""
        if not self._take_rows:
            tracker.mark(RowMark(tracker.stage, tracker.metadata))  # the stage still changes there
            return
        if self.training:
            classified = self.categories.classify(inputs=self._live_inputs(), saved=self.saved.live_storages())
            totals, labels, foreign = self._row_parts(tracker, classified)
        else:
            totals, labels, foreign = self._validation_row_parts(tracker)
        payload = (phase, self.step, self.epoch, self.batch_idx, time_s, totals)
        row = RowMark(tracker.stage, tracker.metadata, labels, foreign, payload)
        tracker.mark(row)
        self._deferred.append(row)

    @staticmethod
    def _row_parts(
        tracker: AllocationTracker, classified: dict[int, tuple[Category, torch.UntypedStorage]]
    ) -> tuple[dict[Category, int], list[tuple[int, str]], list[tuple[weakref.ref, str]]]:
        """Totals by category, ``(address, category)`` labels, and the storages at addresses not counted yet."""
        totals = {category: 0 for category in Category}
        labels: list[tuple[int, str]] = []
        foreign: list[tuple[weakref.ref, str]] = []
        counted = tracker.counts_address
        for category, storage in classified.values():
            totals[category] += storage.nbytes()
            addr = storage.data_ptr()
            name = _CATEGORY_NAMES[category]
            labels.append((addr, name))
            if not counted(addr):
                foreign.append((weakref.ref(storage), name))
        return totals, labels, foreign

    def _validation_row_parts(
        self, tracker: AllocationTracker
    ) -> tuple[dict[Category, int], list[tuple[int, str]], list[tuple[weakref.ref, str]]]:
        first = self._model_states is None
        if self._model_states is None:
            states = self.categories.classify()
            self._model_states = (states, *self._row_parts(tracker, states))
        states, state_totals, state_labels, state_foreign = self._model_states
        inputs = {
            key: (Category.INPUTS, storage)
            for key, storage in self._live_inputs().items()
            if key not in states and storage.device == self.device
        }
        totals, labels, foreign = self._row_parts(tracker, inputs)
        for category, nbytes in state_totals.items():
            totals[category] += nbytes
        totals[Category.ACTIVATIONS] = 0
        if first:  # the model states keep their labels for the rest of the validation run
            labels, foreign = state_labels + labels, state_foreign + foreign
        return totals, labels, foreign

    def _validation_totals(self) -> dict[Category, int]:
        """A validation row's categories without a tracker: the model states named once per validation run."""
        if self._model_states is None:
            states = self.categories.classify()
            self._model_states = (states, CategoryCounter.totals(states), [], [])
        states, state_totals, _, _ = self._model_states
        totals = dict(state_totals)
        for key, storage in self._live_inputs().items():
            if key not in states and storage.device == self.device:
                totals[Category.INPUTS] += storage.nbytes()
        totals[Category.ACTIVATIONS] = 0
        return totals

    def _emit_deferred(self) -> None:
        """Deliver, in order, the deferred rows whose marks the report stream has reached."""
        rows = self._deferred
        records = []
        while rows and rows[0].allocated is not None:
            row = rows.popleft()
            phase, step, epoch, batch_idx, time_s, totals = row.payload
            allocated = int(row.allocated)
            named = sum(totals.values())
            records.append(
                PhaseRecord(
                    step=step,
                    epoch=epoch,
                    batch_idx=batch_idx,
                    rank=self.rank,
                    phase=phase,
                    time_s=time_s,
                    allocated_bytes=allocated,
                    reserved_bytes=allocated,
                    peak_bytes=int(max(row.peak or 0, allocated)),
                    parameters_bytes=totals[Category.PARAMETERS],
                    gradients_bytes=totals[Category.GRADIENTS],
                    optimizer_state_bytes=totals[Category.OPTIMIZER_STATE],
                    activations_bytes=totals[Category.ACTIVATIONS],
                    inputs_bytes=totals[Category.INPUTS],
                    other_bytes=max(0, allocated - named),
                )
            )
        if records:
            self._deliver(records)

    def _deliver(self, records: list[PhaseRecord]) -> None:
        self.records.extend(records)
        self._write_rows(records)
        if self.on_record is not None:
            for record in records:
                self.on_record(record)

    def _set_stage(self, stage: Stage) -> None:
        self.stage = stage
        metadata = format_tag(stage, self.step)
        if self.tracker is not None:
            self.tracker.set_stage(stage.value, metadata)
        if self._window is not None and self.device.type == "cuda":
            cuda_history.set_allocation_metadata(metadata)

    # ------------------------------------------------------------------------------------------------ outputs
    def _warn(self, kind: str, message: str) -> None:
        if kind in self._warned:
            return
        self._warned.add(kind)
        prefix = f"[rank {self.rank}] " if self.rank else ""
        warnings.warn(f"{prefix}MemTrace: {message}", MemTraceWarning, stacklevel=3)

    def _output_failed(self, what: str, error: BaseException) -> None:
        self._outputs_ok = False
        if self._csv is not None:
            try:
                self._csv.close()
            except OSError:
                pass
            self._csv = None
        self._warn(
            "output",
            f"could not write {what} in {self.output_dir} ({type(error).__name__}: {error}); MemTrace stops writing "
            "files for this run, training goes on.",
        )

    @property
    def max_allocated_bytes(self) -> int:
        """The highest allocated bytes of the run so far, on the measured device.

        On CUDA, MemTrace resets the device's peak statistics at every row (the only way to learn each phase's peak),
        so ``torch.cuda.max_memory_allocated()`` then reads the peak since the last row; this keeps the run's maximum,
        the peak the statistics held when the recorder started included.
        """
        if self.counters is not None:
            return int(self.counters.max_allocated)
        return max((record.peak_bytes for record in self.records), default=0)

    @property
    def max_reserved_bytes(self) -> int:
        """The highest reserved bytes of the run so far (see :attr:`max_allocated_bytes`)."""
        if self.counters is not None:
            return int(self.counters.max_reserved)
        return max((record.reserved_bytes for record in self.records), default=0)

    @property
    def csv_path(self) -> Path | None:
        return self.output_dir / phases_filename(self.rank) if self.output_dir is not None else None

    def _write_rows(self, records: list[PhaseRecord]) -> None:
        if not self._outputs_ok or self.output_dir is None:
            return
        try:
            if self._csv is None:
                self._csv = PhaseCsvWriter(self.output_dir / phases_filename(self.rank), max_rows=self.max_rows)
            written = self._csv.write_many(records)
            self.rows_written += written
            if written < len(records) and "rows" not in self._warned and self._csv.full:
                self._warn("rows", f"the CSV reached max_rows={self.max_rows}; further rows are not written")
        except OSError as error:
            self._output_failed("the phases CSV", error)

    def _maybe_open_window(self) -> None:
        if not self.history or self.history_steps == 0 or self._history_done or self._window is not None:
            return
        assert self._first_step is not None
        first = self._first_step + self.history_skip_steps
        if self.step < first:
            return
        last = first + self.history_steps - 1
        now_us = time.time_ns() // 1000
        try:
            if self.device.type == "cuda" and self.tracker is None:
                if not cuda_history.cuda_history_supported():
                    self._history_done = True
                    self._warn("history", "this torch cannot record the CUDA allocator's history: no snapshot")
                    return
                cuda_history.start_cuda_history(self.max_entries)
            elif self.tracker is not None:
                self.tracker.record_history(True)
                self._window_start_allocated = self.tracker.counters()[0]  # record_history took the reports in
            else:
                self._history_done = True
                return
        except Exception as error:
            self._history_done = True
            self._warn("history", f"could not start recording memory history: {error!r}")
            return
        self._window = (self.step, last, now_us)

    def _snapshot_now(self, since_us: int = 0) -> dict[str, Any]:
        if self.tracker is not None:
            return self.tracker.snapshot(since_us=since_us, device_index=self.device.index or 0)
        if self.device.type == "cuda" and cuda_history.cuda_history_supported():
            return cuda_history.cuda_snapshot()
        return {"segments": [], "device_traces": []}

    def _memtrace_metadata(self, first: int, last: int, since_us: int) -> dict[str, Any]:
        self._sync()
        classified = self._adopt_known()
        return build_header(
            device=str(self.device),
            rank=self.rank,
            steps=(first, last),
            allocated_bytes=(
                self.tracker.counters()[0] if self.tracker is not None else _cuda_allocated(self.device)
            ),
            allocated_at_start_bytes=self._window_start_allocated if self.tracker is not None else None,
            categories={c.value: v for c, v in CategoryCounter.totals(classified).items()},
            phases=[
                {"step": step, "phase": phase, "time_us": t} for step, phase, t in self.phase_marks if t >= since_us
            ],
        )

    def _close_window(self) -> Path | None:
        window, self._window = self._window, None
        if window is None:
            return None
        self._history_done = True
        first, planned_last, since_us = window
        last = max(first, min(planned_last, self.step))
        try:
            snapshot = self._snapshot_now(since_us)
            snapshot[HEADER_KEY] = self._memtrace_metadata(first, last, since_us)
        finally:
            if self.tracker is not None:
                self.tracker.record_history(False)
            elif self.device.type == "cuda":
                cuda_history.set_allocation_metadata("")
                cuda_history.stop_cuda_history()
        return self._write_snapshot(window_snapshot_filename(self.rank, first, last), snapshot)

    def _write_snapshot(self, name: str, snapshot: dict[str, Any], rotate: bool = True) -> Path | None:
        if not self._outputs_ok or self.output_dir is None:
            return None
        try:
            path = atomic_write_pickle(self.output_dir / name, snapshot)
        except OSError as error:
            self._output_failed(name, error)
            return None
        self.files.append(path)
        if not rotate:
            return path
        self.snapshots.append(path)
        while len(self.snapshots) > self.max_snapshots:
            old = self.snapshots.pop(0)
            try:
                old.unlink()
            except OSError:
                pass
        return path

    def write_snapshot(self, name: str | None = None) -> Path | None:
        """Write the current state (and the history the ring buffer holds) as a snapshot pickle now."""
        snapshot = self._snapshot_now()
        snapshot[HEADER_KEY] = self._memtrace_metadata(self.step, self.step, 0)
        return self._write_snapshot(name or step_snapshot_filename(self.rank, self.step), snapshot)

    # ------------------------------------------------------------------------------------------------ OOM
    def _live_blocks(self, limit: int = 10) -> list[LiveBlock]:
        if self.tracker is None:
            return []
        entries = sorted(self.tracker.live_allocations(), key=lambda e: e.nbytes, reverse=True)[:limit]
        return [LiveBlock(e.nbytes, list(e.frames or []), e.metadata, e.category or "") for e in entries]

    def _capture_oom_state(self, requested: int | None, frames: list, device_free: int | None = None) -> None:
        self._sync()
        classified = self._adopt_known()
        totals = {c.value: v for c, v in CategoryCounter.totals(classified).items()}
        if self.tracker is not None:
            allocated = reserved = self.tracker.counters()[0]
            largest = self._live_blocks()
            snapshot = None
        else:
            allocated, reserved = _cuda_allocated(self.device), _cuda_reserved(self.device)
            snapshot = self._snapshot_now() if self.device.type == "cuda" else None
            largest = largest_blocks_from_snapshot(snapshot) if snapshot else []
        totals[Category.OTHER.value] = max(0, allocated - sum(totals.values()))
        self._oom = {
            "requested": requested,
            "frames": frames,
            "stage": self.stage.value,
            "step": self.step,
            "categories": totals,
            "allocated": allocated,
            "reserved": reserved,
            "largest": largest,
            "snapshot": snapshot,
            "device_free": device_free,
        }

    def _on_tracker_oom(self, event: OutOfMemoryEvent) -> None:
        self._capture_oom_state(event.requested_bytes, event.frames)

    def on_cuda_oom(self, device: int, requested: int, device_allocated: int, device_free: int) -> None:
        if self.device.type == "cuda" and (self.device.index or 0) == device:
            self._capture_oom_state(requested, [], device_free)

    def write_post_mortem(self, exception: BaseException) -> list[Path]:
        """Write ``oom_rank<R>_step<N>.pickle`` and ``.txt`` for an out-of-memory error. Never raises."""
        if not self.post_mortem_enabled:
            return []
        try:
            return self._write_post_mortem(exception)
        except Exception as error:
            self._warn("postmortem", f"could not write the out-of-memory post-mortem: {error!r}")
            return []

    def _write_post_mortem(self, exception: BaseException) -> list[Path]:
        if self._oom is None and self.tracker is not None and self.tracker.backend == "reports":
            self.tracker.note_oom(exception)  # its listener captures the state, with the stack from the traceback
        if self._oom is None:
            self._capture_oom_state(requested_bytes_from_message(str(exception)), [])
        state = self._oom or {}
        self._oom = None
        message = str(exception).strip().splitlines()
        requested = state.get("requested")
        if requested is None:
            requested = requested_bytes_from_message(str(exception))
        pm = PostMortem(
            rank=self.rank,
            device=str(self.device),
            step=int(state.get("step", self.step)),
            epoch=self.epoch,
            batch_idx=self.batch_idx,
            stage=str(state.get("stage", self.stage.value)),
            exception_type=type(exception).__name__,
            message=message[0] if message else "",
            requested_bytes=requested,
            allocated_bytes=int(state.get("allocated", 0)),
            reserved_bytes=int(state.get("reserved", 0)),
            categories=dict(state.get("categories", {})),
            largest=list(state.get("largest", [])),
            failing_frames=list(state.get("frames", [])),
            device_free_bytes=state.get("device_free"),
        )
        snapshot = state.get("snapshot") or self._snapshot_now()
        snapshot[HEADER_KEY] = self._memtrace_metadata(pm.step, pm.step, 0)
        snapshot[HEADER_KEY]["post_mortem"] = pm.as_dict()
        paths = []
        base = oom_basename(self.rank, pm.step)
        pickle_path = self._write_snapshot(base + ".pickle", snapshot, rotate=False)
        if pickle_path is not None:
            paths.append(pickle_path)
        if self._outputs_ok and self.output_dir is not None:
            try:
                text_path = atomic_write_text(self.output_dir / (base + ".txt"), render_post_mortem(pm))
                self.files.append(text_path)
                paths.append(text_path)
            except OSError as error:
                self._output_failed(base + ".txt", error)
        self.last_post_mortem = pm
        return paths


def _cuda_allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" and torch.cuda.is_available() else 0


def _cuda_reserved(device: torch.device) -> int:
    return torch.cuda.memory_reserved(device) if device.type == "cuda" and torch.cuda.is_available() else 0
