"""What an estimate is asked about: the precision, the optimizer's name and the batch (tensors or shapes)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_memtrace.capture.storages import transferable_fields
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
    fields = transferable_fields(obj)
    if fields:
        try:
            mapped = copy.copy(obj)  # the user's class, as the training step reads it; its attributes mapped
            mapped.__dict__.update({name: map_batch(value, fn, depth + 1) for name, value in fields.items()})
        except Exception:  # noqa: BLE001 - a class that cannot be copied: left as it is
            return obj
        return mapped
    return obj


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
