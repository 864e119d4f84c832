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

The recorder is a state machine over the phases of a step (:mod:`lightning_memtrace.types`); what a row holds is
:mod:`~lightning_memtrace.capture.rows`, the files :mod:`~lightning_memtrace.capture.outputs`, the history window
:mod:`~lightning_memtrace.capture.window`, the out-of-memory capture :mod:`~lightning_memtrace.capture.oom`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import re
import secrets
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_memtrace.analysis.growth import records_growth
from lightning_memtrace.analysis.postmortem import PostMortem
from lightning_memtrace.capture import cuda_history, ddp_buckets
from lightning_memtrace.capture.categories import CategoryCounter, SavedTensorsRecorder, normalize_device
from lightning_memtrace.capture.config import RecorderConfig, choose_backend
from lightning_memtrace.capture.counters import MemoryCounters, TrackerCounters, allocator_counters
from lightning_memtrace.capture.oom import OomCapture, say_what_if_runs
from lightning_memtrace.capture.oom_errors import out_of_memory_in
from lightning_memtrace.capture.outputs import RecorderFiles
from lightning_memtrace.capture.reports_backend import unavailable_reason
from lightning_memtrace.capture.rows import RowPlace, RowReader
from lightning_memtrace.capture.storages import attribute_tensors, held_tensors
from lightning_memtrace.capture.tracker import AllocationTracker, RowMark
from lightning_memtrace.capture.window import HistoryWindow
from lightning_memtrace.schema import format_tag
from lightning_memtrace.types import STAGE_AFTER_PHASE, Category, Phase, PhaseRecord, Stage

#: Deferred rows (see :meth:`MemoryRecorder.flush`) are read at the end of the batch where this many are waiting or
#: this many seconds have passed since the last read (and whenever the rows are wanted: logging, gathering, the end).
#: Rows reach the CSV on the same rule, also where they are read at once. Not more rows: a larger read leaves the
#: process more resident memory that the C library keeps (a 2,000-step run of tiny steps: 0.4 MB at 256 rows, 24 MB at
#: 1,024, 211 MB at 4,096), though it would save a validation loop of tiny batches some of each read's own cost.
_DEFERRED_ROWS_MAX = 256
_DEFERRED_SECONDS_MAX = 1.0
#: Training batches between two looks for memory held between batches that keeps rising (over the rows held).
GROWTH_CHECK_BATCHES = 200


_COMPILED_UNCOUNTED = (
    "torch.compile'd code compiled while the CPU allocation tracker (a dispatch mode) counts: it runs compiled, as "
    "without MemTrace, and what it allocates inside is not counted (allocated_bytes and peak_bytes miss it; the "
    "categories stay exact). The CPU allocator's reports count compiled code: they are read where no other profiler "
    "runs (allocation_backend='auto')."
)


class MemTraceWarning(UserWarning):
    """A problem of MemTrace's own (it never stops training)."""


@dataclasses.dataclass
class RecorderParts:
    """Parts a recorder is built with instead of its own (the estimator counts fake tensors on a fake device).

    Attributes:
        tracker: The allocation tracker (its counters then give allocated and peak).
        counters: Where allocated, reserved and peak come from instead (with ``tracker``: a model of a device's
            allocator that the tracker's allocations and frees drive).
        categories: Names parameters, gradients, optimizer state.
        saved: Records the storages autograd saves.
    """

    tracker: AllocationTracker | None = None
    counters: MemoryCounters | None = None
    categories: CategoryCounter | None = None
    saved: SavedTensorsRecorder | None = None


def new_run_id() -> str:
    """A run id: when the run started (UTC) and a random suffix, e.g. ``20261203T122745-3fa1c2``."""
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


#: What :func:`new_run_id` makes (ids sort by their start time).
RUN_ID_PATTERN = re.compile(r"\d{8}T\d{6}-[0-9a-f]{6}")


def _device_of(model: nn.Module | None) -> torch.device:
    if model is not None:
        for tensor in model.parameters():
            return tensor.device
        for tensor in model.buffers():
            return tensor.device
    return torch.device("cpu")


def _reports_available(device: torch.device) -> bool:
    return device.type == "cpu" and unavailable_reason() is None


