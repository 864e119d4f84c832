"""The textbook figures: N·P parameters, N·P gradients, 2·N·P for Adam/AdamW, N·P for SGD with momentum."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import Tensor, nn

from lightning_memtrace.capture.storages import weight_state_tensors
from lightning_memtrace.estimator.inputs import OptimizerName

_ADAM_LIKE = ("Adam", "AdamW", "NAdam", "RAdam", "Adamax")


@dataclasses.dataclass(frozen=True)
class ClosedForm:
    """The textbook figures: N·P parameters and gradients, optimizer state from the optimizer's kind.

    Attributes:
        parameter_count: N, distinct parameters (tied weights once).
        trainable_count: Parameters that require gradients.
        parameter_tensors: Distinct parameter tensors (one Adam ``step`` scalar each).
        parameters_bytes: N·P, and a quantized weight's scales and code tables (bitsandbytes' 4-bit and 8-bit
            weights keep them beside their packed data).
        gradients_bytes: Trainable N·P (gradients have the parameters' dtype).
        optimizer_state_bytes: 2·N·P for Adam-like optimizers, N·P for SGD with momentum, 0 for plain SGD,
            None for an optimizer the formula does not know. Without the ``step`` scalars.
        step_tensor_bytes: The ``step`` scalars that sit on the measured device (CPU runs), else 0.
    """

    parameter_count: int
    trainable_count: int
    parameter_tensors: int
    parameters_bytes: int
    gradients_bytes: int
    optimizer_state_bytes: int | None
    step_tensor_bytes: int

    @property
    def optimizer_state_with_steps_bytes(self) -> int | None:
        if self.optimizer_state_bytes is None:
            return None
        return self.optimizer_state_bytes + self.step_tensor_bytes

    def as_dict(self) -> dict[str, int | None]:
        return dataclasses.asdict(self)


def closed_form(model: nn.Module, optimizer: Any = None, steps_on_device: bool = False) -> ClosedForm:
    """Closed-form figures for a model (real, meta or fake tensors) and its optimizer.

    Args:
        model: The module; tied parameters count once.
        optimizer: A ``torch.optim.Optimizer`` (its class and ``momentum`` decide the state), a list of them (each
            over the parameters it holds), an :class:`OptimizerName`, or None (no optimizer state).
        steps_on_device: Whether Adam's ``step`` scalars live on the measured device (true on CPU runs).
    """
    storages: dict[int, tuple[Tensor, bool]] = {}
    for param in model.parameters():
        key = param.untyped_storage()._cdata
        if key not in storages:
            storages[key] = (param, param.requires_grad)
    count = sum(p.numel() for p, _ in storages.values())
    trainable = sum(p.numel() for p, grad in storages.values() if grad)
    param_bytes = sum(p.numel() * p.element_size() for p, _ in storages.values())
    # a quantized weight's scales and code tables, stored beside it (bitsandbytes)
    scales = {t.untyped_storage()._cdata: t for t in weight_state_tensors(model.parameters(), model)}
    param_bytes += sum(t.untyped_storage().nbytes() for key, t in scales.items() if key not in storages)
    grad_bytes = sum(p.numel() * p.element_size() for p, grad in storages.values() if grad)
    trainable_tensors = sum(1 for _, grad in storages.values() if grad)
    if isinstance(optimizer, (list, tuple)):  # several (manual optimization): each over its own parameters
        state, steps = _optimizers_state(optimizer, steps_on_device)
    else:
        state, steps = _optimizer_state(_optimizer_kind(optimizer), grad_bytes, trainable_tensors, steps_on_device)
    return ClosedForm(count, trainable, len(storages), param_bytes, grad_bytes, state, steps)


def _optimizers_state(optimizers: Any, steps_on_device: bool) -> tuple[int | None, int]:
    """:func:`_optimizer_state` summed over optimizers, each over the distinct trainable parameters it holds."""
    total: int | None = 0
    steps = 0
    for optimizer in optimizers:
        params: dict[int, Tensor] = {}
        for group in getattr(optimizer, "param_groups", []):
            for param in group["params"]:
                if param.requires_grad:
                    params.setdefault(param.untyped_storage()._cdata, param)
        grad_bytes = sum(p.numel() * p.element_size() for p in params.values())
        state, step = _optimizer_state(_optimizer_kind(optimizer), grad_bytes, len(params), steps_on_device)
        total = None if total is None or state is None else total + state
        steps += step
    return total, steps


def _optimizer_state(
    kind: str, grad_bytes: int, trainable_tensors: int, steps_on_device: bool
) -> tuple[int | None, int]:
    """Optimizer state bytes (None where the formula does not know the optimizer) and ``step`` scalar bytes."""
    if kind == "adam":
        return 2 * grad_bytes, 4 * trainable_tensors if steps_on_device else 0
    if kind == "sgd_momentum":
        return grad_bytes, 0
    if kind in ("sgd", "none"):
        return 0, 0
    return None, 0


def _optimizer_kind(optimizer: Any) -> str:
    if optimizer is None:
        return "none"
    if isinstance(optimizer, (str, OptimizerName)):
        name = OptimizerName(str(optimizer).lower())
        if name is OptimizerName.SGD:
            return "sgd_momentum"  # the estimate's ``sgd``: momentum 0.9
        return "sgd" if name is OptimizerName.SGD_PLAIN else "adam"
    name = type(optimizer).__name__
    if name in _ADAM_LIKE:
        return "adam"
    if name == "SGD":
        groups = getattr(optimizer, "param_groups", [])
        return "sgd_momentum" if any(g.get("momentum", 0) for g in groups) else "sgd"
    return "unknown"
