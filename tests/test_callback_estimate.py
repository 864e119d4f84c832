"""MemTrace(estimate=True): the estimate before the first step, side by side with the measurement at the end."""

from __future__ import annotations

import json
import logging
import warnings

import pandas as pd
import pytest
import torch
from torch.utils.data import DataLoader

from lightning.pytorch.loggers import CSVLogger
from lightning_memtrace import MemTrace, MemTraceWarning, load_phases, what_if
from lightning_memtrace.estimator import compare_estimate
from lightning_memtrace.capture.storages import unique_storage_bytes
from lightning_memtrace.estimator.budget import device_memory_bytes
from lm_helpers import MLP, TwoOptimizers, trainer


def test_estimate_logged_and_compared_with_the_run(tmp_path):
    logger = CSVLogger(str(tmp_path), name="csv")
    callback = MemTrace(estimate=True, what_if_budget_s=0)  # the what-if: test_estimate_writes_what_would_fit
    module = MLP()
    trainer(tmp_path, [callback], max_steps=3, logger=logger).fit(module)
    assert callback.what_if_path is None and not list(callback.output_dir.glob("what_if_rank*"))
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
    # MiB in the logger's CSV: exact to the byte once rounded (pandas before 2.0 reads floats with a faster parser that
    # may miss the last bit).
    assert round(metrics["memtrace/estimate/parameters"].dropna().iloc[0] * 1024**2) == pbytes


def test_the_comparison_reads_this_fits_rows_where_an_earlier_fit_wrote_into_the_same_folder(tmp_path):
    # Without a logger both fits write into <root>/memtrace: the phases CSV holds the first fit's rows, then the
    # second's. The second fit's comparison is with its own rows, not the most of both (the wider first model's).
    trainer(tmp_path, [MemTrace(estimate=True, what_if_budget_s=0, report=False)]).fit(MLP(width=256))
    callback = MemTrace(estimate=True, what_if_budget_s=0, report=False)
    module = MLP(width=64)
    trainer(tmp_path, [callback]).fit(module)
    phases = load_phases(callback.output_dir)
    assert phases["run"].nunique() == 2
    own = phases[phases["run"] == callback.run_id]
    rows = pd.read_csv(callback.output_dir / "estimate_vs_measured_rank0.csv").set_index("category")
    pbytes = unique_storage_bytes(module.parameters())
    assert rows.loc["parameters", "measured_bytes"] == pbytes
    assert rows.loc["peak", "measured_bytes"] == own["peak_bytes"].max() < phases["peak_bytes"].max()
    assert abs(rows.loc["peak", "error_percent"]) <= 3.0
    # Called without a run, the comparison takes the table's newest run.
    table = compare_estimate(callback.estimated, phases).set_index("category")
    assert table.loc["peak", "measured_bytes"] == own["peak_bytes"].max()
    (first,) = set(phases["run"]) - {callback.run_id}
    table = compare_estimate(callback.estimated, phases, run=first).set_index("category")
    assert table.loc["peak", "measured_bytes"] == phases["peak_bytes"].max()


def test_estimate_writes_what_would_fit(tmp_path, caplog):
    callback = MemTrace(estimate=True, history=False)
    module = MLP()
    with caplog.at_level(logging.INFO):
        trainer(tmp_path, [callback], max_steps=2).fit(module)
    folder = callback.output_dir
    assert callback.what_if_path == folder / "what_if_rank0.csv"
    # the fit has ended on the console: two lines say what the seconds after it are spent on, and where it went
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("MemTrace: ")]
    assert said[0].startswith("MemTrace: estimating what would fit") and "for up to 60 s" in said[0]
    assert said[1].startswith(f"MemTrace: what would fit: {callback.what_if_path} (") and said[1].endswith(" s)")
    assert len(said) == 2
    written = pd.read_csv(callback.what_if_path)

    first = next(iter(module.train_dataloader()))
    direct = what_if(module, first, device_memory=device_memory_bytes("cpu"), precision="32-true")
    assert list(written.columns) == list(direct.columns) and len(written) == len(direct) >= 5
    assert list(written.remedy) == list(direct.remedy)
    for column in [c for c in direct.columns if c.endswith("_bytes")] + ["max_micro_batch"]:
        assert written[column].dtype.kind == "i" and list(written[column]) == [int(v) for v in direct[column]], column
    assert list(written.fits) == list(direct.fits) and list(written.kind) == list(direct.kind)
    extra = json.loads((folder / "what_if_rank0.json").read_text())
    assert extra["combination"] == direct.attrs["combination"] and extra["peak_bytes"] == direct.attrs["peak_bytes"]

    html = (folder / "report.html").read_text()
    estimate_at, what_if_at = html.index("Estimate vs measured"), html.index("What would fit (what_if_rank0.csv)")
    assert estimate_at < what_if_at
    section = html[what_if_at:]
    assert all(remedy in section for remedy in direct.remedy)
    assert "to fit " in section and ": nothing to change" in section  # the combination line: the MLP fits as it is


