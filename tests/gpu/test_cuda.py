"""MemTrace on a real CUDA device: allocator counters, the snapshot with phase metadata, a real CUDA OOM.

Skipped without CUDA. Run with ``make test-gpu`` on a machine with a GPU.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from lightning_memtrace import MemTrace, load_phases
from lightning_memtrace.capture.storages import unique_storage_bytes
from lm_helpers import MLP, SparseEmbedding, TinyLM, trainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _gpu_trainer(tmp_path, callbacks, **kwargs):
    return trainer(tmp_path, callbacks, accelerator="gpu", devices=1, **kwargs)


def test_allocator_counters_and_categories(tmp_path):
    callback = MemTrace()
    module = TinyLM(batch_size=4, seq_len=64)
    _gpu_trainer(tmp_path, [callback], max_steps=3).fit(module)
    phases = load_phases(callback.output_dir)
    assert len(phases) == 15
    pbytes = unique_storage_bytes(module.parameters())
    assert (phases.parameters_bytes == pbytes).all()
    first = phases[(phases.step == 0) & (phases.phase == "after_optimizer_step")].iloc[0]
    # AdamW's `step` scalars stay on the CPU (not capturable/fused): exactly 2x the parameters on the device
    assert first.optimizer_state_bytes == 2 * pbytes
    assert first.gradients_bytes == pbytes
    assert (phases.reserved_bytes >= phases.allocated_bytes).all()
    assert (phases.peak_bytes >= phases.allocated_bytes).all()
    # the caching allocator rounds blocks to 512 B: allocated is at least the named categories
    named = phases[["parameters_bytes", "gradients_bytes", "optimizer_state_bytes", "activations_bytes", "inputs_bytes"]].sum(axis=1)
    assert (phases.allocated_bytes >= named).all()
    forward = phases[phases.phase == "after_forward"]
    assert (forward.activations_bytes > 1_000_000).all()
    assert (phases[phases.phase == "after_backward"].activations_bytes == 0).all()


def test_users_own_history_recording_stays_on(tmp_path):
    """A user who records the allocator's history themselves (as PyTorch's docs show, for their own
    ``_dump_snapshot``) still records after the fit: MemTrace's window read their recording and left it on."""
    torch.cuda.memory._record_memory_history(max_entries=50_000)
    try:
        callback = MemTrace()
        _gpu_trainer(tmp_path, [callback], max_steps=4).fit(TinyLM(batch_size=4, seq_len=64))
        assert torch._C._cuda_isHistoryEnabled()
        marker = torch.empty(12345 * 512, dtype=torch.uint8, device="cuda")
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
        assert any(e["action"] == "alloc" and e["size"] == marker.numel() for e in trace)
        with open(callback.output_dir / "snapshot_rank0_steps1-2.pickle", "rb") as handle:
            assert len([e for e in pickle.load(handle)["device_traces"][0] if e["action"] == "alloc"]) > 100
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def test_cuda_snapshot_has_phase_metadata(tmp_path):
    callback = MemTrace()
    _gpu_trainer(tmp_path, [callback], max_steps=4).fit(TinyLM(batch_size=4, seq_len=64))
    path = callback.output_dir / "snapshot_rank0_steps1-2.pickle"
    with open(path, "rb") as handle:
        snapshot = pickle.load(handle)
    trace = snapshot["device_traces"][0]
    allocs = [e for e in trace if e["action"] == "alloc"]
    assert len(allocs) > 100
    if hasattr(torch.cuda.memory, "_set_memory_metadata"):
        stages = [e.get("user_metadata", "").split(" ")[0] for e in allocs]
        # the allocator's tag is per thread and autograd runs the backward on a device thread of its own: MemTrace
        # carries the tag there, so every allocation of the window, the backward's included, has its phase
        assert "" not in stages
        assert {"phase=forward", "phase=backward", "phase=optimizer_step"} <= set(stages)
        backward = [e for e, stage in zip(allocs, stages) if stage == "phase=backward"]
        assert len(backward) > 20
        # Python stacks: the forward's allocations have frames; the device thread runs no Python
        forward = [e for e, stage in zip(allocs, stages) if stage == "phase=forward"]
        assert all(e["frames"] for e in forward)
    assert snapshot["memtrace"]["device"].startswith("cuda")
    from torch.cuda import _memory_viz

    _memory_viz.segsum(snapshot)
    _memory_viz.trace(snapshot)
    # history recording is off again after the window
    later = torch.cuda.memory._snapshot()
    assert not later["device_traces"] or len(later["device_traces"][0]) <= len(trace)


