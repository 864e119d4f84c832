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
    assert len(calls) <= 16  # doubling, then bisection
    # monotone in the budget too
    answers = [find_max_batch(lambda b: peaks.get(b) or _mlp_peak(b), peaks[b]).batch_size for b in (10, 30, 40)]
    assert answers == [10, 30, 40]
    assert find_max_batch(lambda b: peaks.get(b) or _mlp_peak(b), peaks[1] - 1).batch_size == 0
    # run for real: the tracker's peak over the run stays under the cap at 40 and goes over it at 41
    fit = real_run(tmp_path / "b40", MLP(batch_size=40), max_steps=2).peak_bytes.max()
    over = real_run(tmp_path / "b41", MLP(batch_size=41), max_steps=2).peak_bytes.max()
    assert fit <= cap < over
    assert fit == peaks[40] and over == peaks[41]
