"""Lightning's manual optimization on the estimate's fake copy of a LightningModule.

Under manual optimization (``self.automatic_optimization = False``) the module's own ``training_step`` does the work:
``self.optimizers()``, ``opt.zero_grad()``, ``self.manual_backward(loss)``, ``opt.step()``, and often
``self.toggle_optimizer(opt)``, ``self.clip_gradients(...)``, ``self.lr_schedulers()``. On the fake copy these reach
what the estimate gives its view of the Trainer (:class:`~lightning_memtrace.estimator.trainer_view.TrainerView`): the
fake optimizers, wrapped as Lightning wraps them (``LightningOptimizer``), their schedulers, and a stand-in strategy
whose backward and optimizer step are Lightning's, with the recorder's rows where the callback takes them
(``after_forward`` at the first backward of a batch, ``after_backward`` after each, ``after_optimizer_step`` after each
step). Never the run's own optimizers, schedulers, gradient scaler or strategy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_memtrace.capture.recorder import MemoryRecorder
from lightning_memtrace.estimator.backward import GradScale, recorded_backward
from lightning_memtrace.estimator.trainer_view import TrainerView


def configured(configured: Any) -> tuple[list[torch.optim.Optimizer], list[Any]]:
    """Every optimizer out of what ``configure_optimizers`` returned, and the schedulers' configs, as Lightning reads
    them for manual optimization."""
    from lightning.pytorch.core.optimizer import _configure_optimizers, _configure_schedulers_manual_opt

    optimizers, schedulers, _ = _configure_optimizers(configured)
    return list(optimizers), _configure_schedulers_manual_opt(schedulers)


@dataclasses.dataclass(eq=False)
class ManualOptimization:
    """The Trainer's side of manual optimization for the fake copy: its optimizers, schedulers and strategy.

    Attributes:
        optimizers: The fake optimizers, in ``configure_optimizers``' order.
        scheduler_configs: Their schedulers' configs (``self.lr_schedulers()``).
        recorder: The estimate's recorder.
        grad_scale: ``16-mixed``'s gradient scaling (the loss scaled, gradients unscaled before a step).
        on_step: Called after each optimizer step (Lightning counts every one in ``global_step``).
        module_backward: The module's own ``backward`` hook where it overrides Lightning's (see
            :func:`~lightning_memtrace.estimator.backward.module_backward`).
    """

    optimizers: list[torch.optim.Optimizer]
    scheduler_configs: list[Any]
    recorder: MemoryRecorder
    grad_scale: GradScale
    on_step: Callable[[], None]
    module_backward: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        from lightning.pytorch.core.optimizer import LightningOptimizer

        self._attached: tuple[nn.Module, Any] | None = None
        self.strategy = _Strategy(self)
        to_lightning = LightningOptimizer._to_lightning_optimizer
        self.lightning_optimizers = [to_lightning(optimizer, self.strategy) for optimizer in self.optimizers]
        for wrapped in self.lightning_optimizers:
            wrapped._on_after_step = self.on_step

    def attach(self, model: nn.Module) -> None:
        """Give the copy's view of the Trainer (made here where the module has no Trainer) these answers, until
        :meth:`detach`."""
        from lightning.pytorch.plugins.precision import Precision as PlainPrecision

        previous = model.__dict__.get("_trainer")
        self._attached = (model, previous)
        # the copy's own view is left as it was: a new one over the same Trainer
        viewed = object.__getattribute__(previous, "_viewed") if isinstance(previous, TrainerView) else previous
        view = TrainerView(viewed)
        model.__dict__["_trainer"] = view
        view.overrides.update(
            strategy=self.strategy,
            optimizers=list(self.optimizers),
            lr_scheduler_configs=list(self.scheduler_configs),
            # clip_gradients' path; the run's plugin would unscale with the run's own gradient scaler
            precision_plugin=PlainPrecision(),
            gradient_clip_val=getattr(viewed, "gradient_clip_val", None),
            gradient_clip_algorithm=getattr(viewed, "gradient_clip_algorithm", None),
        )

    def detach(self) -> None:
        """Give the module back the Trainer (or view) it had (a module estimated in place keeps nothing of ours)."""
        attached = self._attached
        if attached is not None:
            attached[0].__dict__["_trainer"] = attached[1]
            self._attached = None

    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        """``manual_backward``: the rows of ``on_before_backward`` and ``on_after_backward`` around the backward."""
        recorded_backward(self.recorder, loss, self.grad_scale, *args, backward=self.module_backward, **kwargs)
        return loss

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Lightning's precision plugins' step of the optimizer a ``LightningOptimizer`` wraps."""
        return self.grad_scale.step(getattr(optimizer, "optimizer", optimizer), closure, **kwargs)


class _Strategy:
    """The strategy the copy's ``LightningOptimizer`` and ``manual_backward`` call."""

    def __init__(self, manual: ManualOptimization) -> None:
        self._manual = manual

    @property
    def _lightning_optimizers(self) -> Sequence[Any]:
        return self._manual.lightning_optimizers

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        return self._manual.backward(closure_loss, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        return self._manual.optimizer_step(optimizer, closure, **kwargs)
