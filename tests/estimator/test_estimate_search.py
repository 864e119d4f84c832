"""The largest micro-batch that fits, and a real run at that size and one more (``estimator.search``)."""

from __future__ import annotations

import itertools

from estimate_checks import real_run
from lm_helpers import MLP

from lightning_memtrace.estimator import InputSpec, estimate_for_module, find_max_batch


def _mlp_peak(batch_size: int) -> int:
    module = MLP(batch_size=batch_size)
    batch = (InputSpec((batch_size, 32)), InputSpec((batch_size, 1)))
    return estimate_for_module(module, batch, steps=2).peak_bytes


def test_max_batch_search_is_monotone_and_holds_on_a_real_run(tmp_path):
    peaks = {b: _mlp_peak(b) for b in range(1, 65)}
    values = [peaks[b] for b in sorted(peaks)]
    assert all(a <= b for a, b in itertools.pairwise(values))
    assert values[-1] > values[0]
    # a budget between the peaks of 40 and 41: the search answers 40, whatever its path
    cap = (peaks[40] + peaks[41]) // 2
    calls: list[int] = []

    def counted(size: int) -> int:
        calls.append(size)
        return peaks[size] if size in peaks else _mlp_peak(size)

    result = find_max_batch(counted, cap, high=1024)
    assert result.batch_size == 40 and not result.capped
    assert sorted(calls) == [1, 2, 40, 41]  # the peak is linear in the batch: the line through 1 and 2 finds it
    # monotone in the budget too
    answers = [find_max_batch(lambda b: peaks.get(b) or _mlp_peak(b), peaks[b]).batch_size for b in (10, 30, 40)]
    assert answers == [10, 30, 40]
    assert find_max_batch(lambda b: peaks.get(b) or _mlp_peak(b), peaks[1] - 1).batch_size == 0
    # run for real: the tracker's peak over the run stays under the cap at 40 and goes over it at 41
    fit = real_run(tmp_path / "b40", MLP(batch_size=40), max_steps=2).peak_bytes.max()
    over = real_run(tmp_path / "b41", MLP(batch_size=41), max_steps=2).peak_bytes.max()
    assert fit <= cap < over
    assert fit == peaks[40] and over == peaks[41]


def _brute_force(peak, budget: int, low: int, high: int) -> tuple[int, bool]:
    fitting = [b for b in range(low, high + 1) if peak(b) <= budget]
    if not fitting or fitting[0] != low:
        return 0, False
    last = low
    while last + 1 <= high and peak(last + 1) <= budget:
        last += 1
    return last, last == high


#: Peaks that grow with the batch, linear or not: plateaus, steps (an allocator's rounding), a late jump, quadratic.
_CURVES = {
    "linear": lambda b: 1000 + 37 * b,
    "quadratic": lambda b: 500 + 3 * b + b * b,
    "steps": lambda b: 4096 * ((b * 700 + 4095) // 4096),
    "flat then steep": lambda b: 10_000 + (b if b < 300 else 50 * b),
    "square root": lambda b: int(1000 * b**0.5),
    "plateaus": lambda b: 100 * (b // 16),
}


def test_the_search_finds_what_trying_every_size_finds():
    """Every curve, budgets around its values, several ``low``/``high``: the same answer as trying every size, in
    at most about 2·log2(high) estimates; four where the peak is linear."""
    high = 1000
    for name, peak in _CURVES.items():
        budgets = sorted({peak(b) + d for b in (1, 2, 3, 7, 64, 299, 300, 301, 512, 999, 1000) for d in (-1, 0, 1)})
        for budget, low in itertools.product(budgets, (1, 3)):
            calls: list[int] = []

            def counted(size: int, peak=peak, calls=calls) -> int:
                calls.append(size)
                return peak(size)

            found = find_max_batch(counted, budget, low=low, high=high)
            expected, capped = _brute_force(peak, budget, low, high)
            assert (found.batch_size, found.capped) == (expected, capped), (name, budget, low)
            assert len(calls) == len(set(calls)) <= 24, (name, budget, low, calls)
            if name == "linear" and 2 * low < expected < high:
                assert len(calls) <= 4, (budget, low, calls)
