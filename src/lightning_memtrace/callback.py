"""
MemTrace
========

A Lightning callback that shows where the memory of a training run goes, phase by phase, and why it ran out.

"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import lightning.pytorch as pl
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_memtrace.capture.config import AllocationBackend, RecorderConfig
from lightning_memtrace.capture.oom_errors import out_of_memory_in
from lightning_memtrace.capture.recorder import MemoryRecorder, MemTraceWarning, new_run_id
from lightning_memtrace.capture.reports_backend import track_every_cpu_block
from lightning_memtrace.trainer import extras, ranks
from lightning_memtrace.trainer.cadence import (
    RowMaxima,
    accumulating,
    last_step_of_fit,
    lightning_logs_now,
    log_step,
    log_to_loggers,
    profiles_with_torch,
)
from lightning_memtrace.trainer.folder import memtrace_folder
from lightning_memtrace.trainer.shown_once import shown_once_kept
from lightning_memtrace.types import PhaseRecord

_F = TypeVar("_F", bound=Callable[..., Any])


def _guarded(hook: _F) -> _F:
    """MemTrace must never break training: a failure of its own becomes one warning and MemTrace switches off."""

    @functools.wraps(hook)
    def wrapper(self: MemTrace, *args: Any, **kwargs: Any) -> Any:
        if self._disabled:
            return None
        try:
            return hook(self, *args, **kwargs)
        except Exception as error:
            self._disable(f"{hook.__name__} failed ({type(error).__name__}: {error})")
            return None

    return wrapper  # type: ignore[return-value]


class MemTrace(Callback):
    r"""Measures memory at every phase of every training step, records the allocator's history and explains OOMs.

    Add it with ``Trainer(callbacks=[MemTrace()])``; nothing else is needed.

    **Rows** are taken at these phases (Lightning's hook in brackets):

    - ``batch_start`` (``on_train_batch_start``)
    - ``after_forward`` (``on_before_zero_grad`` where Lightning calls it in that batch, else ``on_before_backward``)
    - ``after_backward`` (``on_after_backward``)
    - ``after_optimizer_step`` (a step post-hook on each of the Trainer's optimizers: once per real update)
    - ``batch_end`` (``on_train_batch_end``)
    - ``val_batch_start`` / ``val_batch_end`` (validation batches; activations are 0 there)

    **CSV** ``<trainer.log_dir>/memtrace/phases_rank<R>.csv`` (or ``<dirpath>/phases_rank<R>.csv``), one line per
    row, appended on resume. Lines are written together, whole: at the end of a batch once a second has passed, as
    the 256th row waits, at the end of each validation run, and when the fit ends or fails.
    Columns:

    - ``step``: the global step when the batch started (every row of a batch carries it)
    - ``epoch``, ``batch_idx``, ``rank``, ``phase``
    - ``time_s``: Unix time, seconds
    - ``allocated_bytes``: bytes allocated on the device (CUDA: ``memory_allocated``; elsewhere: the tracker, which
      counts what the module held before it started too: parameters, buffers, tensors kept as attributes)
    - ``reserved_bytes``: bytes reserved by the caching allocator (equal to allocated without one)
    - ``peak_bytes``: highest allocated bytes since the previous row
    - ``parameters_bytes``: distinct storages of the model's parameters (tied weights once; a quantized weight's
      scales and code tables too: bitsandbytes' 4-bit and 8-bit layers)
    - ``gradients_bytes``: storages of the parameters' ``.grad``
    - ``optimizer_state_bytes``: storages in the optimizers' ``state`` on this device
    - ``activations_bytes``: storages autograd saved for backward in this step and holds for a backward still (not
      parameters or inputs; once the backward that used them is done, what lives on, such as batch norm's running
      statistics or an output the step keeps, is ``other_bytes``)
    - ``inputs_bytes``: storages of the batch's tensors on the device (in containers, dataclasses and batch objects
      that Lightning moves with their own ``to()``)
    - ``other_bytes``: allocated minus the categories above, never negative
    - ``run``: the fit's id (UTC start time and a random suffix, the same on every rank, kept on resume): fits
      written into one folder are told apart by it
    - ``unsharded_parameters_bytes``, ``unsharded_gradients_bytes``: FSDP2's gathered full parameters (padded) and
      their full gradients before the reduce-scatter (local shards stay in the columns above); 0 unsharded
    - ``dataloader_idx``: the validation dataloader of a validation row (``batch_idx`` counts within it); 0 for
      training rows

    **Logged metrics** reach every logger of the Trainer the way those of Lightning's built-in callbacks do: through
    the Trainer's logger connector (each logger gets ``log_metrics(metrics=..., step=...)``, then ``save()``), at the
    step Lightning logs its own metrics at (the count of batches that stepped), one call per logged step. Values are
    in MiB (1024-based), ``_max_rank`` excepted. Counters: ``allocated``, ``reserved``, ``peak``, ``parameters``,
    ``gradients``, ``optimizer_state``, ``activations``, ``inputs``, ``other``, ``unsharded_parameters``,
    ``unsharded_gradients``. ``trainer.logged_metrics`` is left as it would be without MemTrace (the loggers get the
    metrics, the Trainer's record of what it logged keeps only its own).

    - ``memtrace/<phase>/<counter>`` (MiB) for the training phases ``batch_start`` to ``batch_end``: at
      ``on_train_batch_end`` of the batches after which Lightning logs its own step metrics (every
      ``log_every_n_steps`` optimizer steps; every step under ``fast_dev_run``), never after a batch that only
      accumulates gradients. Each value is the maximum over the rows of that optimizer step, so with
      ``accumulate_grad_batches`` above 1 over its micro-batches. Rows of steps that are not logged are in the CSV only.
    - ``memtrace/val_batch_start/<counter>``, ``memtrace/val_batch_end/<counter>`` (MiB): once per validation run
      inside fit (``on_validation_end``; not in the sanity check), the maximum over that run's rows.
    - ``memtrace/<phase>/<counter>_max`` (MiB, the maximum over ranks) and ``memtrace/<phase>/<counter>_max_rank``
      (the rank holding it, a plain number): with several processes (DDP, FSDP), on rank zero, whenever the ranks are
      gathered (see ``gather_every_n_steps``), in the same call as that step's training metrics.
    - ``memtrace/estimate/<category>`` and ``memtrace/estimate/peak`` (MiB): with ``estimate=True``, once, at the
      first training batch.

    An exception raised by a logger propagates unchanged (MemTrace's own failures become one warning instead).

    **Stages**: MemTrace measures ``fit`` only. At the end of it (``teardown``, or ``on_exception``) it stops and
    lets go of its recorder, hooks and files, so the Trainer pickles as it would without MemTrace. A later
    ``validate``, ``test`` or ``predict`` (or one alone) writes no rows and logs nothing; a later ``fit`` starts a
    new recorder and appends its rows to the same CSV.

    **Snapshots**: for a window of steps (by default the second and third steps of the run) the allocator's history is
    recorded and written as ``snapshot_rank<R>_steps<a>-<b>.pickle``, which pytorch.org/memory_viz,
    ``torch.cuda._memory_viz`` and ``memtrace report`` open. On CUDA that is the caching allocator's own history
    (``_record_memory_history``, Python stacks, a ring buffer of ``max_entries``) with each allocation tagged with its
    phase; on CPU the allocation tracker writes the same format.

    **Report**: at the end of fit, ``report.html`` and ``timeline.png`` (see ``report`` below; ``memtrace report``
    writes the same from any snapshot or log folder).

    **Peak statistics**: on CUDA (and other devices with allocator counters) MemTrace resets the device's peak
    statistics at every row, which is how each phase's peak is measured: during and after the run,
    ``torch.cuda.max_memory_allocated()`` (and ``DeviceStatsMonitor``'s peaks) read the peak since MemTrace's last row.
    The run's maximum is :attr:`max_allocated_bytes` (and :attr:`max_reserved_bytes`), which includes the peak the
    statistics held when MemTrace started.

    **Post-mortem**: on an out-of-memory error (CUDA's ``OutOfMemoryError``, the CPU allocator's "can't allocate
    memory"; on CPU any ``MemoryError`` too, numpy's included), ``oom_rank<R>_step<N>.pickle`` and
    ``oom_rank<R>_step<N>.txt`` (step, phase, requested size, live memory by category, the ten largest live allocations
    and where they were made, what would fit, what to change) are written before the error propagates unchanged. "What
    would fit" is the what-if table (:func:`lightning_memtrace.what_if`) for the module and the batch it died on, at the
    Trainer's precision and accumulation, against the device's memory (CUDA: its total; CPU: the physical RAM): one row
    per remedy (predicted peak, bytes saved, fits, largest micro-batch, price, measured or formula), then the cheapest
    combination that fits and its snippet. It runs on fake tensors (no real memory; the module's parameters, gradients
    and optimizer state are not touched) within ``what_if_budget_s``; remedies it would not reach in time are named in
    one line, as is a failure. With the table, the advice under "what to change" is only what points at a category
    holding at least 5% of live memory. The pickle's header has it all as data (``post_mortem["what_if"]``).

    Args:
        dirpath: Folder for the files. Default: ``<trainer.log_dir>/memtrace`` (with ``logger=False``,
            ``<default_root_dir>/memtrace``); where a ``ModelCheckpoint`` saves into ``trainer.log_dir`` itself, or
            with ``logger=False`` a profiler writes its report file there, ``<temp>/lightning_memtrace/<run id>``
            instead, with one warning.
        track_allocations: Count allocations with the allocation tracker (see ``allocation_backend``). Default
            (None): on where the device's allocator has no counters (CPU), off on CUDA.
        history: Record the allocator's history for a window of steps and write a snapshot. On CUDA, where you
            record it yourself already (``torch.cuda.memory._record_memory_history``), the window reads your
            recording as it is and leaves it on.
        history_skip_steps: Steps of the run before the window opens (default 1: skip the first step). A fit that
            ends before then (``fast_dev_run``, ``max_steps=1``) records its last ``history_steps`` steps instead.
        history_steps: Steps in the window (default 2).
        max_entries: Ring-buffer size of the history, in events.
        frames_min_bytes: Outside the window, the dispatch-mode CPU tracker records a stack only for allocations at
            least this large (bytes); the allocator-reports tracker records stacks only inside the window.
        log_metrics: Log the rows' maxima to the Trainer's loggers (see **Logged metrics**).
        every_n_steps: Take rows only on global steps divisible by this.
        max_rows: Most rows written to the CSV per run.
        max_snapshots: Most window snapshots kept per rank (oldest removed).
        post_mortem: Write a post-mortem on out-of-memory errors.
        gather_ranks: With several processes, gather a step's rows across ranks (one small ``all_reduce`` at
            ``on_train_batch_end``, which every rank reaches) so that rank zero logs the maxima.
        gather_every_n_steps: Gather every this many optimizer steps (and at the last). Default: the Trainer's
            ``log_every_n_steps``.
        report: At the end of fit, rank zero writes ``report.html`` (self-contained, works offline) and
            ``timeline.png`` into the folder, and logs the PNG to TensorBoard as ``memtrace/timeline``.
        estimate: Before the first step, estimate the run on fake tensors from the real module and first batch (no
            real memory), print it and log ``memtrace/estimate/<category>`` and ``memtrace/estimate/peak`` (MiB); at
            the end write ``estimate_vs_measured_rank<R>.csv`` (per category: estimated and measured bytes, error in
            percent), which the report shows. Also at the end: the what-if for the module and the first batch (see
            **Post-mortem**, within ``what_if_budget_s``), written as ``what_if_rank<R>.csv`` (one row per remedy:
            ``remedy``, ``peak_bytes``, ``saved_bytes``, ``fits``, ``max_micro_batch``, ``kind``, ``price``,
            ``<category>_bytes``; bytes) and ``what_if_rank<R>.json`` (also the combination, its snippet, the skipped
            remedies), which the report shows as "What would fit". Under DDP with ``gradient_as_bucket_view=False``
            both hold DDP's gradient buckets (and the what-if tries ``gradient_as_bucket_view``). Under manual
            optimization the module's ``training_step`` steps its (fake) optimizers itself; with a module sharded
            already (FSDP), one warning says that no estimate is made.
        allocation_backend: How the CPU tracker sees allocations. ``"auto"`` (default): the CPU allocator's own
            reports, read through a profiler session that records nothing else (no Python work per operator; the
            dispatch mode runs only in the history window, for stacks), or the dispatch mode where that session
            cannot run (another profiler recording, e.g. ``Trainer(profiler="pytorch")``). ``"dispatch"``: always the
            dispatch mode (for runs that open ``torch.profiler`` themselves). ``"reports"``: the reports only.
        category_rules: User rules for categories, ``{name: regex}`` (e.g. ``{"kv_cache": r"cache_utils\.py"}``),
            checked at construction (a bad regex raises ``ValueError`` naming the rule). Each frame of an allocation's
            stack is searched as ``"<file>:<line> <function>"``, innermost frame first, the rules in the order given;
            the first match names the category. They are written into every snapshot's header (``category_rules``),
            so the end-of-fit report and ``memtrace summary``/``report``/``diff`` of its snapshots apply them to the
            allocations MemTrace left uncategorised (those it recorded as parameters, gradients, optimizer state,
            inputs or activations keep their category); ``--rule`` adds to them.
        what_if_budget_s: Seconds the what-if (post-mortem; end of fit with ``estimate``) may take, per run of it:
            each remedy is estimated only where the longest estimate so far says it ends within the budget. 0: no
            what-if (the post-mortem has the advice only).
    """

    def __init__(
        self,
        dirpath: str | os.PathLike | None = None,
        track_allocations: bool | None = None,
        history: bool = True,
        history_skip_steps: int = 1,
        history_steps: int = 2,
        max_entries: int = 100_000,
        frames_min_bytes: int = 16 * 1024**2,
        log_metrics: bool = True,
        every_n_steps: int = 1,
        max_rows: int | None = 1_000_000,
        max_snapshots: int = 10,
        post_mortem: bool = True,
        gather_ranks: bool = True,
        gather_every_n_steps: int | None = None,
        report: bool = True,
        estimate: bool = False,
        allocation_backend: AllocationBackend = "auto",
        category_rules: Mapping[str, str] | None = None,
        what_if_budget_s: float = 60.0,
    ) -> None:
        arguments = locals()
        #: The recorder's settings (the keywords above that are its fields), shared with
        #: :class:`~lightning_memtrace.MemoryRecorder`.
        self.config = RecorderConfig(**{name: arguments[name] for name in RecorderConfig.field_names() if name in arguments})
        if self.config.uses_reports:
            # Blocks made from now on (the model, the optimizer's state) are known to the allocator's reports.
            track_every_cpu_block()
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.log_metrics = log_metrics
        self.gather_ranks = gather_ranks
        self.gather_every_n_steps = gather_every_n_steps
        self.report = report
        self.report_path: Path | None = None
        self.estimate = estimate
        self.estimated: Any = None
        self.estimate_comparison: Any = None
        #: ``what_if_rank<R>.csv`` of the last fit with ``estimate=True``, if written.
        self.what_if_path: Path | None = None
        # the first batch's shapes, kept from the estimate for the what-if at the end of fit
        self._first_batch: Any = None

        self.recorder: MemoryRecorder | None = None
        #: The ``run`` column of this fit's rows (set at setup; restored from a checkpoint on resume).
        self.run_id: str | None = None
        self._max_allocated_bytes = 0
        self._max_reserved_bytes = 0
        self.output_dir: Path | None = None
        self.device: Any = None
        #: The allocation tracker's backend in the last fit (``"reports"`` or ``"dispatch"``), None without tracker.
        self.tracker_backend: str | None = None
        self._rank = 0
        self._disabled = False
        # maxima (MiB) of the rows taken since the last logged training step / in this validation run
        self._maxima = RowMaxima()
        self._estimate_metrics: dict[str, float] | None = None
        self._rows_total = 0
        self._last_step: int | None = None
        self._files: list[Path] = []
        self._batch_step: int | None = None
        self.last_rank_maxima: dict[str, float] = {}

    def __getstate__(self) -> dict[str, Any]:
        # A copy made mid-fit (pickle, deepcopy of the Trainer's callbacks) is MemTrace as after its fit: the live
        # recorder (hooks, the profiling session, weak references to storages) stays with the original.
        state = self.__dict__.copy()
        state["recorder"] = None
        return state

    # --------------------------------------------------------------------------------------------- helpers
    def _disable(self, reason: str) -> None:
        self._disabled = True
        rank_zero_warn(f"MemTrace switched itself off: {reason}. Training goes on.")
        self._finish_quietly()

    def _finish_quietly(self) -> None:
        try:
            self._finish()
        except Exception:  # noqa: S110
            # Called while switching off or while the run ends (an exception propagating, teardown): releasing what
            # is left cannot be retried, and a second warning or error would only hide the first.
            pass

    def _on_record(self, record: PhaseRecord) -> None:
        self._rows_total += 1
        self._last_step = record.step
        if self.log_metrics:
            self._maxima.add(record)

    @property
    def max_allocated_bytes(self) -> int:
        """The highest allocated bytes of the last fit on this rank (see the class docstring: on CUDA, MemTrace resets
        the device's peak statistics at every row, so use this instead of ``torch.cuda.max_memory_allocated()``)."""
        recorder = self.recorder
        return recorder.max_allocated_bytes if recorder is not None else self._max_allocated_bytes

    @property
    def max_reserved_bytes(self) -> int:
        """The highest reserved bytes of the last fit on this rank (as :attr:`max_allocated_bytes`)."""
        recorder = self.recorder
        return recorder.max_reserved_bytes if recorder is not None else self._max_reserved_bytes

    @property
    def files(self) -> list[Path]:
        """Snapshot and post-mortem files written in this run."""
        return list(self.recorder.files) if self.recorder is not None else list(self._files)

    # --------------------------------------------------------------------------------------------- hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return  # MemTrace measures fit only: validate, test and predict alone run as if it were absent
        # Every fit starts clean, also after one in which MemTrace switched itself off.
        self._disabled = False
        self._setup_fit(trainer)

    @_guarded
    def _setup_fit(self, trainer: pl.Trainer) -> None:
        self._finish()
        self._files = []
        self.tracker_backend = None
        self.last_rank_maxima = {}
        self.estimated = self.estimate_comparison = None
        self.what_if_path = self._first_batch = None
        self._rank = trainer.global_rank
        # One id for every rank of this fit (setup is reached by all of them); a resume restores the earlier one.
        self.run_id = str(trainer.strategy.broadcast(new_run_id()))
        if self.dirpath is not None:
            self.output_dir = self.dirpath
        else:
            folder = memtrace_folder(trainer, self.run_id)
            self.output_dir = folder.path
            if folder.kept_clear is not None:
                rank_zero_warn(
                    f"MemTrace writes into {folder.path}, not into {folder.kept_clear}: {folder.owner} saves there "
                    "(pass MemTrace(dirpath=...) to choose the folder).",
                    category=MemTraceWarning,
                )

    @override
    @_guarded
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish()
        self.device = pl_module.device
        config = self.config
        if config.allocation_backend == "auto" and profiles_with_torch(trainer):
            # the thread's profiling session is the user's: see allocations another way
            config = config.replace(allocation_backend="dispatch")
        self.recorder = MemoryRecorder(
            pl_module,
            list(trainer.optimizers),
            config,
            device=pl_module.device,
            rank=self._rank,
            output_dir=self.output_dir,
            on_record=self._on_record,
            run_id=self.run_id,
        )
        self.recorder.expect_last_step(last_step_of_fit(trainer))
        buckets = extras.ddp_bucket_bytes(trainer)
        self.recorder.note_ddp_buckets(buckets, unseen=extras.ddp_keeps_first_buckets(trainer))
        self.recorder.start()
        self.recorder.adopt_held_by([callback for callback in trainer.callbacks if callback is not self])
        if self.recorder.tracker is not None:
            self.tracker_backend = self.recorder.tracker.backend

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch_step = trainer.global_step
        self._begin_train_batch(trainer, batch, batch_idx)
        estimate, self._estimate_metrics = self._estimate_metrics, None
        if estimate:
            log_to_loggers(trainer, estimate, log_step(trainer))  # outside the guard: a logger's error propagates

    @_guarded
    def _begin_train_batch(self, trainer: pl.Trainer, batch: Any, batch_idx: int) -> None:
        if self.estimate and self.estimated is None:  # where none can be made (FSDP): one warning says why
            with shown_once_kept():
                self.estimated, self._estimate_metrics = extras.estimate_run(trainer, batch)
            if self.estimated:
                self._first_batch = extras.batch_shapes(batch)
        if self.recorder is not None:
            self.recorder.begin_batch(batch, trainer.global_step, trainer.current_epoch, batch_idx, training=True)

    @override
    @_guarded
    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self.recorder is not None:
            self.recorder.mark_forward_done()

    @override
    @_guarded
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        if self.recorder is not None:
            self.recorder.mark_forward_done()
            self.recorder.watch_backward(loss)

    @override
    @_guarded
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.recorder is not None:
            self.recorder.mark_backward_done()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        metrics = self._end_train_batch(trainer) or {}
        # Outside the guard: every rank must reach the collective, also one whose MemTrace switched itself off.
        step = self._batch_step
        if self.gather_ranks and step is not None and trainer.global_step != step and trainer.world_size > 1:
            every = self.gather_every_n_steps or trainer.log_every_n_steps or 1
            # the same decision on every rank: it depends only on the global step
            if trainer.global_step % every == 0 or trainer.global_step == trainer.max_steps:
                maxima = self._gather_across_ranks(trainer, step)
                if self.log_metrics:
                    metrics.update(maxima)
        # Outside the guard too: an exception from a logger is the user's, and reaches the user unchanged.
        log_to_loggers(trainer, metrics, log_step(trainer))

    @_guarded
    def _end_train_batch(self, trainer: pl.Trainer) -> dict[str, float] | None:
        """Take the batch's last row; return what to log after it: the step's maxima where Lightning logs its own."""
        recorder = self.recorder
        if recorder is None:
            return None
        recorder.end_batch(next_step=trainer.global_step)
        if accumulating(trainer):
            return None  # the next micro-batches belong to the same optimizer step: keep their maxima together
        logs_now = self.log_metrics and bool(trainer.loggers) and lightning_logs_now(trainer)
        if logs_now and recorder.rows_waiting:
            recorder.flush()  # the rows of this step wait for the allocator's reports
        metrics = self._maxima.take_train(recorder.train_rows_taken)
        return metrics if metrics and logs_now else None

    def _gather_across_ranks(self, trainer: pl.Trainer, step: int) -> dict[str, float]:
        """Per phase and counter, the maximum over ranks and the rank that holds it (rank zero; empty elsewhere).

        One ``all_reduce(MAX)`` of a small int64 tensor whose entries encode ``bytes << 16 | rank``.
        """
        recorder = self.recorder
        try:
            if recorder is not None and not self._disabled and recorder.rows_waiting:
                recorder.flush()  # the rows of this step wait for the allocator's reports
            records = list(recorder.records) if recorder is not None and not self._disabled else []
            values = ranks.encode_step(records, step, trainer.global_rank)
        except Exception:  # this rank's rows are unreadable: it still takes part in the collective, with none
            values = ranks.encode_step([], step, trainer.global_rank)
        try:
            reduced = ranks.all_reduce_max(values, trainer.strategy.root_device)
        except Exception as error:
            self.gather_ranks = False
            rank_zero_warn(f"MemTrace could not gather memory across ranks ({error!r}); per-rank files are unaffected.")
            return {}
        if reduced is None or not trainer.is_global_zero:
            return {}
        self.last_rank_maxima = ranks.decode_maxima(reduced)
        return dict(self.last_rank_maxima)

    @override
    @_guarded
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._maxima.take_val()

    @override
    @_guarded
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.recorder is not None and not trainer.sanity_checking:
            step, epoch = trainer.global_step, trainer.current_epoch
            self.recorder.begin_batch(batch, step, epoch, batch_idx, training=False, dataloader_idx=dataloader_idx)

    @override
    @_guarded
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self.recorder is not None and not trainer.sanity_checking:
            self.recorder.end_batch()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        metrics = self._end_validation(trainer)
        if metrics:
            log_to_loggers(trainer, metrics, log_step(trainer))  # outside the guard: a logger's error propagates

    @_guarded
    def _end_validation(self, trainer: pl.Trainer) -> dict[str, float] | None:
        """Once per validation run: the maxima over its rows, to log at the step Lightning logs the run's metrics."""
        if self.recorder is None or trainer.sanity_checking:
            return None
        self.recorder.flush()
        return self._maxima.take_val() or None

    @override
    @_guarded
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish()
        with shown_once_kept():
            self.estimate_comparison = extras.compare_with_run(self.estimated, self.output_dir, self._rank, self.run_id)
            if self.estimated and self._first_batch is not None:
                budget = self.config.what_if_budget_s
                self.what_if_path = extras.write_what_if(
                    trainer, self._first_batch, self.output_dir, self._rank, budget
                )
            if self.report and trainer.is_global_zero:
                self.report_path = extras.write_fit_report(trainer, self.output_dir) or self.report_path

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Runs on each rank for itself: no collective here. Never raises: the training error must propagate unchanged.
        try:
            recorder = self.recorder
            if recorder is not None and out_of_memory_in(exception, recorder.device) is not None:
                with shown_once_kept():
                    batch = recorder.batch if recorder.batch is not None else self._first_batch
                    budget = self.config.what_if_budget_s
                    paths = recorder.write_post_mortem(
                        exception, announce=False, what_if=lambda pm: extras.what_if_after_oom(trainer, batch, budget)
                    )
                    self._finish_quietly()  # the CSV is closed and whole before the report reads it
                    report = None
                    if paths and self.report and trainer.is_global_zero:
                        report = extras.write_fit_report(trainer, self.output_dir, log_image=False)
                        self.report_path = report or self.report_path
                    recorder.announce_post_mortem(paths, report)
        except Exception as error:
            rank_zero_warn(f"MemTrace could not write the post-mortem: {error!r}")
        finally:
            self._finish_quietly()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._finish_quietly()

    def _finish(self) -> None:
        """Stop the recorder and let go of it: nothing that holds hooks, weak references, files or the trainer stays.

        What stays is plain data: the files written, the counts of ``state_dict``, ``report_path``, the estimate.
        Rows not logged yet are dropped (an unfinished optimizer step; Lightning logs nothing for it either).
        """
        recorder, self.recorder = self.recorder, None
        # (_batch_step stays: a rank whose MemTrace switched itself off still takes part in the gather)
        self._maxima.clear()
        self._estimate_metrics = None
        if recorder is None:
            return
        self._files = list(recorder.files)
        if recorder.tracker is not None:
            self.tracker_backend = recorder.tracker.backend
        try:
            recorder.stop()  # delivers the rows still waiting for the allocator's reports (to the CSV; none logged)
        finally:
            self._maxima.clear()
        self._max_allocated_bytes = recorder.max_allocated_bytes
        self._max_reserved_bytes = recorder.max_reserved_bytes

    @override
    def state_dict(self) -> dict[str, Any]:
        recorder = self.recorder
        if recorder is not None and recorder.rows_waiting:
            try:
                recorder.flush()  # the count includes the rows still waiting for the allocator's reports
            except Exception:  # noqa: S110
                pass  # a checkpoint is never held up by MemTrace: the count is then a few rows short
        return {"version": 1, "rows": self._rows_total, "last_step": self._last_step, "run": self.run_id}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # A checkpoint's MemTrace state never stops a resume: one it cannot read (another version's, edited) is a
        # warning, and the resumed fit counts afresh under a new run id.
        try:
            rows = int(state_dict.get("rows", 0) or 0)
            last_step = state_dict.get("last_step")
            run = state_dict.get("run")
            if last_step is not None:
                last_step = int(last_step)
            if run is not None and not isinstance(run, str):
                raise TypeError(f"run id {run!r} is not a string")
        except (AttributeError, TypeError, ValueError) as error:
            rank_zero_warn(f"MemTrace could not read its state in the checkpoint ({error}); it counts afresh.")
            return
        self._rows_total, self._last_step = rows, last_step
        if run:
            self.run_id = run  # a resumed run appends its rows to its own run
