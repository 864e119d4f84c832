"""What transformers reads from the batch's values to choose its path, answered on fake tensors as the real batch would.

A fake tensor has shape, dtype and device, and no values. Transformers reads values in a few places that decide what
memory a step takes:

- whether SDPA may skip the causal mask (and take ``is_causal``, the flash kernel's way): is the 2-D padding mask all
  ones? A fake one cannot say, and transformers then builds a ``B×1×L×L`` mask the real run does not (5.x: the
  estimate was 4-5% high) or cannot go on (4.57);
- whether the rows are packed (``position_ids`` restarting within a row, as a padding-free collator makes them): a
  packed batch gets a packed causal mask;
- a one-time warning about padding without a mask, which reads the ids (skipped for fake ids, as transformers 5 does).

Padding and packing are read from the real batch (its ``attention_mask`` and ``position_ids``, at any depth of a
mapping, dataclass, list or tuple); a batch given as shapes or meta tensors has neither.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_memtrace.capture.storages import transferable_fields
from lightning_memtrace.estimator.fake import is_fake, outer_modes_paused

#: The key under which a batch carries its padding (Hugging Face's tokenizers and collators: 1 a token, 0 padding).
ATTENTION_MASK_KEY = "attention_mask"
#: The key under which a batch carries its positions (a packing collator restarts them at each sequence of a row).
POSITION_IDS_KEY = "position_ids"


def batch_has_padding(batch: Any) -> bool:
    """Whether the batch's ``attention_mask`` (a real 2-D tensor under that key, in a mapping or a dataclass at any
    depth) holds a 0. Shapes, meta and fake tensors have no values: read as no padding."""
    return any(bool((mask == 0).any()) for mask in _real_2d(batch, ATTENTION_MASK_KEY))


def batch_is_packed(batch: Any) -> bool:
    """Whether the batch's ``position_ids`` (as :func:`batch_has_padding` finds a mask) hold several sequences in a row:
    a position that is not the one before it plus 1. Without values: read as one sequence per row."""
    return any(
        bool((positions[:, 1:] - positions[:, :-1] != 1).any()) for positions in _real_2d(batch, POSITION_IDS_KEY)
    )


def _real_2d(batch: Any, wanted: str, depth: int = 0) -> Iterator[Tensor]:
    """The real (not meta, not fake) 2-D tensors under the key ``wanted`` at any depth of the batch."""
    if depth > 32:
        return
    if isinstance(batch, Mapping):
        items = list(batch.items())
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        items = [(f.name, getattr(batch, f.name, None)) for f in dataclasses.fields(batch)]
    elif isinstance(batch, (list, tuple)):
        items = [(None, value) for value in batch]
    elif fields := transferable_fields(batch):
        items = list(fields.items())
    else:
        return
    for key, value in items:
        if isinstance(value, Tensor):
            if key == wanted and value.ndim == 2 and _has_values(value):
                yield value
        else:
            yield from _real_2d(value, wanted, depth + 1)


def _has_values(tensor: Tensor) -> bool:
    return tensor.device.type != "meta" and not is_fake(tensor)


@contextlib.contextmanager
def answered_as_the_batch(batch: Any) -> Iterator[None]:
    """Within: transformers' questions about values (see the module's docstring) answered as ``batch`` answers them."""
    packed, padded = batch_is_packed(batch), batch_has_padding(batch)
    masking = sys.modules.get("transformers.masking_utils")
    converter = getattr(sys.modules.get("transformers.modeling_attn_mask_utils"), "AttentionMaskConverter", None)
    model = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            _replaced(masking, "find_packed_sequence_indices", lambda check: _packing_answered(check, packed))
        )
        for owner in (masking, converter):  # the mask check of transformers 5, and 4.57's for older models
            stack.enter_context(
                _replaced(owner, "_ignore_causal_mask_sdpa", lambda check: _padding_answered(check, padded))
            )
        stack.enter_context(_replaced(model, _PADDING_WARNING, _skipped_for_fake_ids))
        yield


@contextlib.contextmanager
def _replaced(owner: Any, name: str, wrap: Callable[[Any], Any]) -> Iterator[None]:
    """Within: ``owner.name`` (a module's function, a class's method or static method) is ``wrap(it)``; nothing
    changes where this transformers has no such function."""
    original = owner.__dict__.get(name) if owner is not None else None
    function = original.__func__ if isinstance(original, staticmethod) else original
    if not callable(function):
        yield
        return
    replacement = wrap(function)
    setattr(owner, name, staticmethod(replacement) if isinstance(original, staticmethod) else replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _packing_answered(check: Any, packed: bool) -> Any:
    """Transformers' packed-sequence check (``find_packed_sequence_indices``), answered for fake position ids as the
    real batch answers it.

    Packed (the batch's ``position_ids`` restart within a row), the check makes its mask from the fake ids as the real
    run makes it from the real ones. One sequence per row (or positions the model makes itself), what the check gives
    is asked of the check itself, on real positions ``[[0, 1]]``: transformers 5 gives None (no packing: SDPA may skip
    the causal mask), 4.57 a mask of zeros in any case (the causal mask is built), made from the fake ids.
    """

    @functools.wraps(check)
    def answered(position_ids: torch.Tensor) -> Any:
        if not is_fake(position_ids) or packed:
            return check(position_ids)
        with outer_modes_paused():
            unpacked = check(torch.arange(2).unsqueeze(0))
        return None if unpacked is None else check(position_ids)

    return answered


def _padding_answered(check: Any, padded: bool) -> Any:
    """Transformers' check whether SDPA may skip the causal mask (``_ignore_causal_mask_sdpa``, whose first argument is
    the 2-D padding mask), answered for a fake mask as the real batch answers it: with no padding the mask is read as
    absent, which the check treats as all ones; with padding the answer is no."""
    name = next(iter(inspect.signature(check).parameters))  # the mask (``padding_mask``, ``attention_mask``)

    @functools.wraps(check)
    def answered(*args: Any, **kwargs: Any) -> Any:
        mask = args[0] if args else kwargs.get(name)
        if is_fake(mask) and mask.dim() == 2:
            if padded:
                return False
            if args:
                args = (None, *args[1:])
            else:
                kwargs[name] = None
        return check(*args, **kwargs)

    return answered


#: Transformers' one-time warning that ``input_ids`` may hold padding and no ``attention_mask`` was given: it reads
#: the ids, so transformers 5 skips it for fake ones, and 4.57 could not go on.
_PADDING_WARNING = "warn_if_padding_and_no_attention_mask"


def _skipped_for_fake_ids(warn: Any) -> Any:
    @functools.wraps(warn)
    def skipped(self: Any, input_ids: Any, *args: Any, **kwargs: Any) -> Any:
        return None if is_fake(input_ids) else warn(self, input_ids, *args, **kwargs)

    return skipped
