"""MemTrace with torch.compile, gradient clipping, bf16-mixed, LightningCLI; crash consistency and long runs."""

from __future__ import annotations

import errno
import gc
import os
import pickle
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from lightning_memtrace import MemTrace, MemTraceWarning, load_phases
from lightning_memtrace.capture import recorder as recorder_module
from lightning_memtrace.capture import torch_private
from lightning_memtrace.capture.storages import unique_storage_bytes
from lm_helpers import MLP, trainer

HERE = Path(__file__).resolve().parent
_COMPILES_UNDER_MODES = torch_private.dispatch_modes_let_compiled_code_compile()  # torch 2.9 and later


def _counting_backend():
    """A torch.compile backend that keeps the graphs it is handed and runs them as they are (dynamo reset first)."""
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    return counting_backend, graphs


def _memtrace_says(fit) -> list[str]:
    """The messages of MemTrace's warnings while ``fit()`` runs."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit()
    return [str(w.message) for w in caught if "MemTrace" in str(w.message)]


def _compiled_mlp():
    """The MLP with its net compiled by a backend that counts the graphs it is handed."""
    counting_backend, graphs = _counting_backend()

    class Compiled(MLP):
        def configure_model(self):
            self.net = torch.compile(self.net, backend=counting_backend)

    return Compiled, graphs


def test_compiled_module_with_clipping_and_bf16_mixed(tmp_path):
    Compiled, graphs = _compiled_mlp()
    callback = MemTrace()
    module = Compiled()
    fit = trainer(tmp_path, [callback], max_steps=3, gradient_clip_val=1.0, precision="bf16-mixed").fit
    # the allocator's reports see compiled code run: the tracker stays on, and nothing needs saying
    assert _memtrace_says(lambda: fit(module)) == []
    assert callback.tracker_backend == "reports"
    phases = load_phases(callback.output_dir)
    assert len(phases) == 15
    pbytes = unique_storage_bytes(module.parameters())
    n = len(list(module.parameters()))
    assert (phases.parameters_bytes == pbytes).all()
    assert phases[phases.phase == "after_optimizer_step"].optimizer_state_bytes.tolist() == [2 * pbytes + 4 * n] * 3
    assert (phases[phases.phase == "after_forward"].activations_bytes > 0).all()
    # the module really ran compiled, and was not recompiled because of MemTrace
    assert len(graphs) == 1
    assert (phases.allocated_bytes >= phases.parameters_bytes + phases.optimizer_state_bytes).all()
    # the window's stacks: the eager parts' allocations have them (the optimizer step's), where torch lets compiled
    # code compile under the mode that notes them
    allocations = _window_allocations(callback)
    adam = [e for e in allocations if any(f["name"] == "_single_tensor_adam" for f in e.get("frames", ()))]
    assert (len(adam) > 0) == _COMPILES_UNDER_MODES
    # counted, not summed: the forward's peak is above what is live after it (the compiled code's temporaries)
    forward = phases[phases.phase == "after_forward"]
    assert (forward.peak_bytes > forward.allocated_bytes).all()


def test_compiled_module_with_the_dispatch_tracker_warns_and_runs_compiled(tmp_path):
    Compiled, graphs = _compiled_mlp()
    callback = MemTrace(allocation_backend="dispatch")
    said = _memtrace_says(lambda: trainer(tmp_path, [callback], max_steps=3).fit(Compiled()))
    assert len(said) == 1 and "compile" in said[0] and "allocation tracker" in said[0]
    assert callback.tracker_backend is None
    assert len(graphs) == 1
    assert len(load_phases(callback.output_dir)) == 15


def test_tracker_handler_is_never_compiled_by_dynamo(tmp_path):
    Compiled, graphs = _compiled_mlp()
    callback = MemTrace(track_allocations=True, allocation_backend="dispatch")
    trainer(tmp_path, [callback], max_steps=2).fit(Compiled())
    # under the tracker the compiled part runs eagerly, and MemTrace's own frames were not handed to dynamo
    assert all("lightning_memtrace" not in str(gm.code) for gm in graphs)
    assert len(load_phases(callback.output_dir)) == 10


def _fullgraph_loss_mlp():
    """The MLP with its loss computed by a ``fullgraph=True`` compiled function (as torchao's low-bit optimizers
    compile their step), through a backend that counts the graphs it is handed."""
    counting_backend, graphs = _counting_backend()

    @torch.compile(fullgraph=True, backend=counting_backend)
    def loss_of(out, y):
        return ((out - y) ** 2).mean()

    class FullgraphLoss(MLP):
        def training_step(self, batch, batch_idx):
            x, y = batch
            return loss_of(self(x), y)

    return FullgraphLoss, graphs


@pytest.mark.skipif(not _COMPILES_UNDER_MODES, reason="torch before 2.9 compiles nothing under a dispatch mode")
def test_a_fullgraph_compiled_function_trains_through_the_history_window(tmp_path):
    FullgraphLoss, graphs = _fullgraph_loss_mlp()
    callback = MemTrace()
    module = FullgraphLoss()
    assert _memtrace_says(lambda: trainer(tmp_path, [callback], max_steps=4).fit(module)) == []
    assert callback.tracker_backend == "reports"
    # compiled once and run compiled on every step, the window's (1 and 2) included
    assert len(graphs) == 1
    assert [path.name for path in callback.files] == ["snapshot_rank0_steps1-2.pickle"]
    phases = load_phases(callback.output_dir)
    assert len(phases) == 20
    pbytes = unique_storage_bytes(module.parameters())
    assert (phases.parameters_bytes == pbytes).all()
    n = len(list(module.parameters()))
    assert phases[phases.phase == "after_optimizer_step"].optimizer_state_bytes.tolist() == [2 * pbytes + 4 * n] * 4


@pytest.mark.skipif(not _COMPILES_UNDER_MODES, reason="torch before 2.9 compiles nothing under a dispatch mode")
def test_a_fullgraph_compiled_function_trains_under_the_counting_dispatch_mode(tmp_path):
    FullgraphLoss, graphs = _fullgraph_loss_mlp()
    callback = MemTrace(allocation_backend="dispatch")
    module = FullgraphLoss()
    said = _memtrace_says(lambda: trainer(tmp_path, [callback], max_steps=3).fit(module))
    assert len(said) == 1 and "compiled while the CPU allocation tracker" in said[0] and "not counted" in said[0]
    assert callback.tracker_backend == "dispatch"
    assert len(graphs) == 1  # compiled, not left to run eagerly
    phases = load_phases(callback.output_dir)
    assert len(phases) == 15
    pbytes = unique_storage_bytes(module.parameters())
    n = len(list(module.parameters()))
    assert phases[phases.phase == "after_optimizer_step"].optimizer_state_bytes.tolist() == [2 * pbytes + 4 * n] * 3
    # the compile callback goes with the mode
    from torch._dynamo.callback import callback_handler

    assert not [cb for cb in callback_handler.start_callbacks if "watch_compiles" in cb.__qualname__]


def _window_allocations(callback: MemTrace) -> list[dict]:
    (snapshot,) = callback.files
    with open(snapshot, "rb") as file:
        return [e for trace in pickle.load(file)["device_traces"] for e in trace if e["action"] == "alloc"]


@pytest.mark.parametrize("compiled_before", [True, False])
def test_before_torch_2_9_the_window_notes_no_stacks_once_dynamo_compiled_anything(
    tmp_path, monkeypatch, compiled_before
):
    # Before 2.9 a dispatch mode cannot let compiled code compile: the window's would fail a fullgraph=True function
    # compiled at step 0 (this torch can: its refusal is stood in for here), so it stays off once dynamo compiled.
    monkeypatch.setattr(torch_private, "dispatch_modes_let_compiled_code_compile", lambda: False)
    monkeypatch.setattr(torch_private, "dynamo_compiled_anything", lambda: compiled_before)
    callback = MemTrace()
    trainer(tmp_path, [callback], max_steps=3).fit(MLP())
    allocations = _window_allocations(callback)
    assert len(allocations) > 50
    with_stacks = [e for e in allocations if e.get("frames")]
    assert len(with_stacks) == (len(allocations) if not compiled_before else 0)
    assert len(load_phases(callback.output_dir)) == 15


@pytest.mark.skipif(not _COMPILES_UNDER_MODES, reason="torch before 2.9 compiles nothing under a dispatch mode")
def test_the_estimate_runs_a_fullgraph_compiled_function_eagerly_and_leaves_it_compiled_for_the_run(tmp_path):
    FullgraphLoss, graphs = _fullgraph_loss_mlp()
    callback = MemTrace(estimate=True, what_if_budget_s=0, report=False)
    module = FullgraphLoss()
    assert _memtrace_says(lambda: trainer(tmp_path, [callback], max_steps=3).fit(module)) == []
    # the estimate ran it eagerly on fake tensors; the run compiled it (once) and ran it compiled
    assert len(graphs) == 1
    rows = pd.read_csv(callback.output_dir / "estimate_vs_measured_rank0.csv").set_index("category")
    pbytes = unique_storage_bytes(module.parameters())
    assert rows.loc["parameters", "estimated_bytes"] == rows.loc["parameters", "measured_bytes"] == pbytes
    assert rows.loc["optimizer_state", "estimated_bytes"] == rows.loc["optimizer_state", "measured_bytes"]
    assert abs(rows.loc["peak", "error_percent"]) <= 3.0


def test_lightning_cli_configures_memtrace_from_yaml(tmp_path):
    config = {
        "trainer": {
            "default_root_dir": str(tmp_path),
            "max_steps": 2,
            "accelerator": "cpu",
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "callbacks": [
                {
                    "class_path": "lightning_memtrace.MemTrace",
                    "init_args": {"dirpath": str(tmp_path / "mt"), "history_steps": 1, "max_rows": 7},
                }
            ],
        },
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run(
        [sys.executable, str(HERE / "cli_run.py"), "fit", "--config", str(path)],
        capture_output=True, text=True, timeout=180, cwd=str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    phases = load_phases(tmp_path / "mt")
    assert len(phases) == 7  # max_rows from YAML
    assert [p.name for p in (tmp_path / "mt").glob("snapshot_*")] == ["snapshot_rank0_steps1-1.pickle"]


def test_sigkill_mid_run_leaves_whole_files(tmp_path):
    process = subprocess.Popen(
        [sys.executable, str(HERE / "kill_run.py"), str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        for line in process.stdout:
            if "READY" in line:
                break
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.wait(timeout=60)
    text = (tmp_path / "phases_rank0.csv").read_text()
    lines = text.splitlines()
    phases = load_phases(tmp_path)
    # one write() per whole line: no half line, every row that was written is read back
    assert text.endswith("\n")
    assert all(line.count(",") == 18 for line in lines)  # 19 columns: the two unsharded ones, then dataloader_idx
    assert len(phases) == len(lines) - 1 >= 100
    for pickle_path in tmp_path.glob("*.pickle"):  # a snapshot is either absent or whole
        with open(pickle_path, "rb") as handle:
            pickle.load(handle)


def test_full_disk_mid_run_one_warning_and_training_goes_on(tmp_path, monkeypatch):
    real_write = os.write
    rows_written: list[int] = []

    def failing_write(fd, data):
        if data[:1].isdigit():  # the CSV's rows (not its header)
            if rows_written:
                raise OSError(errno.ENOSPC, "No space left on device")
            rows_written.append(data.count(b"\n"))
        return real_write(fd, data)

    monkeypatch.setattr(recorder_module, "_DEFERRED_SECONDS_MAX", 0.0)  # the rows of every batch written at its end
    monkeypatch.setattr(os, "write", failing_write)
    callback = MemTrace(dirpath=tmp_path / "mt")
    fit_trainer = trainer(tmp_path, [callback], max_steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_trainer.fit(MLP())
    monkeypatch.setattr(os, "write", real_write)
    ours = [w for w in caught if issubclass(w.category, MemTraceWarning)]
    assert len(ours) == 1 and "No space left" in str(ours[0].message)
    assert fit_trainer.global_step == 4
    assert rows_written == [5]  # the first batch's rows: batch_start to batch_end
    assert len(load_phases(tmp_path / "mt")) == 5
    assert not list((tmp_path / "mt").glob("snapshot_*.pickle"))  # recording stopped: no file after the failure


def test_long_run_keeps_process_memory_flat(tmp_path):
    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * page

    class Probe(MLP):
        rss: dict[int, int] = {}

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if self.global_step in (400, 2000):
                gc.collect()
                Probe.rss[self.global_step] = rss()

    callback = MemTrace(dirpath=tmp_path / "mt", log_metrics=False, max_entries=5000)
    trainer(tmp_path, [callback], max_steps=2000, max_epochs=-1).fit(Probe(width=16, batch_size=4))
    assert len(load_phases(tmp_path / "mt")) == 2000 * 5
    growth = Probe.rss[2000] - Probe.rss[400]
    assert growth < 8 * 1024**2, f"RSS grew by {growth} B between steps 400 and 2000"
    assert len(callback._files) == 1  # one window snapshot