def test_cuda_snapshot_carries_the_rows_categories(tmp_path):
    """The allocator's own snapshot gets the categories the rows named (``capture.cuda_names``): the parameters
    recorded, not inferred; the forward's saved tensors as activations, the backward's gradients as gradients."""
    from torch.cuda import _memory_viz

    from lightning_memtrace.analysis.loader import load_snapshot
    from lightning_memtrace.analysis.replay import replay

    callback = MemTrace()
    module = TinyLM(batch_size=4, seq_len=64)
    _gpu_trainer(tmp_path, [callback], max_steps=4).fit(module)
    path = callback.output_dir / "snapshot_rank0_steps1-2.pickle"
    with open(path, "rb") as handle:
        snapshot = pickle.load(handle)
    allocs = [e for e in snapshot["device_traces"][0] if e["action"] == "alloc"]
    assert {"activations", "gradients"} <= {e["category"] for e in allocs}
    _memory_viz.trace_plot(snapshot)
    dev = replay(load_snapshot(path)).main
    allocations = dev.allocations
    params = allocations[(allocations["category"].astype(str) == "parameters") & ~allocations["inferred"]]
    pbytes = unique_storage_bytes(module.parameters())
    assert pbytes <= int(params["size"].sum()) <= pbytes + 512 * len(list(module.parameters()))
    saved = allocations[(allocations["category"].astype(str) == "activations") & ~allocations["inferred"]]
    assert int(saved["size"].sum()) > 1_000_000


def test_real_cuda_oom_post_mortem(tmp_path):
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(0.5)
    try:
        class Hungry(MLP):
            def training_step(self, batch, batch_idx):
                loss = super().training_step(batch, batch_idx)
                if batch_idx == 1:
                    torch.empty(int(total * 0.6), dtype=torch.uint8, device=self.device)
                return loss

        callback = MemTrace()
        with pytest.raises(torch.OutOfMemoryError):
            _gpu_trainer(tmp_path, [callback], max_steps=3).fit(Hungry())
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    text = (callback.output_dir / "oom_rank0_step1.txt").read_text()
    assert "out of memory on cuda" in text
    assert "died in:       the forward pass" in text
    requested = next(line for line in text.splitlines() if line.startswith("requested:"))
    assert "unknown" not in requested
    with open(callback.output_dir / "oom_rank0_step1.pickle", "rb") as handle:
        snapshot = pickle.load(handle)
    assert snapshot["segments"]
    assert snapshot["memtrace"]["post_mortem"]["requested_bytes"] >= int(total * 0.6)
    # what would fit, estimated on fake CUDA tensors for the module and the batch it died on, against the memory the
    # allocator allowed: half the card here (fake tensors: the failed run's own memory is not touched)
    what_if = snapshot["memtrace"]["post_mortem"]["what_if"]
    allowed = int(total * 0.5) if hasattr(torch.cuda, "get_per_process_memory_fraction") else total
    assert what_if["made"] and what_if["device_memory"] == allowed and len(what_if["what_if"]) >= 5
    assert "what would fit (estimated on fake tensors" in text
    assert all(row["peak_bytes"] > 0 for row in what_if["what_if"])


def test_max_allocated_bytes_is_the_runs_peak_although_rows_reset_the_statistics(tmp_path):
    """MemTrace resets CUDA's peak statistics at every row; MemTrace.max_allocated_bytes keeps the run's peak."""
    torch.manual_seed(0)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    _gpu_trainer(tmp_path / "bare", [], max_steps=3).fit(TinyLM(batch_size=4, seq_len=64))
    bare_peak = torch.cuda.max_memory_allocated()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    callback = MemTrace(history=False, report=False)
    torch.manual_seed(0)
    _gpu_trainer(tmp_path / "mt", [callback], max_steps=3).fit(TinyLM(batch_size=4, seq_len=64))
    phases = load_phases(callback.output_dir)
    assert callback.max_allocated_bytes == max(int(phases.peak_bytes.max()), callback.max_allocated_bytes)
    assert callback.max_allocated_bytes >= phases.peak_bytes.max()
    # the same run without MemTrace peaks at the same bytes (categories add no device memory)
    assert abs(callback.max_allocated_bytes - bare_peak) <= 0.01 * bare_peak
    assert torch.cuda.max_memory_allocated() <= callback.max_allocated_bytes


def test_no_phase_tag_outlives_the_window_on_any_thread(tmp_path):
    """The backward's device thread is tagged only while the window records: a user's own history afterwards (here
    of a run whose window ended with its last step) has no MemTrace tag, on the training thread or the backward's."""
    module = TinyLM(batch_size=4, seq_len=64)
    _gpu_trainer(tmp_path, [MemTrace(report=False)], max_steps=3).fit(module)
    model = module.cuda()
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        batch = {"input_ids": next(iter(module.train_dataloader()))["input_ids"].cuda()}
        model.training_step(batch, 0).backward()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    allocs = [e for e in snapshot["device_traces"][0] if e["action"] == "alloc"]
    assert len(allocs) > 20
    assert not [e.get("user_metadata") for e in allocs if e.get("user_metadata")]


