"""MemTrace(estimate=True): the estimate before the first step, side by side with the measurement at the end."""

from __future__ import annotations

import pandas as pd

from lightning.pytorch.loggers import CSVLogger
from lightning_memtrace import MemTrace
from lightning_memtrace.capture.storages import unique_storage_bytes
from lm_helpers import MLP, trainer


def test_estimate_logged_and_compared_with_the_run(tmp_path):
    logger = CSVLogger(str(tmp_path), name="csv")
    callback = MemTrace(estimate=True)
    module = MLP()
    trainer(tmp_path, [callback], max_steps=3, logger=logger).fit(module)
    assert callback.estimated
    pbytes = unique_storage_bytes(module.parameters())
    categories = {getattr(k, "value", k): v for k, v in callback.estimated.category_bytes().items()}
    assert categories["parameters"] == pbytes

    comparison = pd.read_csv(callback.output_dir / "estimate_vs_measured_rank0.csv")
    rows = comparison.set_index("category")
    assert rows.loc["parameters", "estimated_bytes"] == rows.loc["parameters", "measured_bytes"] == pbytes
    assert rows.loc["optimizer_state", "estimated_bytes"] == rows.loc["optimizer_state", "measured_bytes"]
    assert abs(rows.loc["peak", "error_percent"]) <= 3.0

    html = (callback.output_dir / "report.html").read_text()
    assert "Estimate vs measured" in html
    metrics = pd.read_csv(f"{logger.log_dir}/metrics.csv")
    assert metrics["memtrace/estimate/parameters"].dropna().iloc[0] * 1024**2 == pbytes
