"""The largest micro-batch that fits a memory budget: the line through estimated peaks, with doubling and bisection
where it guesses badly."""

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

    A peak grows about linearly with the batch size (the model's states stay, activations and inputs scale), so the
    next size to try is read off the line through two sizes tried: where the peak is linear in the batch, four
    estimates (``low``, ``2·low``, the size the line says is the first too large, and the one before it) where
    doubling and bisection took about ``2·log2(b)``. Where the line guesses badly the search doubles, and bisects
    whenever a guess did not halve the bracket: O(log b) estimates at worst. The answer does not depend on the path:
    the search ends on a size that fits beside the next one, which does not. The peak grows with the batch size, so
    the answer is monotone: a larger budget never gives a smaller batch.

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

    def result(batch_size: int, capped: bool = False) -> MaxBatchResult:
        return MaxBatchResult(batch_size, int(device_memory), dict(sorted(peaks.items())), capped=capped)

    low, high = max(1, int(low)), max(1, int(high))
    if not fits(low):
        return result(0)
    # Up: double, or go where the line through the last two fitting sizes leaves the budget (once: a line that fell
    # short says the peak is not linear here, and doubling bounds the steps).
    previous, good, bad = None, low, None
    size, line_used = min(low * 2, high), False
    while bad is None:
        if not fits(size):
            bad = size
            break
        previous, good = good, size
        if good == high:
            return result(good, capped=True)
        guess = None if line_used or previous is None else _last_fitting_on_line(previous, good, peaks, device_memory)
        line_used = line_used or guess is not None
        size = min(max(guess + 1, good + 1), high) if guess is not None else min(good * 2, high)
    # Between: the line through the bracket's ends, or its middle after a guess that did not halve it.
    width, line_next = bad - good, True
    while bad - good > 1:
        guess = _last_fitting_on_line(good, bad, peaks, device_memory) if line_next else None
        size = min(max(guess, good + 1), bad - 1) if guess is not None else (good + bad) // 2
        if fits(size):
            good = size
        else:
            bad = size
        line_next = guess is None or 2 * (bad - good) <= width
        width = bad - good
    return result(good)


def _last_fitting_on_line(smaller: int, larger: int, peaks: dict[int, int], budget: int) -> int | None:
    """The largest size whose peak, on the line through two sizes' peaks, is within ``budget``; None where the line
    does not rise."""
    rise = peaks[larger] - peaks[smaller]
    if rise <= 0:
        return None
    return smaller + (budget - peaks[smaller]) * (larger - smaller) // rise
