"""The largest micro-batch that fits a memory budget: doubling, then bisection over estimated peaks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from lightning_memtrace.estimator.result import Estimate


@dataclasses.dataclass(frozen=True)
class MaxBatchResult:
    """The largest micro-batch whose estimated peak fits.

    Attributes:
        batch_size: The largest fitting batch size, 0 if even ``low`` does not fit.
        device_memory: The budget, bytes.
        peaks: Estimated peak per batch size tried.
        capped: True if ``high`` fits (the answer may be larger).
    """

    batch_size: int
    device_memory: int
    peaks: dict[int, int]
    capped: bool = False


def find_max_batch(
    peak_for: Callable[[int], int | Estimate],
    device_memory: int,
    *,
    low: int = 1,
    high: int = 1 << 16,
) -> MaxBatchResult:
    """The largest batch size ``b`` in ``[low, high]`` with ``peak_for(b) <= device_memory``.

    Doubles from ``low`` until a size does not fit, then bisects: O(log b) estimates. The peak grows with the batch
    size, so the answer is monotone: a larger budget never gives a smaller batch.

    Args:
        peak_for: ``fn(batch_size)`` returning a peak in bytes or an :class:`Estimate`.
        device_memory: The budget in bytes.
        low: Smallest batch size to try.
        high: Largest batch size to try.
    """
    peaks: dict[int, int] = {}

    def fits(size: int) -> bool:
        if size not in peaks:
            value = peak_for(size)
            peaks[size] = value.peak_bytes if isinstance(value, Estimate) else int(value)
        return peaks[size] <= device_memory

    low, high = max(1, int(low)), max(1, int(high))
    if not fits(low):
        return MaxBatchResult(0, int(device_memory), dict(sorted(peaks.items())))
    good, bad = low, None
    size = low
    while bad is None:
        size = min(size * 2, high)
        if fits(size):
            good = size
            if size == high:
                return MaxBatchResult(good, int(device_memory), dict(sorted(peaks.items())), capped=True)
        else:
            bad = size
    while bad - good > 1:
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return MaxBatchResult(good, int(device_memory), dict(sorted(peaks.items())))
