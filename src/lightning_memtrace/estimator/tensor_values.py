"""Tensor values a training step reads, answered on fake tensors where the answer leaves the memory as it is.

A fake tensor has no values, so a step that reads one (``.item()``, ``float(t)``, ``if t``) stops. Two reads are
common in training steps and change no memory, so the estimate answers them as a run with finite values would:

- **a floating-point value** (``self.log("loss", loss.item())``, a print, a running average): answered with 0.0.
  Nothing here says what the number is; only what follows it would, and a float rarely sets a shape.
- **a check for NaN or infinity** (``if torch.isnan(loss)``, ``if not torch.isfinite(loss).all()``,
  ``loss != loss``, a count of the non-finite values): answered as for finite values, the run's usual path. Such
  answers need the computation behind the value, which :class:`FiniteValuesMode` follows (a Python call per op).
  Argument validation (``torch._is_all_true``: ``torch.distributions``' checks of a distribution's parameters and
  samples) is answered as passing, as in a run that goes on;
  the estimate runs it only after a first run met a read of a bool or an integer (:class:`FiniteCheckNeeded`).

And operators whose output's size follows values: ``bincount`` with a ``minlength`` (a class-balanced loss's
counts; torchmetrics' classification metrics count ``num_classes ** 2`` confusion bins) gets ``minlength`` bins, as a
run whose values stay below it does; CTC loss is answered in :mod:`~lightning_memtrace.estimator.unfaked_ops`.

Any other read (an integer: a size, an index, a count; a bool of a mask; a value of the batch) still stops the
estimate with torch's ``DataDependentOutputException``. Each place answered is kept (:class:`ValuesRead`), and the
estimate says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_memtrace.analysis.frames import asking_frame, format_frame
from lightning_memtrace.capture.frames import capture_frames

aten = torch.ops.aten
_READ_OPS = (aten._local_scalar_dense.default, aten.item.default)
#: The attribute of the estimate's ``FakeTensorMode`` that holds its :class:`ValuesRead`.
_ATTRIBUTE = "_memtrace_values_read"
#: Where answers are made, most places a step's reads are named for.
_MOST_PLACES = 8
#: Frames read above a read: the fake mode's dispatch (and MemTrace's own modes) lie between the user's line and the
#: answer.
_READ_DEPTH = 128


class FiniteCheckNeeded(DataDependentOutputException):
    """A bool was read that :class:`FiniteValuesMode` might answer: run the estimate again with it."""


@dataclasses.dataclass
class ValuesRead:
    """The reads of one estimate that were answered, and whether NaN and infinity checks are followed."""

    finite_checks: bool = False
    places: list[str] = dataclasses.field(default_factory=list)

    def note(self) -> None:
        if len(self.places) < _MOST_PLACES:
            place = format_frame(asking_frame(capture_frames(depth=_READ_DEPTH, own_frames=True)))
            if place not in self.places:
                self.places.append(place)


def _answer_floats(original: Any) -> Any:
    """``original`` (torch's fake read), answering a floating-point read of the estimate's mode with 0.0."""

    def read(fake_mode: Any, func: Any, arg: Any, *args: Any, **kwargs: Any) -> Any:
        values = estimate_values(fake_mode)
        if values is not None and getattr(arg, "item_memo", None) is None:
            if arg.dtype.is_floating_point:
                values.note()
                return 0.0
            if not values.finite_checks:  # a bool or a count, maybe of NaN or infinite values
                raise FiniteCheckNeeded(func)
        return original(fake_mode, func, arg, *args, **kwargs)

    read.answers_the_estimate = True  # type: ignore[attr-defined]
    return read


def _answer_bincount(original: Any) -> Any:
    """``original`` (torch's fake ``bincount``, which refuses without symbolic shapes), answering the estimate's mode
    where ``minlength`` is given: ``minlength`` bins, as a run whose values stay below it gets (torchmetrics' confusion
    counts: ``num_classes ** 2`` bins of valid labels)."""

    def bincount(fake_mode: Any, func: Any, inputs: Any, weights: Any = None, minlength: Any = 0) -> Any:
        values = estimate_values(fake_mode)
        if values is not None and isinstance(minlength, int) and minlength > 0:
            values.note()
            if weights is None:
                dtype = torch.long
            else:
                dtype = torch.float32 if weights.dtype == torch.float32 else torch.float64
            return inputs.new_empty(minlength, dtype=dtype)
        return original(fake_mode, func, inputs, weights, minlength)

    bincount.answers_the_estimate = True  # type: ignore[attr-defined]
    return bincount


def estimate_values(fake_mode: Any) -> ValuesRead | None:
    """The reads answered in ``fake_mode`` where it is the estimate's (:func:`values_answered`), else None: an answer
    of the estimate's is given there only (torch.compile's fake modes get torch's own)."""
    return getattr(fake_mode, _ATTRIBUTE, None)


def _install() -> None:
    # torch looks its fake implementations up per call, so wrapping these entries costs nothing elsewhere; other
    # fake modes (torch.compile's) get torch's answer, since only the estimate's mode carries the attribute.
    from torch._subclasses import fake_impls

    table = getattr(fake_impls, "op_implementations_dict", None)
    if table is None:  # a torch without the table: reads raise as they did
        return
    from lightning_memtrace.estimator import unfaked_ops

    answers = [(op, _answer_floats) for op in _READ_OPS] + [(aten.bincount.default, _answer_bincount)]
    answers += list(unfaked_ops.ANSWERS.items())
    for op, answer in answers:
        # an operator without an entry goes on to torch's other fake implementations where the answer returns
        # NotImplemented (its meta kernel, or the refusal of a dynamic output shape)
        current = table.get(op, _torch_answers)
        if not getattr(current, "answers_the_estimate", False):
            table[op] = answer(current)


def _torch_answers(fake_mode: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    return NotImplemented


@contextlib.contextmanager
def values_answered(mode: Any, finite_checks: bool) -> Iterator[ValuesRead]:
    """Within: the estimate's fake ``mode`` answers floating-point reads (and, with ``finite_checks``, NaN and
    infinity checks, under :class:`FiniteValuesMode`); yields what was answered."""
    _install()
    values = ValuesRead(finite_checks=finite_checks)
    setattr(mode, _ATTRIBUTE, values)
    try:
        if finite_checks:
            with FiniteValuesMode(values):
                yield values
        else:
            yield values
    finally:
        with contextlib.suppress(AttributeError):
            delattr(mode, _ATTRIBUTE)


# ------------------------------------------------------------------------------------------ finite checks
_ALWAYS = {
    aten.isnan.default: False,
    aten.isinf.default: False,
    aten.isposinf.default: False,
    aten.isneginf.default: False,
    aten.isfinite.default: True,
    # torch's argument validation (torch.distributions' constraints): a run that goes on passed it
    aten._is_all_true.default: True,
}
_SAME_VALUE_OPS = {
    aten.alias.default,
    aten.clone.default,
    aten.detach.default,
    aten.lift_fresh.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.expand.default,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.unsqueeze.default,
    aten.permute.default,
    aten.t.default,
    aten.select.int,
    aten.slice.Tensor,
    aten.contiguous.default,
    aten._to_copy.default,
    aten.to.dtype,
    aten.amax.default,
    aten.amin.default,
    aten.max.default,
    aten.min.default,
}
_TRUTH_REDUCTIONS = {
    aten.any.default: any,
    aten.any.dim: any,
    aten.any.dims: any,
    aten.all.default: all,
    aten.all.dim: all,
    aten.all.dims: all,
    # autograd's anomaly mode (``Trainer(detect_anomaly=True)``) checks every gradient: ``isnan(grad)._is_any_true()``
    aten._is_any_true.default: any,
}
_COMPARISONS = {
    aten.eq.Tensor: lambda a, b: a == b,
    aten.eq.Scalar: lambda a, b: a == b,
    aten.ne.Tensor: lambda a, b: a != b,
    aten.ne.Scalar: lambda a, b: a != b,
    aten.gt.Tensor: lambda a, b: a > b,
    aten.gt.Scalar: lambda a, b: a > b,
    aten.ge.Tensor: lambda a, b: a >= b,
    aten.ge.Scalar: lambda a, b: a >= b,
    aten.lt.Tensor: lambda a, b: a < b,
    aten.lt.Scalar: lambda a, b: a < b,
    aten.le.Tensor: lambda a, b: a <= b,
    aten.le.Scalar: lambda a, b: a <= b,
}
_LOGICAL = {
    aten.logical_and.default: lambda a, b: bool(a) and bool(b),
    aten.logical_or.default: lambda a, b: bool(a) or bool(b),
    aten.logical_xor.default: lambda a, b: bool(a) != bool(b),
    aten.bitwise_and.Tensor: lambda a, b: a & b,
    aten.bitwise_or.Tensor: lambda a, b: a | b,
    aten.bitwise_xor.Tensor: lambda a, b: a ^ b,
    aten.mul.Tensor: lambda a, b: a * b,
}
_NEGATIONS = {aten.logical_not.default, aten.bitwise_not.default}
#: In-place ops this follows, each with its functional twin (other in-place ops make their operand unknown).
_IN_PLACE = {
    aten.logical_not_.default: aten.logical_not.default,
    aten.bitwise_not_.default: aten.bitwise_not.default,
    aten.logical_and_.default: aten.logical_and.default,
    aten.logical_or_.default: aten.logical_or.default,
    aten.bitwise_and_.Tensor: aten.bitwise_and.Tensor,
    aten.bitwise_or_.Tensor: aten.bitwise_or.Tensor,
    aten.mul_.Tensor: aten.mul.Tensor,
}
_SUMS = {aten.sum.default, aten.sum.dim_IntList}


class FiniteValuesMode(TorchDispatchMode):
    """Follows what a step computes from NaN and infinity checks, taking every value it has not seen made as finite.

    A tensor whose elements all hold one known value (the result of ``isnan``: all False) is kept with that value;
    comparisons, logical ops, ``any``/``all``, sums and copies of such tensors carry it on, and a read of one
    (``_local_scalar_dense``) is answered with it. A read of anything else goes to the fake mode below, which answers
    floats (:func:`values_answered`) or raises.
    """

    def __init__(self, values: ValuesRead) -> None:
        super().__init__()
        self.values = values
        self._known: dict[int, tuple[weakref.ref, Any]] = {}

    def _value(self, arg: Any) -> Any:
        """The one value every element of ``arg`` holds: a Python scalar as given, a finite-known tensor's, else
        None; ``math.inf`` and NaN scalars stand for themselves."""
        if isinstance(arg, (bool, int, float)):
            return arg
        if isinstance(arg, torch.Tensor):
            entry = self._known.get(id(arg))
            if entry is not None and entry[0]() is arg:
                return entry[1]
        return None

    def _keep(self, out: torch.Tensor, value: Any) -> None:
        if out.dtype == torch.bool:
            value = bool(value)
        elif out.dtype.is_floating_point:
            value = float(value)
        elif not isinstance(value, float) or math.isfinite(value):
            value = int(value)
        else:
            return  # an infinite or NaN value in an integer tensor: not one this follows
        if len(self._known) > 4096:  # values of the step's checks only: drop those gone
            self._known = {k: v for k, v in self._known.items() if v[0]() is not None}
        self._known[id(out)] = (weakref.ref(out), value)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _READ_OPS:
            value = self._value(args[0])
            if value is not None:
                self.values.note()
                return value
            return func(*args, **kwargs)
        value = None
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            # an in-place op's value is its functional twin's, from the operand's value before the write
            value = self._known_result(_IN_PLACE.get(func, func), args, out)
        if self._known and func._schema.is_mutable:  # written in place (``mask.logical_not_()``): no longer known
            for arg in (*args, *kwargs.values()):
                if isinstance(arg, torch.Tensor):
                    self._known.pop(id(arg), None)
        if isinstance(out, torch.Tensor):
            if value is None:
                self._known.pop(id(out), None)  # a new tensor at a reused id, or one written in place
            else:
                self._keep(out, value)
        return out

    def _known_result(self, func: Any, args: Any, out: torch.Tensor) -> Any:
        if func in _ALWAYS:
            return _ALWAYS[func]
        first = self._value(args[0]) if args else None
        if func in _SAME_VALUE_OPS:
            return first
        if func is aten.abs.default:
            return None if first is None else abs(first)
        if func in _NEGATIONS:
            if first is None:
                return None
            # logical_not of anything, bitwise_not of a bool: the truth flipped; bitwise_not of an integer: ~n
            return ~first if func is aten.bitwise_not.default and type(first) is int else not first
        if func in _TRUTH_REDUCTIONS:
            if first is None:
                return None
            return _TRUTH_REDUCTIONS[func]([bool(first)] * min(1, args[0].numel()))
        if func in _SUMS:
            if first is None or args[0].dtype.is_floating_point:
                return None
            return int(first) * (args[0].numel() // max(1, out.numel()))
        if func in _COMPARISONS:
            return self._compared(func, args)
        if func in _LOGICAL and len(args) >= 2:
            second = self._value(args[1])
            if first is None or second is None:
                return None
            return _LOGICAL[func](first, second)
        return None

    def _compared(self, func: Any, args: Any) -> Any:
        left, right = args[0], args[1]
        if left is right:  # x == x: True, x != x: False, for any finite value
            return _COMPARISONS[func](0.0, 0.0)
        a, b = self._value(left), self._value(right)
        if a is not None and b is not None:
            return _COMPARISONS[func](a, b)
        # one side unknown and finite (every value not seen made is), the other infinite or NaN
        known = b if a is None else a
        if isinstance(known, float) and not math.isfinite(known):
            finite = 0.0
            return _COMPARISONS[func](finite, known) if a is None else _COMPARISONS[func](known, finite)
        return None