def test_estimate_under_manual_optimization_with_two_optimizers(tmp_path):
    callback = MemTrace(estimate=True, history=False, report=False, what_if_budget_s=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, [callback], max_steps=4).fit(TwoOptimizers())
    assert not [str(w.message) for w in caught if str(w.message).startswith("MemTrace")]
    assert callback.estimated and callback.estimated.optimizer == "Adam + SGD"
    phases = pd.read_csv(callback.output_dir / "phases_rank0.csv")
    assert (phases.phase == "after_optimizer_step").sum() == 4  # two optimizer steps in each of two batches
    comparison = pd.read_csv(callback.output_dir / "estimate_vs_measured_rank0.csv").set_index("category")
    for category in ("parameters", "gradients", "optimizer_state", "inputs", "activations"):
        assert comparison.loc[category, "error_bytes"] == 0, category
    assert abs(comparison.loc["peak", "error_percent"]) <= 3.0


class _WithAdafactor(MLP):
    def configure_optimizers(self):
        from transformers.optimization import Adafactor

        return Adafactor(self.parameters(), lr=1e-3, relative_step=False, scale_parameter=False)


def test_an_optimizer_that_calls_the_closure_under_no_grad_is_estimated_as_lightning_runs_it(tmp_path):
    """transformers' Adafactor runs ``step`` under ``no_grad`` and calls the closure there; Lightning's closure turns
    gradients on again, and so does the estimate's (its backward used to fail: the run went unestimated)."""
    pytest.importorskip("transformers")
    callback = MemTrace(estimate=True, what_if_budget_s=0, report=False)
    module = _WithAdafactor()
    trainer(tmp_path, [callback], max_steps=3).fit(module)
    assert callback.estimated is not None and callback.estimated.optimizer == "Adafactor"
    rows = pd.read_csv(callback.output_dir / "estimate_vs_measured_rank0.csv").set_index("category")
    # factored second moments: a row and a column per matrix, a full vector per bias, and a step count per parameter
    matrices = [p for p in module.parameters() if p.dim() == 2]
    vectors = [p for p in module.parameters() if p.dim() == 1]
    factored = sum((p.shape[0] + p.shape[1]) * 4 for p in matrices) + sum(p.numel() * 4 for p in vectors)
    assert rows.loc["optimizer_state", "measured_bytes"] >= factored
    assert rows.loc["optimizer_state", "estimated_bytes"] == rows.loc["optimizer_state", "measured_bytes"]
    assert rows.loc["gradients", "estimated_bytes"] == unique_storage_bytes(module.parameters())
    assert abs(rows.loc["peak", "error_percent"]) < 0.1


class _Batch:
    """A batch class of the user's own, which Lightning moves with its ``to`` (not a container, not a dataclass)."""

    def __init__(self, x, y) -> None:
        self.x, self.y = x, y

    def to(self, *args, **kwargs) -> "_Batch":
        return _Batch(self.x.to(*args, **kwargs), self.y.to(*args, **kwargs))


class _BatchObjectMLP(MLP):
    def training_step(self, batch, batch_idx):
        return super().training_step((batch.x, batch.y), batch_idx)

    def train_dataloader(self):
        loader = super().train_dataloader()
        return DataLoader(loader.dataset, batch_size=self.batch_size, collate_fn=lambda rows: _Batch(
            torch.stack([x for x, _ in rows]), torch.stack([y for _, y in rows])))


def test_a_batch_object_with_its_own_to_is_measured_as_inputs_and_estimated(tmp_path):
    """Its tensors were not found: inputs_bytes 0 (the batch counted as other and activations), and the estimate
    refused the run (the step handed the model real tensors that were not the batch's)."""
    callback = MemTrace(estimate=True, what_if_budget_s=0, report=False)
    module = _BatchObjectMLP()
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemTraceWarning)
        trainer(tmp_path, [callback], max_steps=3).fit(module)
    batch_bytes = 16 * 32 * 4 + 16 * 1 * 4
    phases = load_phases(callback.output_dir)
    assert (phases.inputs_bytes == batch_bytes).all()
    rows = pd.read_csv(callback.output_dir / "estimate_vs_measured_rank0.csv").set_index("category")
    for category in ("parameters", "gradients", "optimizer_state", "inputs", "activations"):
        assert rows.loc[category, "estimated_bytes"] == rows.loc[category, "measured_bytes"], category
    assert rows.loc["inputs", "estimated_bytes"] == batch_bytes
    assert abs(rows.loc["peak", "error_percent"]) <= 3.0
