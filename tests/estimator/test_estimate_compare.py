"""An estimate beside a real run: per category, per phase, and the comparison CSV (``estimator.compare``)."""

from __future__ import annotations

import pandas as pd
from estimate_checks import TINY_PARAM_BYTES, TINY_PARAM_TENSORS

from lightning_memtrace.estimator import compare_estimate, comparison_path


def test_compare_estimate_and_comparison_csv(lm_pair, tmp_path):
    phases, est, _ = lm_pair
    table = compare_estimate(est, phases)
    assert list(table.columns) == [
        "category",
        "phase",
        "estimated_bytes",
        "measured_bytes",
        "error_bytes",
        "error_percent",
    ]
    by = table.set_index("category")
    assert by.loc["parameters", "estimated_bytes"] == by.loc["parameters", "measured_bytes"] == TINY_PARAM_BYTES
    assert by.loc["optimizer_state", "measured_bytes"] == 2 * TINY_PARAM_BYTES + 4 * TINY_PARAM_TENSORS
    assert by.loc["optimizer_state", "error_percent"] == 0.0
    assert by.loc["activations", "phase"] == "after_forward"
    assert by.loc["activations", "error_bytes"] == 0
    assert abs(by.loc["peak", "error_percent"]) < 3.0
    assert str(table.estimated_bytes.dtype) == "int64"
    from lightning_memtrace.estimator import write_comparison_csv

    path = write_comparison_csv(table, comparison_path(tmp_path / "memtrace", rank=0))
    assert path.name == "estimate_vs_measured_rank0.csv"
    back = pd.read_csv(path)
    assert list(back.category) == list(table.category)
    assert (back.estimated_bytes == table.estimated_bytes).all()
    assert not list(path.parent.glob(".*.tmp"))
