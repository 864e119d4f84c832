"""A real CPU out-of-memory error in a training step: post-mortem written, the error propagates unchanged."""

from __future__ import annotations

import pickle

import pytest
import torch

from lightning_memtrace import MemoryRecorder, MemTrace, load_phases
from lightning_memtrace.capture.storages import unique_storage_bytes
from lm_helpers import MLP, trainer


def test_cpu_oom_in_training_step_writes_post_mortem(tmp_path):
    callback = MemTrace()
    module = MLP(oom_at=1)
    raised = []
    with pytest.raises(RuntimeError, match="can't allocate memory") as info:
        try:
            trainer(tmp_path, [callback], max_steps=3).fit(module)
        except RuntimeError as error:
            raised.append(error)
            raise
    assert "10000000000000" in str(info.value) or "1000000000000000" in str(info.value)
    assert type(info.value) is RuntimeError and info.value is raised[0]

    folder = callback.output_dir
    text = (folder / "oom_rank0_step1.txt").read_text()
    pbytes = unique_storage_bytes(module.parameters())
    assert "requested:     909.5 TiB (1,000,000,000,000,000 B)" in text
    assert "died in:       the forward pass" in text
    assert "step:          1 (epoch 0, batch_idx 1)" in text
    param_line = next(line for line in text.splitlines() if line.strip().startswith("parameters"))
    assert f"({pbytes:,} B)" in param_line
    grad_line = next(line for line in text.splitlines() if line.strip().startswith("gradients"))
    assert f"({pbytes:,} B)" in grad_line  # last step's gradients are alive during this forward
    assert "10 largest live allocations:" in text
    assert "failed at:     " in text and "lm_helpers.py:" in text and "in training_step" in text
    assert "made before MemTrace started" in text  # the parameters were adopted, not allocated under tracking

    with open(folder / "oom_rank0_step1.pickle", "rb") as handle:
        snapshot = pickle.load(handle)
    ooms = [e for e in snapshot["device_traces"][0] if e["action"] == "oom"]
    assert len(ooms) == 1 and ooms[0]["size"] == 10**15
    post = snapshot["memtrace"]["post_mortem"]
    assert post["requested_bytes"] == 10**15 and post["stage"] == "forward"
    assert post["categories"]["parameters"] == pbytes
    # the run's CSV is whole: every row of step 0 and the batch_start of step 1
    phases = load_phases(folder)
    assert list(phases.phase) == ["batch_start", "after_forward", "after_backward", "after_optimizer_step", "batch_end", "batch_start"]


def test_plain_loop_recorder_writes_post_mortem_and_reraises(tmp_path):
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        with MemoryRecorder(model, [optimizer], output_dir=tmp_path) as recorder:
            recorder.begin_batch(torch.randn(8, 64), step=0)
            model(torch.randn(8, 64)).sum().backward()
            recorder.mark_backward_done()
            torch.empty(10**15, dtype=torch.uint8)
    text = (tmp_path / "oom_rank0_step0.txt").read_text()
    assert "died in:       the optimizer step" in text
    assert "(1,000,000,000,000,000 B)" in text
    assert not recorder.started


def test_oom_names_its_post_mortem_and_report_in_one_line(tmp_path, capsys):
    callback = MemTrace()
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        trainer(tmp_path, [callback], max_steps=3).fit(MLP(oom_at=1))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("MemTrace: out of memory")]
    folder = callback.output_dir
    assert lines == [
        f"MemTrace: out of memory at step 1 (forward); post-mortem: {folder / 'oom_rank0_step1.txt'}; "
        f"report: {folder / 'report.html'}"
    ]
    assert (folder / "report.html").is_file() and callback.report_path == folder / "report.html"


def test_plain_loop_oom_names_its_post_mortem(tmp_path, capsys):
    model = torch.nn.Linear(8, 8)
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        with MemoryRecorder(model, [], output_dir=tmp_path, rank=2) as recorder:
            recorder.begin_batch(torch.randn(2, 8), step=4)
            torch.empty(10**15, dtype=torch.uint8)
    err = capsys.readouterr().err.splitlines()
    assert f"[rank 2] MemTrace: out of memory at step 4 (forward); post-mortem: {tmp_path / 'oom_rank2_step4.txt'}" in err