class MemoryRecorder:
    """Measures memory at the phases of each step, records the allocator's history and writes post-mortems.

    Args:
        model: The module being trained (its parameters and their gradients are categorized).
        optimizers: The optimizers; a step post-hook on each takes the ``after_optimizer_step`` row.
        config: What to measure and keep (:class:`~lightning_memtrace.capture.config.RecorderConfig`); each of its
            fields may also be given as a keyword (``history_steps=4``), which overrides it.
        device: The device to measure; defaults to the model's.
        rank: Put in every row and file name.
        output_dir: Folder for ``phases_rank<R>.csv``, snapshots and post-mortems; None writes no files.
        on_record: Called with each :class:`PhaseRecord` taken (the callback logs them).
        parts: Parts to use instead of the recorder's own (see :class:`RecorderParts`).
        run_id: The ``run`` column of every row; a new id (time and random suffix) by default. Pass the same id to
            every rank of a run, and the earlier id to a resumed run.
        **settings: Fields of :class:`RecorderConfig`: ``track_allocations``, ``history``, ``history_skip_steps``,
            ``history_steps``, ``max_entries``, ``frames_min_bytes``, ``post_mortem``, ``max_rows``, ``every_n_steps``,
            ``max_snapshots``, ``allocation_backend``, ``window_stacks``, ``category_rules``, ``what_if_budget_s``.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        config: RecorderConfig | None = None,
        *,
        device: torch.device | str | None = None,
        rank: int = 0,
        output_dir: str | os.PathLike | None = None,
        on_record: Callable[[PhaseRecord], None] | None = None,
        parts: RecorderParts | None = None,
        run_id: str | None = None,
        **settings: Any,
    ) -> None:
        config = (config or RecorderConfig()).replace(**settings) if settings else (config or RecorderConfig())
        parts = parts or RecorderParts()
        self.model = model
        self.device = normalize_device(device if device is not None else _device_of(model))
        self.rank = rank
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.on_record = on_record
        self.run_id = run_id or new_run_id()
        self._warned: set[str] = set()
        self._batches_since_growth_check = 0
        self.tracker, self.counters, self.config = self._measuring_parts(config, parts)
        self.categories = parts.categories or CategoryCounter(self.device, model, optimizers)
        self.saved = parts.saved or SavedTensorsRecorder(self.device)

        self.step = self.epoch = self.batch_idx = self.dataloader_idx = 0
        self._unseen_ddp_bucket_bytes = 0
        #: The training batch between :meth:`begin_batch` and :meth:`end_batch` (a reference, for the post-mortem's
        #: what-if), else None.
        self.batch: Any = None
        self.stage = Stage.OUTSIDE
        self.training = False
        self.started = False
        self._records: deque[PhaseRecord] = deque(maxlen=2048)
        #: Training rows taken so far (read or deferred); they reach ``on_record`` in this order.
        self.train_rows_taken = 0
        self.outputs = RecorderFiles(self.output_dir, rank, self.config.max_rows, self.config.max_snapshots, self._warn)
        self.rows = RowReader(self.device, self.categories, self.saved, self.tracker, self.counters)
        self.window = HistoryWindow(
            self.config, self.device, rank, self.tracker, self.outputs, self.rows.classify, self._sync, self._warn, self.run_id
        )
        if self.tracker is None and self.device.type == "cuda":  # the allocator's snapshot gets the rows' categories
            self.rows.on_named = self.window.note_names
        self.oom = OomCapture(
            self.device,
            rank,
            self.tracker,
            self.outputs,
            self.window,
            self.rows.classify,
            self._sync,
            self._where,
            lambda: self._records,
        )
        self._in_batch = self._forward_marked = self._stepped_this_batch = False
        self._take_rows = True
        self._step_hooks: list[Any] = []
        self._step_depth: dict[int, int] = {}
        self._last_sync = self._last_write = time.monotonic()
        # Rows delivered and not in the CSV yet: written together (formatting many lines at once, one write) where
        # they are due, in flush() and at the end.
        self._unwritten: list[PhaseRecord] = []
        #: The thread that started the recorder (whose reports session it reads).
        self._thread = threading.get_ident()

    def _measuring_parts(
        self, config: RecorderConfig, parts: RecorderParts
    ) -> tuple[AllocationTracker | None, MemoryCounters | None, RecorderConfig]:
        """The tracker and counters for this device and module, and the settings they were chosen with."""
        if parts.tracker is not None:
            return parts.tracker, parts.counters or TrackerCounters(parts.tracker), config
        device_counters = allocator_counters(self.device)
        choice = choose_backend(config, self.model, _reports_available(self.device), device_counters is not None)
        if choice.warning:
            self._warn("compile", choice.warning)
        config = choice.config
        track = config.track_allocations if config.track_allocations is not None else device_counters is None
        if not track:
            return None, device_counters, config
        tracker = AllocationTracker(
            self.device,
            max_entries=config.max_entries,
            frames_min_bytes=config.frames_min_bytes,
            backend=config.allocation_backend,
        )
        tracker.window_stacks = config.window_stacks
        if not choice.compiled_eagerly:
            tracker.let_compiled_code_compile(functools.partial(self._warn, "compiled", _COMPILED_UNCOUNTED))
        return tracker, device_counters if device_counters is not None else TrackerCounters(tracker), config

    # ------------------------------------------------------------------------------------------------ lifecycle
    def expect_last_step(self, step: int | None) -> None:
        """The last step the run will reach (None: unknown). A run that ends before the history window would open
        (``history_skip_steps``) gets the window over its last ``history_steps`` steps instead of no snapshot."""
        self.window.run_last_step = None if step is None else int(step)

    def adopt_held_by(self, holders: Sequence[object]) -> None:
        """Count the tensors other objects (the Trainer's other callbacks) keep, made before the recorder started: an
        averaged copy of the model, a callback's own state. A device's allocator counts them (CUDA); a tracker sees
        only what is made after it started, so it counts them here (as ``other`` unless a row names them)."""
        if self.tracker is None or not self.started:
            return
        for holder in holders:
            for tensor in held_tensors(holder):
                self.tracker.adopt(tensor)

    def note_ddp_buckets(self, nbytes: int, unseen: bool = False) -> None:
        """DDP's gradient buckets beside the gradients hold ``nbytes`` (counted as ``other``): the snapshots' header
        and an out-of-memory post-mortem name them, and what turns them off. ``unseen``: DDP keeps the buckets it made
        before the recorder started, which a tracker (CPU) cannot see made: it counts them from the start."""
        self.oom.ddp_bucket_bytes = self.window.ddp_bucket_bytes = int(nbytes)
        self._unseen_ddp_bucket_bytes = int(nbytes) if unseen else 0

    def start(self) -> MemoryRecorder:
        if self.started:
            return self
        self.started = True
        self._thread = threading.get_ident()
        if self.tracker is not None:
            self.tracker.oom_listeners.append(self.oom.on_tracker_oom)
            self.tracker.start()
            if self.tracker.fallback_reason is not None:
                self._warn(
                    "backend",
                    f"counting CPU memory with the dispatch mode (slower) instead of the allocator's reports: "
                    f"{self.tracker.fallback_reason}",
                )
        for optimizer in self.categories.optimizers:
            self._hook_optimizer(optimizer)
        self._adopt_module_state()
        if self.tracker is not None and self._unseen_ddp_bucket_bytes:
            self.tracker.hold_unseen(self._unseen_ddp_bucket_bytes, ddp_buckets.maker_frames(), Category.OTHER.value)
        if self.config.post_mortem and self.device.type == "cuda":
            cuda_history.add_cuda_oom_listener(self.oom)
        self.rows.classify()
        if self.counters is not None:
            self.counters.read()
        return self

    def _adopt_module_state(self) -> None:
        # Buffers (BatchNorm's statistics, a rotary table, a frozen embedding kept as a buffer) and tensors kept as
        # plain attributes, made before the tracker started: device memory a CUDA allocator's counters include, so
        # the tracker counts them from the start too (category "other"). Parameters are counted as they are named.
        if self.tracker is None or self.model is None:
            return
        for tensor in itertools.chain(self.model.buffers(), attribute_tensors(self.model)):
            self.tracker.adopt(tensor)

    def stop(self) -> None:
        """Write the open history window, remove every hook and leave the dispatch mode. Safe to call twice."""
        if not self.started:
            return
        self.started = False
        self.batch = None
        try:
            if self.window.is_open:
                self.window.close(self.step)
        finally:
            self.saved.pop()
            for handle in self._step_hooks:
                handle.remove()
            self._step_hooks.clear()
            cuda_history.remove_cuda_oom_listener(self.oom)
            if self.tracker is not None:
                if self.oom.on_tracker_oom in self.tracker.oom_listeners:
                    self.tracker.oom_listeners.remove(self.oom.on_tracker_oom)
                self.tracker.stop()
                self._deliver(self.rows.ready())
            self._write_rows()
            self.outputs.close()

    def __enter__(self) -> MemoryRecorder:
        return self.start()

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        try:
            if exc is not None and out_of_memory_in(exc, self.device) is not None:
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
    def begin_batch(
        self,
        batch: Any = None,
        step: int = 0,
        epoch: int = 0,
        batch_idx: int = 0,
        training: bool = True,
        dataloader_idx: int = 0,
    ) -> None:
        """Take the ``batch_start`` (or ``val_batch_start``) row; in training, start collecting saved activations.
        ``dataloader_idx``: the validation dataloader the batch comes from (the rows' ``dataloader_idx``)."""
        self.step, self.epoch, self.batch_idx, self.training = int(step), int(epoch), int(batch_idx), training
        self.dataloader_idx = int(dataloader_idx)
        self._in_batch = True
        self._forward_marked = not training
        self._stepped_this_batch = False
        self._take_rows = self.step % self.config.every_n_steps == 0
        if training:
            self.batch = batch
        self.oom.forget()
        self.saved.pop()
        self.saved.clear()
        self.rows.begin_batch(batch, training)
        if training:
            self.window.maybe_open(self.step)
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

    def watch_backward(self, loss: Any) -> None:
        """Before ``loss.backward()``: tag its backward from its first node on, where autograd runs it (for CUDA
        tensors a thread of its own, which the training thread's tag does not reach) while the history window records;
        where the tracker's dispatch mode runs, have autograd sum gradients in place as it would without the mode."""
        grad_fn = getattr(loss, "grad_fn", None)
        if grad_fn is not None and self.window.is_open and self.device.type == "cuda":
            grad_fn.register_prehook(cuda_history.carry_allocation_tag)
        if grad_fn is not None and self.tracker is not None:
            self.tracker.watch_backward(loss)

    def mark_backward_done(self) -> None:
        """Take the ``after_backward`` row."""
        if not self._in_batch:
            return
        self.mark_forward_done()
        if self.tracker is not None:
            self.tracker.backward_done()
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
        if self.tracker is not None:
            self.tracker.backward_done()  # where the backward failed and the batch still ends (an error caught)
        self._record(Phase.BATCH_END if self.training else Phase.VAL_BATCH_END)
        self._in_batch = False
        if self.training:
            self.batch = None  # kept no longer than the batch: the next batch's rows must not see it alive
        self.rows.end_batch()
        self.saved.clear()
        if self._sync_due():
            self._sync()
            self._write_rows()
        elif self._unwritten and self._write_due():
            self._write_rows()
        if self.training:
            if next_step is None:
                next_step = self.step + (1 if self._stepped_this_batch else 0)
            last = self.window.last_step()
            if last is not None and next_step > last:
                self.window.close(self.step)

    def _sync_due(self) -> bool:
        """Whether the deferred rows are read at the end of this batch.

        Reading costs about the same per report whenever it happens, but each read also frees torch's result at once,
        after which the C library trims the heap and the next step faults the pages in again; so the reports of many
        batches are read at once: every few hundred rows or every second (also without rows: the reports must not
        pile up). Under a process group, every training batch: the collectives' worker threads free blocks this
        thread made, which only the allocator's totals between two reads tell.
        """
        tracker = self.tracker
        if tracker is None or not tracker.deferring:
            return False
        return (
            (self.training and tracker.reads_every_batch)
            or len(self.rows.deferred) >= _DEFERRED_ROWS_MAX
            or time.monotonic() - self._last_sync >= _DEFERRED_SECONDS_MAX
        )

    def _write_due(self) -> bool:
        return time.monotonic() - self._last_write >= _DEFERRED_SECONDS_MAX

    def _write_rows(self) -> None:
        rows, self._unwritten = self._unwritten, []
        self._last_write = time.monotonic()
        if rows:
            self.outputs.write_rows(rows)

    # ------------------------------------------------------------------------------------------------ measuring
    def measure(self, phase: Phase) -> PhaseRecord:
        """Measure now, without writing: allocated, reserved, peak since the last measurement, and categories."""
        self._sync()
        return self.rows.read(self._place(phase, time.time()))

    @property
    def records(self) -> deque[PhaseRecord]:
        """The last 2,048 rows, oldest first; rows still waiting for the allocator's reports are read first (on the
        recorder's thread), so that every row taken so far is here."""
        if self.rows.deferred:
            self.flush()
        return self._records

    @property
    def rows_waiting(self) -> int:
        """Rows taken and not delivered yet: they wait for the allocator's reports (see :meth:`flush`)."""
        return len(self.rows.deferred)

    def flush(self) -> None:
        """Read the allocator's reports now, deliver every row still waiting for them (``on_record``) and write the
        rows not in the CSV yet.

        With the CPU allocator's reports (the default on CPU, outside the history window), a row is taken where it
        happens but its allocated and peak bytes are read from the report stream later: at the end of the batch where
        a few hundred rows wait or a second has passed (under a process group, every training batch), and here.
        Rows reach the CSV on the same rule (also where they are read at once), and when the recorder stops.
        The session is the thread's that started the recorder: on another thread this does nothing.
        """
        if threading.get_ident() == self._thread:
            self._sync()
            self._write_rows()

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
        self._deliver(self.rows.ready())

    def _place(self, phase: Phase, time_s: float) -> RowPlace:
        return RowPlace(
            phase, self.step, self.epoch, self.batch_idx, self.rank, time_s, self.run_id, self.dataloader_idx
        )

    def _where(self) -> tuple[int, int, int, str, int]:
        return self.step, self.epoch, self.batch_idx, self.stage.value, self.dataloader_idx

    def _record(self, phase: Phase) -> PhaseRecord | None:
        tracker = self.tracker
        deferring = tracker is not None and tracker.deferring
        if tracker is not None and not deferring:
            self._sync()  # allocations reported since the last row belong to the stage that is ending
        self._set_stage(STAGE_AFTER_PHASE[phase])
        now_us = time.time_ns() // 1000
        self.window.phase_marks.append((self.step, phase.value, now_us))
        if self._take_rows and self.training:
            self.train_rows_taken += 1
        if deferring:
            assert tracker is not None
            if self._take_rows:
                self.rows.defer(self._place(phase, now_us / 1e6))
            else:
                tracker.mark(RowMark(tracker.stage, tracker.metadata))  # the stage still changes there
            return None
        if not self._take_rows:
            return None
        record = self.rows.read(self._place(phase, time.time()))
        self._deliver([record])
        return record

    def _deliver(self, records: list[PhaseRecord]) -> None:
        if not records:
            return
        self._records.extend(records)
        self._unwritten.extend(records)
        if len(self._unwritten) >= _DEFERRED_ROWS_MAX:
            self._write_rows()
        self._batches_since_growth_check += sum(record.phase is Phase.BATCH_START for record in records)
        if self._batches_since_growth_check >= GROWTH_CHECK_BATCHES:
            self._batches_since_growth_check = 0
            self._warn_of_growth()
        if self.on_record is not None:
            for record in records:
                self.on_record(record)

    def _warn_of_growth(self) -> None:
        """Say once, while the run goes on, that the memory held between training batches keeps rising and is still
        held (:mod:`~lightning_memtrace.analysis.growth`, over the rows held): a run that would die of it hours later
        is told now."""
        if "growth" in self._warned:
            return
        try:
            found = records_growth(self._records)
        except Exception:  # noqa: BLE001 - a look that fails tells nothing
            return
        if found is not None and not found.freed:
            self._warn("growth", found.sentence())

    def _set_stage(self, stage: Stage) -> None:
        self.stage = stage
        tracker = self.tracker
        tags_cuda = self.window.is_open and self.device.type == "cuda"
        if tracker is None and not tags_cuda:
            return
        metadata = format_tag(stage, self.step)
        if tracker is not None:
            tracker.set_stage(stage.value, metadata)
        if tags_cuda:
            cuda_history.tag_allocations(metadata)

    def _warn(self, kind: str, message: str) -> None:
        if kind in self._warned:
            return
        self._warned.add(kind)
        prefix = f"[rank {self.rank}] " if self.rank else ""
        warnings.warn(f"{prefix}MemTrace: {message}", MemTraceWarning, stacklevel=3)

    # ------------------------------------------------------------------------------------------------ outputs
    @property
    def max_allocated_bytes(self) -> int:
        """The highest allocated bytes of the run so far, on the measured device.

        On CUDA, MemTrace resets the device's peak statistics at every row (the only way to learn each phase's peak),
        so ``torch.cuda.max_memory_allocated()`` then reads the peak since the last row; this keeps the run's maximum,
        the peak the statistics held when the recorder started included. Rows waiting for the CPU allocator's
        reports are read first.
        """
        if self.counters is not None:
            self.flush()
            return int(self.counters.max_allocated)
        return max((record.peak_bytes for record in self._records), default=0)

    @property
    def max_reserved_bytes(self) -> int:
        """The highest reserved bytes of the run so far (see :attr:`max_allocated_bytes`)."""
        if self.counters is not None:
            return int(self.counters.max_reserved)
        return max((record.reserved_bytes for record in self._records), default=0)

    @property
    def csv_path(self) -> Path | None:
        return self.outputs.csv_path

    @property
    def rows_written(self) -> int:
        """Rows in the CSV so far (see :meth:`flush`)."""
        return self.outputs.rows_written

    @property
    def files(self) -> list[Path]:
        """Snapshot and post-mortem files written so far."""
        return self.outputs.files

    @property
    def snapshots(self) -> list[Path]:
        """The window snapshots kept (at most ``max_snapshots``)."""
        return self.outputs.snapshots

    @property
    def last_post_mortem(self) -> PostMortem | None:
        return self.oom.last

    def write_snapshot(self, name: str | None = None) -> Path | None:
        """Write the current state (and the history the ring buffer holds) as a snapshot pickle now."""
        return self.window.write_snapshot(self.step, name)

    def on_cuda_oom(self, device: int, requested: int, device_allocated: int, device_free: int) -> None:
        self.oom.on_cuda_oom(device, requested, device_allocated, device_free)

    def write_post_mortem(
        self,
        exception: BaseException,
        announce: bool = True,
        what_if: Callable[[PostMortem], dict[str, Any] | None] | None = None,
    ) -> list[Path]:
        """Write ``oom_rank<R>_step<N>.pickle`` and ``.txt`` for an out-of-memory error. Never raises.

        Args:
            exception: The out-of-memory error, or an error raised from one (it propagates afterwards; this does
                not raise it).
            announce: Print one line naming the post-mortem on stderr (see :meth:`announce_post_mortem`).
            what_if: Makes the post-mortem's "what would fit" (see :attr:`PostMortem.what_if`). Default: the model
                and the batch of :meth:`begin_batch`, in fp32, the first optimizer's class and defaults (a
                LightningModule: its own), within ``what_if_budget_s``.
        """
        if not self.config.post_mortem:
            return []
        make = what_if if what_if is not None else self._what_if

        def quietly(pm: PostMortem) -> dict[str, Any] | None:
            self.saved.pop()  # the estimate's fake forward must not reach this run's saved-tensor hooks
            return make(pm)

        try:
            paths = self.oom.write(exception, quietly)
        except Exception as error:
            self._warn("postmortem", f"could not write the out-of-memory post-mortem: {error!r}")
            return []
        if announce:
            self.announce_post_mortem(paths)
        return paths

    def _what_if(self, pm: PostMortem) -> dict[str, Any] | None:
        """The plain loop's what-if for the post-mortem: the model and the batch it died on, fp32."""
        budget = float(self.config.what_if_budget_s or 0)
        if budget <= 0 or self.model is None or self.batch is None:
            return None
        from lightning_memtrace.estimator.budget import device_memory_bytes, optimizer_factory_like, what_if_within
        from lightning_memtrace.estimator.run import _is_lightning_module

        factory = None if _is_lightning_module(self.model) else optimizer_factory_like(self.categories.optimizers)
        if factory is None and not _is_lightning_module(self.model):
            return {"made": False, "text": "what-if: not made (the recorder was given no optimizer)"}
        say_what_if_runs(self.rank, budget, "MemoryRecorder(what_if_budget_s=0)")
        run = what_if_within(
            self.model,
            self.batch,
            budget_s=budget,
            device_memory=device_memory_bytes(self.device),
            optimizer_factory=factory,
            hint="raise MemoryRecorder(what_if_budget_s=...)",
        )
        return run.as_dict()

    def announce_post_mortem(self, paths: list[Path], report: Path | None = None) -> None:
        """One line on stderr naming the post-mortem (and the report), so that the traceback that follows is not all
        the user sees."""
        pm = self.oom.last
        text = next((path for path in paths if path.suffix == ".txt"), None)
        if pm is None or text is None:
            return
        prefix = f"[rank {self.rank}] " if self.rank else ""
        line = f"{prefix}MemTrace: out of memory at step {pm.step} ({pm.stage}); post-mortem: {text}"
        if report is not None:
            line += f"; report: {report}"
        print(line, file=sys.stderr, flush=True)
