"""Operators torch's fake tensors cannot run, answered for the estimate as their kernels size their outputs.

**CTC loss** (speech recognition: ``nn.CTCLoss``, NeMo's and transformers' CTC models). The forward's ``log_alpha``,
saved for the backward, has ``2 * longest target + 1`` columns, a value, so fake tensors refuse it as data-dependent;
the backward has no meta kernel, and torch's fake mode would run the real kernel on zeros of the real sizes (real
memory, on the run's device: the estimate never does). Both are answered here as torch's CPU and CUDA kernels size
their outputs:

- forward: ``neg_log_likelihood`` (batch) and ``log_alpha`` (batch, time, 2 * longest target + 1). The longest target
  is read from ``target_lengths`` given as integers; given as a tensor (``F.ctc_loss``' usual call), it is the padded
  targets' width: a batch padded to its longest target, as collators pad. Concatenated (1-D) targets with lengths in
  a tensor still stop the estimate: their longest target could be any part of them.
- backward: the gradient, contiguous, in ``log_probs``' shape. What its kernel holds beside it (``log_beta``, as
  large as ``log_alpha``) is measured for CPU targets with the other kernels' scratch
  (:mod:`~lightning_memtrace.estimator.kernel_scratch`).

**The margin losses' backward** (``F.multi_margin_loss``, ``F.multilabel_margin_loss``): no meta kernel either; the
gradient, contiguous, in the input's shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_memtrace.estimator.tensor_values import estimate_values

aten = torch.ops.aten


def _answer_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    def ctc_loss(
        fake_mode: Any, func: Any, log_probs: Any, targets: Any, input_lengths: Any, target_lengths: Any, *args: Any,
        **kwargs: Any,
    ) -> Any:
        values = estimate_values(fake_mode)
        if values is not None and log_probs.dim() == 3:
            if isinstance(target_lengths, (list, tuple)):
                longest: int | None = max((int(length) for length in target_lengths), default=0)
            elif targets.dim() == 2:
                values.note()  # the padded width stands for the longest target
                longest = int(targets.shape[1])
            else:
                longest = None
            if longest is not None:
                time, batch = int(log_probs.shape[0]), int(log_probs.shape[1])
                return log_probs.new_empty(batch), log_probs.new_empty(batch, time, 2 * longest + 1)
        return original(fake_mode, func, log_probs, targets, input_lengths, target_lengths, *args, **kwargs)

    ctc_loss.answers_the_estimate = True  # type: ignore[attr-defined]
    return ctc_loss


def _answer_gradient_like_input(original: Callable[..., Any]) -> Callable[..., Any]:
    """A backward ``(grad_output, input, ...)`` whose kernel returns a new contiguous gradient shaped as ``input``."""

    def gradient_like_input(fake_mode: Any, func: Any, grad: Any, input: Any, *args: Any, **kwargs: Any) -> Any:
        if estimate_values(fake_mode) is not None:
            return input.new_empty(input.shape)
        return original(fake_mode, func, grad, input, *args, **kwargs)

    gradient_like_input.answers_the_estimate = True  # type: ignore[attr-defined]
    return gradient_like_input


#: Each operator and how its answer wraps torch's fake implementation (installed by
#: :func:`~lightning_memtrace.estimator.tensor_values.values_answered`).
ANSWERS: dict[Any, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    aten._ctc_loss.default: _answer_forward,
    aten._ctc_loss.Tensor: _answer_forward,
    aten._ctc_loss_backward.default: _answer_gradient_like_input,
    aten._ctc_loss_backward.Tensor: _answer_gradient_like_input,
    aten.multi_margin_loss_backward.default: _answer_gradient_like_input,
    aten.multilabel_margin_loss_backward.default: _answer_gradient_like_input,
}
#: CTC loss's backward: its kernel holds ``log_beta`` beside the gradient (measured on CPU).
CTC_BACKWARD_OPS = frozenset({aten._ctc_loss_backward.default, aten._ctc_loss_backward.Tensor})
