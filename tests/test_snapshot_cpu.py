"""Snapshots written on CPU open in torch's own readers and add up to the tracker's counters."""

from __future__ import annotations

import pickle

import torch
from torch.cuda import _memory_viz

from lightning_memtrace import MemoryRecorder


def _train_with_recorder(tmp_path, steps=4):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 128))
    optimizer = torch.optim.AdamW(model.parameters())
    with MemoryRecorder(model, [optimizer], output_dir=tmp_path, history_skip_steps=1, history_steps=2) as recorder:
        for step in range(steps):
            x = torch.randn(32, 128)
            recorder.begin_batch(x, step=step)
            loss = model(x).square().mean()
            recorder.mark_forward_done()
            loss.backward()
            recorder.mark_backward_done()
            optimizer.step()
            optimizer.zero_grad()
            recorder.end_batch()
            if step == 2:
                allocated_at_window_end = recorder.tracker.allocated
    return recorder, allocated_at_window_end


def test_snapshot_passes_torch_readers_and_adds_up(tmp_path):
    recorder, allocated_at_end = _train_with_recorder(tmp_path)
    path = tmp_path / "snapshot_rank0_steps1-2.pickle"
    assert path.is_file()
    with open(path, "rb") as handle:
        snapshot = pickle.load(handle)

    summary = _memory_viz.segsum(snapshot)  # raises if the segment accounting does not add up
    assert "total_reserved" in summary
    text = _memory_viz.trace(snapshot)
    assert text.startswith("Device 0")
    html = _memory_viz.trace_plot(snapshot)
    assert "alloc" in html or len(html) > 1000

    # MemoryViz.js (pytorch.org/memory_viz) unpickles protocols 2-4 only
    assert path.read_bytes()[:2] == b"\x80\x04"
    trace = snapshot["device_traces"][0]
    actions = {e["action"] for e in trace}
    assert actions == {"alloc", "free_requested", "free_completed", "snapshot"}
    # MemoryViz.js crashes on categories without "unknown" among them (a typo in its code): it must be there
    assert trace[-1]["action"] == "snapshot" and trace[-1]["category"] == "unknown"
    assert all({"addr", "size", "time_us", "frames", "stream"} <= set(e) for e in trace)
    assert all(e["frames"] for e in trace if e["action"] == "alloc")  # every allocation in the window has a stack
    assert any(f["filename"] == __file__ for e in trace if e["action"] == "alloc" for f in e["frames"])
    times = [e["time_us"] for e in trace]
    assert times == sorted(times)

    meta = snapshot["memtrace"]
    live = meta["allocated_at_start_bytes"]
    for event in trace:
        if event["action"] == "alloc":
            live += event["size"]
        elif event["action"] == "free_completed":
            live -= event["size"]
    active = sum(b["size"] for s in snapshot["segments"] for b in s["blocks"] if b["state"] == "active_allocated")
    assert live == active == meta["allocated_bytes"] == allocated_at_end
    params = sum(p.numel() * 4 for p in recorder.model.parameters())
    assert meta["categories"]["parameters"] == params
    assert meta["categories"]["optimizer_state"] == 2 * params + 4 * 4
    categories = {b["category"] for s in snapshot["segments"] for b in s["blocks"]}
    assert categories <= {"parameters", "gradients", "optimizer_state", "inputs", "activations", "unknown"}
    assert {"parameters", "optimizer_state"} <= categories
    alloc_categories = {e["category"] for e in trace if e["action"] == "alloc"}
    assert {"activations", "gradients", "inputs"} <= alloc_categories


def test_window_snapshot_is_bounded_by_max_entries(tmp_path):
    model = torch.nn.Linear(16, 16)
    with MemoryRecorder(model, [], output_dir=tmp_path, history_skip_steps=0, history_steps=1, max_entries=20) as rec:
        rec.begin_batch(None, step=0)
        for _ in range(100):
            model(torch.randn(4, 16))
        rec.end_batch(next_step=1)
    with open(tmp_path / "snapshot_rank0_steps0-0.pickle", "rb") as handle:
        snapshot = pickle.load(handle)
    assert len(snapshot["device_traces"][0]) <= 40