def test_sparse_gradients_on_cuda_are_named_gradients(tmp_path):
    """An ``Embedding(sparse=True)``'s gradient on the device: its indices and values count as gradients, and a
    one-step fit (``fast_dev_run``) still writes its window snapshot."""
    callback = MemTrace(dirpath=tmp_path / "mt", report=False)
    module = SparseEmbedding()
    _gpu_trainer(tmp_path, [callback], max_steps=3).fit(module)
    phases = load_phases(tmp_path / "mt")
    looked_up = module.batch * module.tokens
    sparse_grad = looked_up * 8 + looked_up * module.width * 4
    after_backward = phases[phases.phase == "after_backward"]
    assert (after_backward.gradients_bytes == sparse_grad + unique_storage_bytes(module.head.parameters())).all()
    assert sorted(p.name for p in (tmp_path / "mt").glob("snapshot_*.pickle")) == ["snapshot_rank0_steps1-2.pickle"]
    short = MemTrace(dirpath=tmp_path / "short", report=False)
    _gpu_trainer(tmp_path, [short], fast_dev_run=True).fit(SparseEmbedding())
    assert [p.name for p in (tmp_path / "short").glob("snapshot_*.pickle")] == ["snapshot_rank0_steps0-0.pickle"]


@pytest.mark.parametrize("mode", ["side", "skip"])
def test_a_graph_that_no_backward_goes_through_is_freed_on_cuda(tmp_path, mode):
    """A value only logged, or a step skipped after its forward: its graph is freed as without MemTrace (the pack
    hook keeps saved outputs without their history), so the device's memory at each batch start stays flat."""
    import gc

    from lm_helpers import UnbackpropagatedGraphMLP

    module = UnbackpropagatedGraphMLP(mode)
    callback = MemTrace(dirpath=tmp_path / "mt", history=False, report=False)
    _gpu_trainer(tmp_path, [callback], max_steps=-1, max_epochs=1, limit_train_batches=8).fit(module)
    gc.collect()
    assert [i for i, ref in enumerate(module.relu_outputs) if ref() is not None] == []
    starts = load_phases(tmp_path / "mt").query("phase == 'batch_start'")
    assert len(starts) == 8
    assert (starts.allocated_bytes - starts.gradients_bytes).iloc[1:].nunique() == 1


def test_an_out_of_memory_error_the_user_caught_is_not_the_post_mortems_on_cuda(tmp_path):
    """The allocator's observer keeps the state of every failed allocation, also one the user's code catches; the
    post-mortem of a later error that no allocation raised (a library's) tells that error and its step."""
    from lm_helpers import MLP

    class CaughtThenLibraryOom(MLP):
        def training_step(self, batch, batch_idx):
            if batch_idx == 1:
                try:
                    torch.empty(10**15, dtype=torch.uint8, device=self.device)
                except torch.OutOfMemoryError:
                    pass
            if batch_idx == 3:
                raise torch.OutOfMemoryError("CUDA error: out of memory (raised by a library, not the allocator)")
            return super().training_step(batch, batch_idx)

    callback = MemTrace(dirpath=tmp_path / "mt", report=False, what_if_budget_s=0)
    with pytest.raises(torch.OutOfMemoryError, match="raised by a library"):
        _gpu_trainer(tmp_path, [callback], max_steps=5).fit(CaughtThenLibraryOom())
    assert sorted(p.name for p in (tmp_path / "mt").glob("oom_*")) == ["oom_rank0_step3.pickle", "oom_rank0_step3.txt"]
    with open(tmp_path / "mt" / "oom_rank0_step3.pickle", "rb") as handle:
        post_mortem = pickle.load(handle)["memtrace"]["post_mortem"]
    assert post_mortem["step"] == 3 and post_mortem["requested_bytes"] != 10**15


def test_ddp_rank_on_cuda_holds_the_estimated_buckets(tmp_path):
    """One DDP rank (nccl) on one GPU: DDP's buckets (``gradient_as_bucket_view=False``) are device memory counted as
    ``other`` from the first row, and the estimate made during the fit holds them too."""
    import csv
    import subprocess
    import sys
    from pathlib import Path

    from lm_helpers import launcher_env

    script = Path(__file__).resolve().parents[1] / "ddp_run.py"
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path), "gpu_estimate"],
        capture_output=True, text=True, timeout=300, env=launcher_env(), cwd=str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    folder = tmp_path / "logs" / "version_0" / "memtrace"
    buckets = 4 * (32 * 512 + 512 + 512 * 512 + 512 + 512 + 1)  # the MLP's parameters, fp32, one slot each
    phases = load_phases(folder)
    assert (phases.other_bytes >= buckets).all()  # made when DDP wrapped the model, before MemTrace's first row
    with open(folder / "estimate_vs_measured_rank0.csv") as handle:
        compared = {row["category"]: row for row in csv.DictReader(handle)}
    assert int(compared["other"]["estimated_bytes"]) >= buckets
    # beyond the buckets, CUDA's "other" holds cuBLAS's workspace, which fake tensors never ask for
    assert 0 <= int(compared["other"]["measured_bytes"]) - int(compared["other"]["estimated_bytes"]) <= 64 * 1024**2
    for category in ("parameters", "gradients", "optimizer_state"):
        assert compared[category]["estimated_bytes"] == compared[category]["measured_bytes"]
