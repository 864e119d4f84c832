"""Logging rows to the Trainer's loggers the way Lightning's built-in callbacks do, on the Trainer's cadence."""

from __future__ import annotations

from operator import attrgetter

import lightning.pytorch as pl

from lightning_memtrace.types import COUNTERS, VAL_PHASES, Phase, PhaseRecord
from lightning_memtrace.units import MIB

# per phase: (metric key, PhaseRecord attribute) for each counter, built once
_METRIC_KEYS = {phase: tuple((f"memtrace/{phase.value}/{c}", f"{c}_bytes") for c in COUNTERS) for phase in Phase}
# per phase: the metric keys, and the row's counters (bytes) in their order, read at C speed: every row passes here
_METRIC_VALUES = {
    phase: (tuple(key for key, _ in keys), attrgetter(*(attribute for _, attribute in keys)))
    for phase, keys in _METRIC_KEYS.items()
}


def log_step(trainer: pl.Trainer) -> int:
    """The step Lightning logs its own metrics at: the fit loop's count of batches that stepped."""
    try:
        return int(trainer.fit_loop.epoch_loop._batches_that_stepped)
    except AttributeError:
        return int(trainer.global_step)


def last_step_of_fit(trainer: pl.Trainer) -> int | None:
    """The last global step this fit will reach (``estimated_stepping_batches`` less one), or None where unknown (no
    step limit, an iterable dataset without one, data not loaded yet: nothing is loaded for this)."""
    if trainer.max_epochs != -1 and trainer.train_dataloader is None:
        return None
    try:
        total = trainer.estimated_stepping_batches
    except Exception:  # a Trainer state this cannot be read in: the window keeps its own place
        return None
    if not isinstance(total, int) or total <= 0:
        return None  # inf: no limit; -1: an iterable dataset with no max_steps
    return total - 1


def accumulating(trainer: pl.Trainer) -> bool:
    """This batch only accumulates gradients: Lightning logs no step metrics after it (automatic optimization)."""
    try:
        return bool(trainer.fit_loop._should_accumulate()) and trainer.lightning_module.automatic_optimization
    except AttributeError:
        return False


def lightning_logs_now(trainer: pl.Trainer) -> bool:
    """Lightning logs its step metrics after this training batch (``LoggerConnector.update_train_step_metrics``)."""
    if accumulating(trainer):
        return False
    connector = getattr(trainer, "_logger_connector", None)
    try:
        should = bool(connector.should_update_logs)  # type: ignore[union-attr]
    except AttributeError:
        every = trainer.log_every_n_steps
        should = bool(every) and ((log_step(trainer) + 1) % every == 0 or trainer.should_stop)
    return should or bool(trainer.fast_dev_run)


def log_to_loggers(trainer: pl.Trainer, metrics: dict[str, float], step: int) -> None:
    """Log through Lightning's own path, as its built-in callbacks do; a logger's exception propagates unchanged.

    The loggers get the metrics; ``trainer.logged_metrics`` is left as it was, so code that reads it (a user's
    callback, a test of the keys a module logs) sees what it saw without MemTrace.
    """
    if not metrics or not trainer.loggers:
        return
    connector = getattr(trainer, "_logger_connector", None)
    log_metrics = getattr(connector, "log_metrics", None)
    if callable(log_metrics):
        kept = getattr(connector, "_logged_metrics", None)
        logged_before = dict(kept) if isinstance(kept, dict) else None
        try:
            log_metrics(metrics, step=step)  # every logger: log_metrics(metrics=..., step=...), then save()
        finally:
            if logged_before is not None:
                kept.clear()
                kept.update(logged_before)
        return
    for logger in trainer.loggers:
        logger.log_metrics(metrics=metrics, step=step)
        logger.save()


def profiles_with_torch(trainer: pl.Trainer) -> bool:
    """The Trainer's profiler records with ``torch.profiler`` (it would take the thread's session over)."""
    try:
        from lightning.pytorch.profilers import PyTorchProfiler
    except ImportError:
        return False
    return isinstance(getattr(trainer, "profiler", None), PyTorchProfiler)


class RowMaxima:
    """The maxima (MiB) of the rows taken since they were last handed out, per metric key, training and validation
    apart: several rows of one phase come before they are logged (the micro-batches of one optimizer step, the
    batches of a validation run).

    Training rows may arrive after the batches that took them (read from the CPU allocator's reports every second or
    so): :meth:`take_train` says how many training rows were taken by then, and those still to arrive of them are
    left out of the next maxima.
    """

    def __init__(self) -> None:
        # in bytes until handed out
        self.train: dict[str, int] = {}
        self.val: dict[str, int] = {}
        self._train_arrived = 0
        self._train_from = 0

    def add(self, record: PhaseRecord) -> None:
        if record.phase in VAL_PHASES:
            target = self.val
        else:
            self._train_arrived += 1
            if self._train_arrived <= self._train_from:
                return  # taken before the last hand-out: its step's maxima were handed out (or dropped) then
            target = self.train
        keys, values = _METRIC_VALUES[record.phase]
        for key, value in zip(keys, values(record)):
            if value > target.get(key, -1):
                target[key] = value

    def take_train(self, rows_taken: int) -> dict[str, float]:
        """The maxima of the training rows arrived so far; the next ones start after the first ``rows_taken``."""
        maxima, self.train = self.train, {}
        self._train_from = max(self._train_from, rows_taken)
        return _in_mib(maxima)

    def take_val(self) -> dict[str, float]:
        maxima, self.val = self.val, {}
        return _in_mib(maxima)

    def clear(self) -> None:
        self.train, self.val = {}, {}
        self._train_arrived = self._train_from = 0


def _in_mib(maxima: dict[str, int]) -> dict[str, float]:
    return {key: nbytes / MIB for key, nbytes in maxima.items()}
