"""LayerDrop's draws on fake tensors, answered "no layer dropped": the step a real run's peak comes from.

Transformers' models with LayerDrop (OPT, BART, Whisper, wav2vec2 and others) skip a layer in training when
``torch.rand([]) < layerdrop``. A fake tensor has no value, so Python's ``if`` on that comparison cannot be answered
and the fake step would stop there. Transformers before 5.2x draw even when ``layerdrop`` is 0, the default of most
configs; later ones skip the draw then. The answer given here is False (the layer runs): exactly what a real run
does where ``layerdrop`` is 0 (a uniform draw is never below 0), and its largest step where it is above 0.

Only that pattern is answered: the truth of ``draw < p``, a scalar ``torch.rand`` draw against a Python number. Any
other question about a fake value still fails as it did.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from lightning_memtrace.estimator.fake import is_fake

#: ``draw < p`` in every spelling that reaches ``__torch_function__``.
_BELOW = frozenset({torch.Tensor.__lt__, torch.Tensor.lt, torch.lt})
#: How Python's ``if`` asks a tensor for its truth.
_TRUTH = frozenset({torch.Tensor.__bool__})


class _LayerDropMode(TorchFunctionMode):
    """Remembers scalar ``torch.rand`` draws and their comparisons with a number; such a comparison is False."""

    def __init__(self) -> None:
        super().__init__()
        # Weakly, by id: holding the tensors would keep their (fake) bytes alive in the estimate, and a weak set would
        # compare tensors with their own ``==``, which asks for a value a fake tensor does not have.
        self._draws: dict[int, weakref.ref[torch.Tensor]] = {}
        self._below: dict[int, weakref.ref[torch.Tensor]] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _TRUTH and len(args) == 1 and _held(self._below, args[0]):
            return False
        out = func(*args, **kwargs)
        if func is torch.rand and isinstance(out, torch.Tensor) and out.dim() == 0 and is_fake(out):
            _hold(self._draws, out)
        elif (
            func in _BELOW
            and len(args) == 2
            and isinstance(args[1], (int, float))
            and isinstance(out, torch.Tensor)
            and _held(self._draws, args[0])
        ):
            _hold(self._below, out)
        return out


def _hold(table: dict[int, weakref.ref[torch.Tensor]], tensor: torch.Tensor) -> None:
    key = id(tensor)
    table[key] = weakref.ref(tensor, lambda _, key=key: table.pop(key, None))


def _held(table: dict[int, weakref.ref[torch.Tensor]], value: Any) -> bool:
    ref = table.get(id(value))
    return ref is not None and ref() is value


@contextlib.contextmanager
def no_layer_dropped() -> Iterator[None]:
    """Within: ``if torch.rand([]) < p`` on fake tensors is False (see the module's docstring)."""
    with _LayerDropMode():
        yield
