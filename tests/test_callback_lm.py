"""MemTrace on a real Lightning run of a tiny causal LM built from config, on CPU: the numbers must be exact."""

from __future__ import annotations

import pickle

import pandas as pd
import pytest
import torch

from lightning_memtrace import MemTrace, load_phases
from lightning_memtrace.capture.storages import unique_storage_bytes
from lm_helpers import TinyLM, trainer

PHASES = ["batch_start", "after_forward", "after_backward", "after_optimizer_step", "batch_end"]


def _fit(tmp_path, module, **kwargs):
    callback = MemTrace()
    fit_trainer = trainer(tmp_path, [callback], **kwargs)
    fit_trainer.fit(module)
    return callback, fit_trainer, load_phases(callback.output_dir)


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lm")
    module = TinyLM(batch_size=4, seq_len=64)
    callback, fit_trainer, phases = _fit(tmp, module, max_steps=4, limit_val_batches=1, val_check_interval=2)
    return module, callback, phases


def _row(phases: pd.DataFrame, step: int, phase: str) -> pd.Series:
    rows = phases[(phases.step == step) & (phases.phase == phase)]
    assert len(rows) == 1, f"expected one {phase} row at step {step}, got {len(rows)}"
    return rows.iloc[0]


def test_rows_per_phase_and_columns(lm_run):
    module, callback, phases = lm_run
    train = phases[~phases.phase.str.startswith("val")]
    assert list(train.phase[:5]) == PHASES
    assert len(train) == 4 * 5
    assert sorted(train.step.unique()) == [0, 1, 2, 3]
    # every row of one batch carries the step at which the batch started
    assert (train.groupby("step").size() == 5).all()
    val = phases[phases.phase.str.startswith("val")]
    assert list(val.phase) == ["val_batch_start", "val_batch_end"] * 2
    byte_columns = [c for c in phases.columns if c.endswith("_bytes")]
    assert all(str(phases[c].dtype) == "int64" for c in byte_columns)
    assert (phases.other_bytes >= 0).all()
    assert (phases.peak_bytes >= phases.allocated_bytes).all()
    assert (phases.reserved_bytes == phases.allocated_bytes).all()  # CPU: no caching allocator


def test_parameters_gradients_and_adamw_state_are_exact(lm_run):
    module, callback, phases = lm_run
    params = list(module.parameters())
    param_bytes = unique_storage_bytes(params)
    assert param_bytes == 13_714_432  # shared/reference: tied embeddings count once
    trainable = unique_storage_bytes(p for p in params if p.requires_grad)
    n_tensors = len(params)
    step_bytes = n_tensors * torch.tensor(0.0).element_size()  # one float32 `step` per parameter tensor, on CPU
    assert (phases.parameters_bytes == param_bytes).all()
    assert _row(phases, 0, "after_backward").gradients_bytes == trainable
    first_step = _row(phases, 0, "after_optimizer_step")
    assert first_step.optimizer_state_bytes == 2 * trainable + step_bytes
    assert _row(phases, 0, "batch_start").optimizer_state_bytes == 0
    assert _row(phases, 0, "after_forward").optimizer_state_bytes == 0
    # the sum of categories never exceeds what is allocated
    categories = phases[["parameters_bytes", "gradients_bytes", "optimizer_state_bytes", "activations_bytes", "inputs_bytes"]].sum(axis=1)
    assert (categories + phases.other_bytes == phases.allocated_bytes).all()


def test_inputs_and_activations(lm_run):
    module, callback, phases = lm_run
    assert (phases.inputs_bytes == 4 * 64 * 8).all()  # int64 input_ids, batch 4 x 64
    train = phases[~phases.phase.str.startswith("val")]
    after_forward = train[train.phase == "after_forward"]
    assert (after_forward.activations_bytes > 1_000_000).all()
    # all saved tensors are released by backward
    assert (train[train.phase != "after_forward"].activations_bytes == 0).all()
    assert (phases[phases.phase.str.startswith("val")].activations_bytes == 0).all()
    # the forward's peak shows up in the after_forward row: at least the activations above what lived at batch start
    start = _row(phases, 1, "batch_start")
    forward = _row(phases, 1, "after_forward")
    assert forward.peak_bytes >= start.allocated_bytes + forward.activations_bytes


def test_lightning_order_gradients_alive_through_next_forward_except_after_validation(lm_run):
    module, callback, phases = lm_run
    trainable = unique_storage_bytes(p for p in module.parameters() if p.requires_grad)
    assert _row(phases, 0, "batch_start").gradients_bytes == 0
    assert _row(phases, 0, "after_forward").gradients_bytes == 0
    # previous step's gradients are alive at the next batch start and through its forward
    assert _row(phases, 1, "batch_start").gradients_bytes == trainable
    assert _row(phases, 1, "after_forward").gradients_bytes == trainable
    assert _row(phases, 3, "batch_start").gradients_bytes == trainable
    # validation ran after step 1 (val_check_interval=2): Lightning set the gradients to None before it
    val_rows = phases[(phases.phase == "val_batch_start")]
    assert (val_rows.gradients_bytes == 0).all()
    assert _row(phases, 2, "batch_start").gradients_bytes == 0
    assert _row(phases, 2, "after_forward").gradients_bytes == 0


def test_snapshot_of_window_written(lm_run):
    module, callback, phases = lm_run
    snapshots = sorted(p.name for p in callback.output_dir.glob("snapshot_rank0_steps*.pickle"))
    assert snapshots == ["snapshot_rank0_steps1-2.pickle"]
    with open(callback.output_dir / snapshots[0], "rb") as handle:
        data = pickle.load(handle)
    phases_in = {(m["step"], m["phase"]) for m in data["memtrace"]["phases"]}
    assert (1, "after_forward") in phases_in and (2, "after_optimizer_step") in phases_in
    assert (0, "after_forward") not in phases_in and (3, "batch_start") not in phases_in
    stages = {e["user_metadata"].split()[0] for e in data["device_traces"][0] if e["action"] == "alloc"}
    assert {"phase=forward", "phase=backward", "phase=optimizer_step"} <= stages


def test_report_written_at_end_of_fit(lm_run):
    module, callback, phases = lm_run
    html = (callback.output_dir / "report.html").read_text()
    assert callback.report_path == callback.output_dir / "report.html"
    from report_pages import external_loads

    assert external_loads(html) == []  # self-contained: nothing loaded from anywhere
    assert (callback.output_dir / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gradient_checkpointing_shrinks_activations(tmp_path, lm_run):
    _, _, plain = lm_run
    _, _, checkpointed = _fit(tmp_path, TinyLM(batch_size=4, seq_len=64, gradient_checkpointing=True), max_steps=2)
    plain_acts = plain[plain.phase == "after_forward"].activations_bytes.iloc[0]
    ckpt_acts = checkpointed[checkpointed.phase == "after_forward"].activations_bytes.iloc[0]
    assert 0 < ckpt_acts < plain_acts / 2
