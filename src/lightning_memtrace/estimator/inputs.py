"""What an estimate is asked about: the precision, the optimizer's name and the batch (tensors or shapes)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_memtrace.types import TextEnum


class Precision(TextEnum):
    """Lightning's precision settings that the estimate knows."""

    FP32 = "32-true"
    FP16_MIXED = "16-mixed"
    BF16_MIXED = "bf16-mixed"
    BF16_TRUE = "bf16-true"
    FP16_TRUE = "16-true"

    @classmethod
    def parse(cls, value: str | int | Precision) -> Precision:
        """Accept Lightning's spellings: ``32``, ``"32"``, ``"32-true"``, ``"bf16"``, ``"16"``..."""
        if isinstance(value, Precision):
            return value
        text = str(value).strip().lower()
        aliases = {
            "32": cls.FP32,
            "32-true": cls.FP32,
            "fp32": cls.FP32,
            "16": cls.FP16_MIXED,
            "16-mixed": cls.FP16_MIXED,
            "bf16": cls.BF16_MIXED,
            "bf16-mixed": cls.BF16_MIXED,
            "bf16-true": cls.BF16_TRUE,
            "16-true": cls.FP16_TRUE,
        }
        if text not in aliases:
            raise ValueError(f"unknown precision {value!r}; use one of {', '.join(p.value for p in cls)}")
        return aliases[text]

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return {Precision.FP16_MIXED: torch.float16, Precision.BF16_MIXED: torch.bfloat16}.get(self)

    @property
    def param_dtype(self) -> torch.dtype | None:
        return {Precision.BF16_TRUE: torch.bfloat16, Precision.FP16_TRUE: torch.float16}.get(self)


class OptimizerName(TextEnum):
    """Optimizers the config-based estimate (and the CLI) can build.

    ``sgd`` is SGD with momentum 0.9 (one momentum buffer per parameter: it has state); ``sgd-plain`` is SGD without
    momentum (no state).
    """

    ADAMW = "adamw"
    ADAM = "adam"
    SGD = "sgd"
    SGD_PLAIN = "sgd-plain"

    @property
    def help(self) -> str:
        """What the name builds, in words."""
        return {
            OptimizerName.ADAMW: "AdamW (2 state tensors per parameter)",
            OptimizerName.ADAM: "Adam (2 state tensors per parameter)",
            OptimizerName.SGD: "SGD with momentum 0.9 (1 state tensor per parameter)",
            OptimizerName.SGD_PLAIN: "SGD without momentum (no state)",
        }[self]


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """A batch tensor given by shape and dtype only (nothing is allocated)."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32


def lm_batch(batch_size: int, seq_len: int) -> dict[str, InputSpec]:
    """The batch of a causal LM as shapes: ``{"input_ids": (batch_size, seq_len) int64}``."""
    return {"input_ids": InputSpec((int(batch_size), int(seq_len)), torch.int64)}


def map_batch(obj: Any, fn: Callable[[Any], Any], depth: int = 0) -> Any:
    """The batch with ``fn`` applied to each leaf (a tensor or an :class:`InputSpec`), containers rebuilt."""
    if depth > 32:
        return obj
    if isinstance(obj, (Tensor, InputSpec)):
        return fn(obj)
    if isinstance(obj, Mapping):
        mapped = {k: map_batch(v, fn, depth + 1) for k, v in obj.items()}
        try:
            return type(obj)(mapped)
        except Exception:  # noqa: BLE001 - a mapping type that cannot be rebuilt from a dict
            return mapped
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*[map_batch(v, fn, depth + 1) for v in obj])
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_batch(v, fn, depth + 1) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(
            obj, **{f.name: map_batch(getattr(obj, f.name), fn, depth + 1) for f in dataclasses.fields(obj) if f.init}
        )
    return obj


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
    else:
        return
    for key, value in items:
        if isinstance(value, Tensor):
            if key == wanted and value.ndim == 2 and _has_values(value):
                yield value
        else:
            yield from _real_2d(value, wanted, depth + 1)


def _has_values(tensor: Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return tensor.device.type != "meta" and not isinstance(tensor, FakeTensor)


def batch_dims(batch: Any) -> tuple[int | None, int | None]:
    """Batch size (first dimension of the first leaf) and sequence length (of ``input_ids``), where known."""
    leaves: list[tuple[int, ...]] = []

    def collect(leaf: Any) -> Any:
        leaves.append(tuple(leaf.shape))
        return leaf

    map_batch(batch, collect)
    if not leaves or not leaves[0]:
        return None, None
    first = leaves[0]
    seq = None
    if isinstance(batch, Mapping) and "input_ids" in batch:
        ids = batch["input_ids"]
        if len(ids.shape) >= 2:
            seq = int(ids.shape[1])
    return int(first[0]), seq
