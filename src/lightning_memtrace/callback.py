"""
MemTrace
========

A Lightning callback that shows where the memory of a training run goes, phase by phase, and why it ran out.

"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from typing_extensions import override

import lightning.pytorch as pl
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_memtrace.counters import allocator_has_counters
from lightning_memtrace.files import MEMTRACE_DIR, PHASES_GLOB, phases_filename
from lightning_memtrace.recorder import MemoryRecorder
from lightning_memtrace.tracker import is_out_of_memory
from lightning_memtrace.types import COUNTERS, Phase, PhaseRecord
from lightning_memtrace.units import MIB

_F = TypeVar("_F", bound=Callable[..., Any])
_RANK_BITS = 16
TRAIN_PHASES = (Phase.BATCH_START, Phase.AFTER_FORWARD, Phase.AFTER_BACKWARD, Phase.AFTER_OPTIMIZER_STEP, Phase.BATCH_END)
VAL_PHASES = (Phase.VAL_BATCH_START, Phase.VAL_BATCH_END)
# per phase: (metric key, PhaseRecord attribute) for each counter, built once
_METRIC_KEYS = {phase: tuple((f"memtrace/{phase.value}/{c}", f"{c}_bytes") for c in COUNTERS) for phase in Phase}


def _log_step(trainer: pl.Trainer) -> int:
    """The step Lightning logs its own metrics at: the fit loop's count of batches that stepped."""
    try:
        return int(trainer.fit_loop.epoch_loop._batches_that_stepped)
    except AttributeError:
        return int(trainer.global_step)


def _accumulating(trainer: pl.Trainer) -> bool:
    """This batch only accumulates gradients: Lightning logs no step metrics after it (automatic optimization)."""
    try:
        return bool(trainer.fit_loop._should_accumulate()) and trainer.lightning_module.automatic_optimization
    except AttributeError:
        return False


def _lightning_logs_now(trainer: pl.Trainer) -> bool:
    """Lightning logs its step metrics after this training batch (``LoggerConnector.update_train_step_metrics``)."""
    if _accumulating(trainer):
        return False
    connector = getattr(trainer, "_logger_connector", None)
    try:
        should = bool(connector.should_update_logs)  # type: ignore[union-attr]
    except AttributeError:
        every = trainer.log_every_n_steps
        should = bool(every) and ((_log_step(trainer) + 1) % every == 0 or trainer.should_stop)
    return should or bool(trainer.fast_dev_run)


def _log_to_loggers(trainer: pl.Trainer, metrics: dict[str, float], step: int) -> None:
    """Log through Lightning's own path, as its built-in callbacks do; a logger's exception propagates unchanged."""
    if not metrics or not trainer.loggers:
        return
    log_metrics = getattr(getattr(trainer, "_logger_connector", None), "log_metrics", None)
    if callable(log_metrics):
        log_metrics(metrics, step=step)  # every logger: log_metrics(metrics=..., step=...), then save()
        return
    for logger in trainer.loggers:
        logger.log_metrics(metrics=metrics, step=step)
        logger.save()


def _profiles_with_torch(trainer: pl.Trainer) -> bool:
    """The Trainer's profiler records with ``torch.profiler`` (it would take the thread's session over)."""
    try:
        from lightning.pytorch.profilers import PyTorchProfiler
    except ImportError:
        return False
    return isinstance(getattr(trainer, "profiler", None), PyTorchProfiler)


def _reports_available(device: torch.device) -> bool:
    from lightning_memtrace.allocator_reports import unavailable_reason

    return device.type == "cpu" and unavailable_reason() is None


