"""The run's Trainer and loggers as the estimate's fake copy of a LightningModule sees them.

The estimate runs the module's own ``training_step`` on fake tensors. What the step reads of its Trainer is the run's
(``global_step``, ``estimated_stepping_batches``, a logger's ``log_dir``); what it writes goes nowhere: a fake step's
values (a loss of 0.0) must not reach the run's logs, and a setting it makes (``self.trainer.should_stop = True``)
must not change the run.
"""

from __future__ import annotations

from typing import Any


class TrainerView:
    """The run's Trainer as the estimate's copy of the module sees it: what it reads is the run's (``global_step``,
    ``estimated_stepping_batches``, ``lr_scheduler_configs``...), its loggers are :class:`SilentLogger` s over the
    run's (a step's ``self.logger.experiment.add_scalar(...)`` runs and writes nothing), and what the copy sets on it
    is dropped."""

    def __init__(self, trainer: Any) -> None:
        object.__setattr__(self, "_viewed", trainer)
        #: What the estimate answers in the run's place (under manual optimization: its optimizers, strategy...).
        object.__setattr__(self, "overrides", {})

    @property
    def logger(self) -> SilentLogger | None:
        loggers = self.loggers
        return loggers[0] if loggers else None

    @property
    def loggers(self) -> list[SilentLogger]:
        viewed = object.__getattribute__(self, "_viewed")
        return [SilentLogger(logger) for logger in getattr(viewed, "loggers", None) or []]

    def __getattr__(self, name: str) -> Any:
        overrides = object.__getattribute__(self, "overrides")
        if name in overrides:
            return overrides[name]
        viewed = object.__getattribute__(self, "_viewed")
        if viewed is None:
            raise AttributeError(f"the estimate's copy of the module has no Trainer to read {name!r} from")
        return getattr(viewed, name)

    def __setattr__(self, name: str, value: Any) -> None:
        return None


class SilentLogger:
    """One of the run's loggers as the estimate's copy sees it: what the logger says of itself (``name``,
    ``version``, ``save_dir``, ``log_dir``) is read from it; every method (``log_metrics``, ``log_hyperparams``, a
    logger's own ``log_image``...) and everything reached through ``experiment`` does nothing and returns
    :data:`DROPPED`. The run's ``experiment`` is never touched (reading it can start a tracking run)."""

    def __init__(self, logger: Any) -> None:
        object.__setattr__(self, "_logger", logger)

    def __getattr__(self, name: str) -> Any:
        logger = object.__getattribute__(self, "_logger")
        if name == "experiment":
            return DROPPED
        value = getattr(logger, name)
        return DROPPED if callable(value) else value

    def __setattr__(self, name: str, value: Any) -> None:
        return None


class _Dropped:
    """Takes any attribute, call, item or ``with`` and does nothing."""

    def __getattr__(self, name: str) -> _Dropped:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> _Dropped:
        return self

    def __getitem__(self, key: Any) -> _Dropped:
        return self

    def __setitem__(self, key: Any, value: Any) -> None:
        return None

    def __setattr__(self, name: str, value: Any) -> None:
        return None

    def __iter__(self) -> Any:
        return iter(())

    def __enter__(self) -> _Dropped:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        return None

    def __repr__(self) -> str:
        return "<dropped by the estimate>"


#: What the estimate's copy gets for a logger's method or ``experiment``: everything done with it goes nowhere.
DROPPED = _Dropped()


def no_logging(*args: Any, **kwargs: Any) -> None:
    """The copy's ``self.log`` and ``self.log_dict``."""
    return None
