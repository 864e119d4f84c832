"""A training step's backward as Lightning runs it on the estimate's fake tensors: the recorder's rows around it, and
``16-mixed``'s gradient scaling (automatic and manual optimization alike)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_memtrace.capture.recorder import MemoryRecorder
from lightning_memtrace.estimator.fake import backward_in_function_modes


@dataclasses.dataclass(eq=False)
class GradScale:
    """``16-mixed``'s ``GradScaler`` as memory sees it: one fp32 scale on the device from the first backward on, the
    loss multiplied by it before the backward, the gradients by its reciprocal before a step (``unscale_``).

    Attributes:
        enabled: Whether the run scales (``16-mixed``); otherwise nothing is made or changed.
        device: The device of the scale.
        scale: The scale, once made.
    """

    enabled: bool
    device: torch.device
    scale: Tensor | None = None

    def scaled(self, loss: Tensor) -> Tensor:
        if not self.enabled:
            return loss
        if self.scale is None:
            self.scale = torch.full((), 65536.0, dtype=torch.float32, device=self.device)
        return loss * self.scale

    def step(self, optimizer: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Lightning's precision plugins' optimizer step: ``optimizer.step(closure)``; where the run scales (its AMP
        plugin), the closure first, then the gradients unscaled, then the step."""
        if not self.enabled:
            return optimizer.step(closure=closure, **kwargs)
        closure()
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if grads and self.scale is not None:
            torch._foreach_mul_(grads, self.scale.double().reciprocal().float())
        return optimizer.step(**kwargs)


def module_backward(model: Any) -> Callable[..., Any] | None:
    """A LightningModule's own ``backward`` hook where its class overrides Lightning's (``loss.backward()``), which
    Lightning's precision plugins call for every backward (``retain_graph=True`` there keeps the graph alive)."""
    from lightning.pytorch import LightningModule

    if isinstance(model, LightningModule) and type(model).backward is not LightningModule.backward:
        return model.backward
    return None


def recorded_backward(
    recorder: MemoryRecorder,
    loss: Tensor,
    grad_scale: GradScale,
    *args: Any,
    backward: Callable[..., Any] | None = None,
    **kwargs: Any,
) -> None:
    """``loss``'s backward (scaled where the run scales), with the rows of ``on_before_backward`` and
    ``on_after_backward`` around it; through ``backward`` where given (the module's own hook, see
    :func:`module_backward`); ``args`` and ``kwargs`` (``retain_graph``...) go to it or to ``Tensor.backward``."""
    recorder.mark_forward_done()  # on_before_backward
    to_backward = grad_scale.scaled(loss)
    recorder.watch_backward(to_backward)
    if backward is not None:
        backward(to_backward, *args, **kwargs)
    elif args or kwargs:
        to_backward.backward(*args, **kwargs)  # the public path takes them
    else:
        backward_in_function_modes(to_backward)
    del to_backward
    recorder.mark_backward_done()  # on_after_backward