def _has_compiled_parts(module: torch.nn.Module) -> bool:
    if getattr(module, "_compiler_ctx", None):
        return True
    optimized = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    optimized_type = getattr(optimized, "OptimizedModule", None)
    if optimized_type is None:
        return False
    return any(isinstance(child, optimized_type) for child in module.modules())


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

    **CSV** ``<trainer.log_dir>/memtrace/phases_rank<R>.csv`` (or ``<dirpath>/phases_rank<R>.csv``), one flushed
    line per row, appended on resume. Columns:

    - ``step``: the global step when the batch started (every row of a batch carries it)
    - ``epoch``, ``batch_idx``, ``rank``, ``phase``
    - ``time_s``: Unix time, seconds
    - ``allocated_bytes``: bytes allocated on the device (CUDA: ``memory_allocated``; elsewhere: the tracker)
    - ``reserved_bytes``: bytes reserved by the caching allocator (equal to allocated without one)
    - ``peak_bytes``: highest allocated bytes since the previous row
    - ``parameters_bytes``: distinct storages of the model's parameters (tied weights once)
    - ``gradients_bytes``: storages of the parameters' ``.grad``
    - ``optimizer_state_bytes``: storages in the optimizers' ``state`` on this device
    - ``activations_bytes``: storages autograd saved for backward in this step and still alive (not parameters or
      inputs)
    - ``inputs_bytes``: storages of the batch's tensors on the device
    - ``other_bytes``: allocated minus the categories above, never negative

    **Logged metrics** reach every logger of the Trainer the way those of Lightning's built-in callbacks do: through
    the Trainer's logger connector (each logger gets ``log_metrics(metrics=..., step=...)``, then ``save()``), at the
    step Lightning logs its own metrics at (the count of batches that stepped), one call per logged step. Values are
    in MiB (1024-based), ``_max_rank`` excepted. Counters: ``allocated``, ``reserved``, ``peak``, ``parameters``,
    ``gradients``, ``optimizer_state``, ``activations``, ``inputs``, ``other``.

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

    **Post-mortem**: on an out-of-memory error, ``oom_rank<R>_step<N>.pickle`` and ``oom_rank<R>_step<N>.txt`` (step,
    phase, requested size, live memory by category, the ten largest live allocations and where they were made, what
    to change) are written before the error propagates unchanged.

    Args:
        dirpath: Folder for the files. Default: ``<trainer.log_dir>/memtrace``.
        track_allocations: Count allocations with the allocation tracker (see ``allocation_backend``). Default
            (None): on where the device's allocator has no counters (CPU), off on CUDA.
        history: Record the allocator's history for a window of steps and write a snapshot.
        history_skip_steps: Steps of the run before the window opens (default 1: skip the first step).
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
            percent), which the report shows. Automatic optimization only.
        allocation_backend: How the CPU tracker sees allocations. ``"auto"`` (default): the CPU allocator's own
            reports, read through a profiler session that records nothing else (no Python work per operator; the
            dispatch mode runs only in the history window, for stacks), or the dispatch mode where that session
            cannot run (another profiler recording, e.g. ``Trainer(profiler="pytorch")``). ``"dispatch"``: always the
            dispatch mode (for runs that open ``torch.profiler`` themselves). ``"reports"``: the reports only.
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
        allocation_backend: str = "auto",
    ) -> None:
        if allocation_backend not in ("auto", "reports", "dispatch"):
            raise ValueError(f"allocation_backend must be 'auto', 'reports' or 'dispatch', not {allocation_backend!r}")
        self.allocation_backend = allocation_backend
        if allocation_backend != "dispatch" and track_allocations is not False:
            from lightning_memtrace.allocator_reports import track_every_cpu_block

            track_every_cpu_block()
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.track_allocations = track_allocations
        self.history = history
        self.history_skip_steps = history_skip_steps
        self.history_steps = history_steps
        self.max_entries = max_entries
        self.frames_min_bytes = frames_min_bytes
        self.log_metrics = log_metrics
        self.every_n_steps = every_n_steps
        self.max_rows = max_rows
        self.max_snapshots = max_snapshots
        self.post_mortem = post_mortem
        self.gather_ranks = gather_ranks
        self.gather_every_n_steps = gather_every_n_steps
        self.report = report
        self.report_path: Path | None = None
        self.estimate = estimate
        self.estimated: Any = None
        self.estimate_comparison: Any = None

        self.recorder: MemoryRecorder | None = None
        self._max_allocated_bytes = 0
        self._max_reserved_bytes = 0
        self.output_dir: Path | None = None
        self.device: Any = None
        #: The allocation tracker's backend in the last fit (``"reports"`` or ``"dispatch"``), None without tracker.
        self.tracker_backend: str | None = None
        self._rank = 0
        self._disabled = False
        # maxima (MiB) of the rows taken since the last logged training step / in this validation run
        self._train_metrics: dict[str, float] = {}
        self._val_metrics: dict[str, float] = {}
        self._estimate_metrics: dict[str, float] | None = None
        self._rows_total = 0
        self._last_step: int | None = None
        self._files: list[Path] = []
        self._batch_step: int | None = None
        self.last_rank_maxima: dict[str, float] = {}

    # --------------------------------------------------------------------------------------------- helpers
    def _disable(self, reason: str) -> None:
        self._disabled = True
        rank_zero_warn(f"MemTrace switched itself off: {reason}. Training goes on.")
        try:
            self._finish()
        except Exception:
            pass

    def _on_record(self, record: PhaseRecord) -> None:
        self._rows_total += 1
        self._last_step = record.step
        if not self.log_metrics:
            return
        # Several rows of one phase before they are logged (micro-batches of one optimizer step, the batches of a
        # validation run): each key keeps the maximum.
        target = self._val_metrics if record.phase in VAL_PHASES else self._train_metrics
        for key, attribute in _METRIC_KEYS[record.phase]:
            value = getattr(record, attribute) / MIB
            if value > target.get(key, -1.0):
                target[key] = value

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
        self._rank = trainer.global_rank
        if self.dirpath is not None:
            self.output_dir = self.dirpath
        else:
            # trainer.log_dir broadcasts across ranks: resolve it here, where every rank is, never in on_exception.
            log_dir = trainer.log_dir or trainer.default_root_dir
            self.output_dir = Path(log_dir) / MEMTRACE_DIR

    @override
    @_guarded
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish()
        self.device = pl_module.device
        track_allocations = self.track_allocations
        backend = self.allocation_backend
        window_stacks = True
        if backend == "auto" and _profiles_with_torch(trainer):
            backend = "dispatch"  # the thread's profiling session is the user's: see allocations another way
        compiled = _has_compiled_parts(pl_module) and not allocator_has_counters(pl_module.device)
        reports_ok = backend != "dispatch" and _reports_available(pl_module.device)
        if compiled and track_allocations is not False and reports_ok:
            # The allocator's reports see compiled code as it runs; only the window's stacks need the dispatch mode,
            # which would make compiled regions run eagerly: the window goes without stacks.
            backend, window_stacks = "reports", False
        elif compiled and track_allocations is not False:
            if track_allocations is None:
                track_allocations = False
                rank_zero_warn(
                    "MemTrace: the module has torch.compile'd parts. The CPU allocation tracker (a dispatch mode) would "
                    "make them run eagerly, so it is off for this run: allocated_bytes is the sum of the categories and "
                    "peaks inside compiled regions are not seen. Pass MemTrace(track_allocations=True) to trade "
                    "compilation for exact counters."
                )
            else:
                rank_zero_warn("MemTrace: track_allocations=True makes the torch.compile'd parts of the module run eagerly.")
        self.recorder = MemoryRecorder(
            pl_module,
            list(trainer.optimizers),
            device=pl_module.device,
            rank=self._rank,
            output_dir=self.output_dir,
            track_allocations=track_allocations,
            history=self.history,
            history_skip_steps=self.history_skip_steps,
            history_steps=self.history_steps,
            max_entries=self.max_entries,
            frames_min_bytes=self.frames_min_bytes,
            post_mortem=self.post_mortem,
            max_rows=self.max_rows,
            every_n_steps=self.every_n_steps,
            max_snapshots=self.max_snapshots,
            on_record=self._on_record,
            allocation_backend=backend,
        )
        if self.recorder.tracker is not None:
            self.recorder.tracker.window_stacks = window_stacks
        self.recorder.start()
        if self.recorder.tracker is not None:
            self.tracker_backend = self.recorder.tracker.backend

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch_step = trainer.global_step
        self._begin_train_batch(trainer, batch, batch_idx)
        estimate, self._estimate_metrics = self._estimate_metrics, None
        if estimate:
            _log_to_loggers(trainer, estimate, _log_step(trainer))  # outside the guard: a logger's error propagates

    @_guarded
    def _begin_train_batch(self, trainer: pl.Trainer, batch: Any, batch_idx: int) -> None:
        if self.estimate and self.estimated is None and trainer.lightning_module.automatic_optimization:
            self._estimate(trainer, batch)
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
        _log_to_loggers(trainer, metrics, _log_step(trainer))

    @_guarded
    def _end_train_batch(self, trainer: pl.Trainer) -> dict[str, float] | None:
        """Take the batch's last row; return what to log after it: the step's maxima where Lightning logs its own."""
        recorder = self.recorder
        if recorder is None:
            return None
        recorder.end_batch(next_step=trainer.global_step)
        recorder.flush()
        if _accumulating(trainer):
            return None  # the next micro-batches belong to the same optimizer step: keep their maxima together
        metrics, self._train_metrics = self._train_metrics, {}
        return metrics if metrics and _lightning_logs_now(trainer) else None

    def _gather_across_ranks(self, trainer: pl.Trainer, step: int) -> dict[str, float]:
        """Per phase and counter, the maximum over ranks and the rank that holds it (rank zero; empty elsewhere).

        One ``all_reduce(MAX)`` of a small int64 tensor whose entries encode ``bytes << 16 | rank``.
        """
        values = torch.full((len(TRAIN_PHASES), len(COUNTERS)), -1, dtype=torch.int64)
        rank = trainer.global_rank
        try:
            recorder = self.recorder
            for record in list(recorder.records) if recorder is not None and not self._disabled else []:
                if record.step != step or record.phase not in TRAIN_PHASES:
                    continue
                row = TRAIN_PHASES.index(record.phase)
                for column, counter in enumerate(COUNTERS):
                    encoded = (getattr(record, f"{counter}_bytes") << _RANK_BITS) | rank
                    values[row, column] = max(int(values[row, column]), encoded)
        except Exception:
            pass
        try:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                return {}
            reduced = values.to(trainer.strategy.root_device)
            dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
            reduced = reduced.cpu()
        except Exception as error:
            self.gather_ranks = False
            rank_zero_warn(f"MemTrace could not gather memory across ranks ({error!r}); per-rank files are unaffected.")
            return {}
        if not trainer.is_global_zero:
            return {}
        metrics: dict[str, float] = {}
        for row, phase in enumerate(TRAIN_PHASES):
            for column, counter in enumerate(COUNTERS):
                encoded = int(reduced[row, column])
                if encoded < 0:
                    continue
                metrics[f"memtrace/{phase.value}/{counter}_max"] = (encoded >> _RANK_BITS) / MIB
                metrics[f"memtrace/{phase.value}/{counter}_max_rank"] = float(encoded & ((1 << _RANK_BITS) - 1))
        self.last_rank_maxima = metrics
        return dict(metrics)

    @override
    @_guarded
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._val_metrics = {}

    @override
    @_guarded
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.recorder is not None and not trainer.sanity_checking:
            self.recorder.begin_batch(batch, trainer.global_step, trainer.current_epoch, batch_idx, training=False)

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
            _log_to_loggers(trainer, metrics, _log_step(trainer))  # outside the guard: a logger's error propagates

    @_guarded
    def _end_validation(self, trainer: pl.Trainer) -> dict[str, float] | None:
        """Once per validation run: the maxima over its rows, to log at the step Lightning logs the run's metrics."""
        if self.recorder is None or trainer.sanity_checking:
            return None
        self.recorder.flush()
        metrics, self._val_metrics = self._val_metrics, {}
        return metrics or None

    @override
    @_guarded
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish()
        self._write_estimate_comparison()
        if self.report and trainer.is_global_zero:
            self._write_report(trainer)

    def _estimate(self, trainer: pl.Trainer, batch: Any) -> None:
        """Estimate this run on fake tensors from the real module and its first batch; log it."""
        from lightning.pytorch.utilities.rank_zero import rank_zero_info

        from lightning_memtrace.estimator import estimate_for_module

        self.estimated = False
        try:
            estimate = estimate_for_module(
                trainer.lightning_module,
                batch,
                precision=trainer.precision,
                accumulate_grad_batches=trainer.accumulate_grad_batches,
            )
        except Exception as error:
            rank_zero_warn(f"MemTrace could not estimate this run ({type(error).__name__}: {error}); measuring only.")
            return
        self.estimated = estimate
        rank_zero_info(f"MemTrace estimate (fake tensors, before the first step):\n{estimate.table()}")
        metrics = {
            f"memtrace/estimate/{getattr(name, 'value', name)}": value / MIB for name, value in estimate.category_bytes().items()
        }
        metrics["memtrace/estimate/peak"] = estimate.peak_bytes / MIB
        self._estimate_metrics = metrics  # logged by on_train_batch_start, outside the guard

    def _write_estimate_comparison(self) -> None:
        estimate, folder = self.estimated, self.output_dir
        if not estimate or folder is None or not any(folder.glob(phases_filename(self._rank))):
            return
        from lightning_memtrace.estimator import compare_estimate, comparison_path, write_comparison_csv
        from lightning_memtrace.analysis.phases import load_phases

        try:
            phases = load_phases(folder / phases_filename(self._rank))
            self.estimate_comparison = compare_estimate(estimate, phases)
            write_comparison_csv(self.estimate_comparison, comparison_path(folder, self._rank))
        except Exception as error:
            rank_zero_warn(f"MemTrace could not compare the estimate with the run: {error}")

    def _write_report(self, trainer: pl.Trainer) -> None:
        folder = self.output_dir
        if folder is None or not folder.is_dir() or not any(folder.glob(PHASES_GLOB)):
            return
        from lightning_memtrace.report import write_report

        try:
            self.report_path = write_report(folder, folder / "report.html", folder / "timeline.png")
        except Exception as error:
            rank_zero_warn(f"MemTrace could not write the report in {folder}: {error}")
            return
        png = folder / "timeline.png"
        for logger in trainer.loggers:
            experiment = getattr(logger, "experiment", None)
            if png.is_file() and hasattr(experiment, "add_image"):
                import matplotlib.image

                image = matplotlib.image.imread(str(png))[..., :3]
                experiment.add_image("memtrace/timeline", image, global_step=trainer.global_step, dataformats="HWC")

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Runs on each rank for itself: no collective here. Never raises: the training error must propagate unchanged.
        try:
            recorder = self.recorder
            if recorder is not None and is_out_of_memory(exception):
                recorder.write_post_mortem(exception)
        except Exception as error:
            rank_zero_warn(f"MemTrace could not write the post-mortem: {error!r}")
        finally:
            try:
                self._finish()
            except Exception:
                pass

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        try:
            self._finish()
        except Exception:
            pass

    def _finish(self) -> None:
        """Stop the recorder and let go of it: nothing that holds hooks, weak references, files or the trainer stays.

        What stays is plain data: the files written, the counts of ``state_dict``, ``report_path``, the estimate.
        Rows not logged yet are dropped (an unfinished optimizer step; Lightning logs nothing for it either).
        """
        recorder, self.recorder = self.recorder, None
        # (_batch_step stays: a rank whose MemTrace switched itself off still takes part in the gather)
        self._train_metrics, self._val_metrics, self._estimate_metrics = {}, {}, None
        if recorder is None:
            return
        self._files = list(recorder.files)
        if recorder.tracker is not None:
            self.tracker_backend = recorder.tracker.backend
        recorder.stop()
        self._max_allocated_bytes = recorder.max_allocated_bytes
        self._max_reserved_bytes = recorder.max_reserved_bytes

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, "rows": self._rows_total, "last_step": self._last_step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._rows_total = int(state_dict.get("rows", 0) or 0)
        self._last_step = state_dict.get("last_step")
