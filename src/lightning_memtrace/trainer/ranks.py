"""Each phase's maxima over the ranks of a multi-process run, and the rank holding each."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lightning_memtrace.types import COUNTERS, TRAIN_PHASES, PhaseRecord
from lightning_memtrace.units import MIB

_RANK_BITS = 16


def encode_step(records: Iterable[PhaseRecord], step: int, rank: int) -> torch.Tensor:
    """``bytes << 16 | rank`` per (training phase, counter) of this rank's rows of ``step``; -1 where none."""
    values = torch.full((len(TRAIN_PHASES), len(COUNTERS)), -1, dtype=torch.int64)
    for record in records:
        if record.step != step or record.phase not in TRAIN_PHASES:
            continue
        row = TRAIN_PHASES.index(record.phase)
        for column, counter in enumerate(COUNTERS):
            encoded = (getattr(record, f"{counter}_bytes") << _RANK_BITS) | rank
            values[row, column] = max(int(values[row, column]), encoded)
    return values


def all_reduce_max(values: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """The element-wise maximum over ranks (one ``all_reduce``); None outside a process group.

    Every rank must call it at the same point: never from a path only some ranks take (an exception handler).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    reduced = values.to(device)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
    return reduced.cpu()


def decode_maxima(reduced: torch.Tensor) -> dict[str, float]:
    """``memtrace/<phase>/<counter>_max`` (MiB) and ``memtrace/<phase>/<counter>_max_rank`` from the reduced tensor."""
    metrics: dict[str, float] = {}
    for row, phase in enumerate(TRAIN_PHASES):
        for column, counter in enumerate(COUNTERS):
            encoded = int(reduced[row, column])
            if encoded < 0:
                continue
            metrics[f"memtrace/{phase.value}/{counter}_max"] = (encoded >> _RANK_BITS) / MIB
            metrics[f"memtrace/{phase.value}/{counter}_max_rank"] = float(encoded & ((1 << _RANK_BITS) - 1))
    return metrics
