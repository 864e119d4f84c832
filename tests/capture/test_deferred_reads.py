"""Rows read from the CPU allocator's reports many batches after they were taken are the rows read at each batch's
end: the same bytes in every column, also for inputs gone by the time of the read (a DataLoader worker's shared
memory, numpy's memory), with gradient accumulation and validation in between."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from lightning.pytorch import Callback
from torch.utils.data import DataLoader, TensorDataset

from lightning_memtrace import MemTrace, load_phases
from lightning_memtrace.capture import recorder as recorder_module
from lightning_memtrace.capture.phases_writer import PhaseCsvWriter
from lightning_memtrace.capture.reports_backend import AllocatorReports
from lm_helpers import MLP, record_plain_loop, trainer

#: Columns that differ between two runs of the same training: when and which run.
_RUN_COLUMNS = ["time_s", "run"]


def _numpy_collate(items):
    # memory the CPU allocator never reported: numpy's
    xs = np.stack([x.numpy() for x, _ in items])
    ys = np.stack([y.numpy() for _, y in items])
    return torch.from_numpy(xs), torch.from_numpy(ys)


class Loaded(MLP):
    def __init__(self, loader: str) -> None:
        super().__init__(batch_size=8)
        self.loader = loader

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(256, 32, generator=g), torch.randn(256, 1, generator=g))
        if self.loader == "workers":
            return DataLoader(data, batch_size=self.batch_size, num_workers=1)
        if self.loader == "numpy":
            return DataLoader(data, batch_size=self.batch_size, collate_fn=_numpy_collate)
        return DataLoader(data, batch_size=self.batch_size)


#: scenario -> (Trainer arguments, reads of the reports when they wait: one at each validation run's end, one at the
#: fit's end)
SCENARIOS = {
    "worker_inputs": (dict(max_steps=8), 1),
    "numpy_inputs": (dict(max_steps=8), 1),
    "accumulation_and_validation": (
        dict(max_steps=6, accumulate_grad_batches=2, val_check_interval=4, limit_val_batches=3),
        12 // 4 + 1,
    ),
}
_LOADERS = {"worker_inputs": "workers", "numpy_inputs": "numpy", "accumulation_and_validation": "plain"}


def _rows(tmp_path, monkeypatch, scenario: str, read_every_batch: bool):
    monkeypatch.setattr(recorder_module, "_DEFERRED_SECONDS_MAX", 0.0 if read_every_batch else 3600.0)
    drains = _counting_drains(monkeypatch)
    folder = tmp_path / ("every_batch" if read_every_batch else "deferred")
    callback = MemTrace(dirpath=folder, history=False, report=False)
    trainer_kwargs, _ = SCENARIOS[scenario]
    torch.manual_seed(0)
    trainer(tmp_path, [callback], **trainer_kwargs).fit(Loaded(_LOADERS[scenario]))
    assert callback.tracker_backend == "reports"
    return load_phases(folder).drop(columns=_RUN_COLUMNS), len(drains)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_rows_read_late_equal_rows_read_at_each_batch_end(tmp_path, monkeypatch, scenario):
    every_batch, drains_every_batch = _rows(tmp_path, monkeypatch, scenario, read_every_batch=True)
    deferred, drains_deferred = _rows(tmp_path, monkeypatch, scenario, read_every_batch=False)
    trainer_kwargs, reads = SCENARIOS[scenario]
    assert drains_every_batch >= trainer_kwargs["max_steps"] * trainer_kwargs.get("accumulate_grad_batches", 1)
    assert drains_deferred == reads
    assert len(deferred) == len(every_batch) > 0
    assert (deferred["inputs_bytes"] > 0).any()
    assert deferred.to_dict("records") == every_batch.to_dict("records")


def _counting_drains(monkeypatch) -> list[int]:
    drains: list[int] = []
    original = AllocatorReports.drain_columns

    def counting(self, reopen: bool = True):
        drains.append(1)
        return original(self, reopen)

    monkeypatch.setattr(AllocatorReports, "drain_columns", counting)
    return drains


def test_under_a_process_group_the_reports_are_read_at_every_training_batch(tmp_path, monkeypatch):
    """A process group's worker threads free blocks this thread made, which only the totals between two reads tell:
    there the reports are read at the end of every training batch, however young the last read."""
    import torch.distributed as dist

    monkeypatch.setattr(recorder_module, "_DEFERRED_SECONDS_MAX", 3600.0)
    drains = _counting_drains(monkeypatch)

    class PerBatch(Callback):
        def __init__(self) -> None:
            self.counts: list[int] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.counts.append(len(drains))

    per_batch = PerBatch()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        callback = MemTrace(dirpath=tmp_path, history=False, report=False)
        trainer(tmp_path, [callback, per_batch], max_steps=6).fit(MLP())
    finally:
        dist.destroy_process_group()
    assert [b - a for a, b in zip(per_batch.counts, per_batch.counts[1:])] == [1] * 5
    assert len(load_phases(tmp_path)) == 6 * 5


def test_reports_wait_for_a_row_count_or_an_age(tmp_path, monkeypatch):
    """Reads come every ``_DEFERRED_ROWS_MAX`` rows (here 10: every second batch of five rows) or every
    ``_DEFERRED_SECONDS_MAX`` seconds, whichever comes first, and once more when the fit ends."""
    monkeypatch.setattr(recorder_module, "_DEFERRED_ROWS_MAX", 10)
    monkeypatch.setattr(recorder_module, "_DEFERRED_SECONDS_MAX", 3600.0)
    drains = _counting_drains(monkeypatch)
    callback = MemTrace(dirpath=tmp_path, history=False, report=False)
    trainer(tmp_path, [callback], max_steps=8).fit(MLP())
    assert len(drains) == 8 // 2 + 1
    assert len(load_phases(tmp_path)) == 8 * 5


def test_a_plain_loop_reading_records_mid_run_gets_every_row_taken(tmp_path, monkeypatch):
    """``MemoryRecorder.records`` reads the rows still waiting for the reports first: a loop that looks at them after
    each batch sees that batch's five rows, with the bytes of a recorder that reads at every batch's end."""

    def run(read_every_batch: bool) -> list[list]:
        monkeypatch.setattr(recorder_module, "_DEFERRED_SECONDS_MAX", 0.0 if read_every_batch else 3600.0)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        seen = []

        def look_at_rows(recorder, step: int) -> None:
            assert recorder.tracker is not None and recorder.tracker.backend == "reports"
            if not read_every_batch:
                assert recorder.rows_waiting == 5 * (step + 1) - sum(map(len, seen))
            rows = list(recorder.records)
            assert recorder.rows_waiting == 0
            assert len(rows) == 5 * (step + 1)
            seen.append(rows[5 * step :])

        record_plain_loop(model, optimizer, None, 4, 8, after_batch=look_at_rows, history=False)
        # AdamW: exp_avg and exp_avg_sq as large as each parameter, and a float32 step count per parameter
        parameters = list(model.parameters())
        adam_bytes = 2 * sum(p.numel() * p.element_size() for p in parameters) + 4 * len(parameters)
        assert seen[-1][-1].optimizer_state_bytes == adam_bytes == 2 * 4 * (32 * 64 + 64 + 64 + 1) + 4 * 4
        return [[(r.phase, r.allocated_bytes, r.peak_bytes, r.parameters_bytes, r.optimizer_state_bytes,
                  r.activations_bytes, r.inputs_bytes) for r in batch] for batch in seen]

    deferred, every_batch = run(read_every_batch=False), run(read_every_batch=True)
    assert deferred == every_batch


@pytest.mark.parametrize("track_allocations", [True, False], ids=["reports_read_late", "rows_read_at_once"])
@pytest.mark.parametrize("seconds", [3600.0, 0.0], ids=["by_count", "by_age"])
def test_rows_reach_the_csv_together_by_count_or_age_and_at_flush(tmp_path, monkeypatch, track_allocations, seconds):
    """Rows reach the CSV in writes of whole lines on the rule of the deferred reads (here every 10 rows, or at each
    batch's end once ``_DEFERRED_SECONDS_MAX`` has passed), also where they are read at once, and all at ``flush()``
    and at the end."""
    monkeypatch.setattr(recorder_module, "_DEFERRED_ROWS_MAX", 10)
    monkeypatch.setattr(recorder_module, "_DEFERRED_SECONDS_MAX", seconds)
    writes: list[int] = []
    write_many = PhaseCsvWriter.write_many

    def counting(self, records):
        writes.append(len(records))
        return write_many(self, records)

    monkeypatch.setattr(PhaseCsvWriter, "write_many", counting)
    in_csv: list[int] = []

    def after_batch(recorder, step: int) -> None:
        in_csv.append(recorder.rows_written)
        if step == 2:
            recorder.flush()
            in_csv.append(recorder.rows_written)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    recorder = record_plain_loop(
        model, optimizer, tmp_path, 5, 8, after_batch=after_batch, history=False, track_allocations=track_allocations
    )
    if seconds:  # five rows a batch: the 10th row of batches 1 and 4 fills a write, flush() writes batch 2's
        assert (writes, in_csv) == ([10, 5, 10], [0, 10, 10, 15, 15, 25])
    else:  # each batch's rows at its end
        assert (writes, in_csv) == ([5] * 5, [5, 10, 15, 15, 20, 25])
    assert recorder.rows_written == len(load_phases(tmp_path)) == 25
