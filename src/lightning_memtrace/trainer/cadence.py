"""Logging rows to the Trainer's loggers the way Lightning's built-in callbacks do, on the Trainer's cadence."""

from __future__ import annotations

import lightning.pytorch as pl

from lightning_memtrace.types import COUNTERS, VAL_PHASES, Phase, PhaseRecord
from lightning_memtrace.units import MIB

# per phase: (metric key, PhaseRecord attribute) for each counter, built once
_METRIC_KEYS = {phase: tuple((f"memtrace/{phase.value}/{c}", f"{c}_bytes") for c in COUNTERS) for phase in Phase}


def log_step(trainer: pl.Trainer) -> int:
    """The step Lightning logs its own metrics at: the fit loop's count of batches that stepped."""
    try:
        return int(trainer.fit_loop.epoch_loop._batches_that_stepped)
    except AttributeError:
        return int(trainer.global_step)


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
    batches of a validation run)."""

    def __init__(self) -> None:
        self.train: dict[str, float] = {}
        self.val: dict[str, float] = {}

    def add(self, record: PhaseRecord) -> None:
        target = self.val if record.phase in VAL_PHASES else self.train
        for key, attribute in _METRIC_KEYS[record.phase]:
            value = getattr(record, attribute) / MIB
            if value > target.get(key, -1.0):
                target[key] = value

    def take_train(self) -> dict[str, float]:
        metrics, self.train = self.train, {}
        return metrics

    def take_val(self) -> dict[str, float]:
        metrics, self.val = self.val, {}
        return metrics

    def clear(self) -> None:
        self.train, self.val = {}, {}
