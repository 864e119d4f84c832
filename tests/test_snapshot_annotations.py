"""MemTrace's CPU snapshots carry torch's ``external_annotations``: its phases and the user's ``record_function``
ranges as START/END pairs; the reader, ``memtrace summary`` and the report give the live bytes at each of them."""

from __future__ import annotations

import json
import pickle
import re

import pytest
import torch
from lm_helpers import MLP, trainer
from torch.cuda import _memory_viz

from lightning_memtrace import MemoryRecorder, MemTrace
from lightning_memtrace.analysis.annotations import annotated_ranges, annotation_rows
from lightning_memtrace.analysis.loader import load_snapshot
from lightning_memtrace.analysis.replay import replay
from lightning_memtrace.capture.allocation_state import AllocationState
from lightning_memtrace.capture.tracker import AllocationTracker
from lightning_memtrace.capture.window import phase_annotations

PHASE_RANGES = ("forward", "backward", "optimizer_step")


class AnnotatedMLP(MLP):
    """The MLP with the user's own ``record_function`` range around its forward pass."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        with torch.profiler.record_function("my_block"):
            out = self(x)
        return torch.nn.functional.mse_loss(out, y)


def _pairs(annotations):
    """{name: [(start, end), ...]} from START/END entries (an END closes its name's latest START)."""
    open_: dict[str, list[int]] = {}
    pairs: dict[str, list[tuple[int, int]]] = {}
    for a in annotations:
        if a["stage"] == "START":
            open_.setdefault(a["name"], []).append(a["time_us"])
        else:
            pairs.setdefault(a["name"], []).append((open_[a["name"]].pop(), a["time_us"]))
    assert not any(open_.values()), open_
    return pairs


def _brute_force_live(snapshot, t):
    """Live bytes after every event at or before ``t``: the dump-time live blocks, less what was allocated after t,
    plus what was freed after t (the trace read backwards, without the replay)."""
    live = sum(b["size"] for s in snapshot["segments"] for b in s["blocks"] if b["state"] == "active_allocated")
    for event in snapshot["device_traces"][0]:
        if event["time_us"] > t:
            if event["action"] == "alloc":
                live -= event["size"]
            elif event["action"] == "free_completed":
                live += event["size"]
    return live


@pytest.fixture(scope="module")
def lightning_snapshot(tmp_path_factory):
    folder = tmp_path_factory.mktemp("annotated")
    callback = MemTrace()
    trainer(folder, [callback], max_steps=4).fit(AnnotatedMLP())
    path = callback.output_dir / "snapshot_rank0_steps1-2.pickle"
    with open(path, "rb") as handle:
        return path, pickle.load(handle)


def test_lightning_cpu_snapshot_carries_phases_and_record_function_ranges(lightning_snapshot):
    _, snapshot = lightning_snapshot
    annotations = snapshot["external_annotations"]
    assert all(set(a) == {"name", "stage", "time_us", "device"} and a["device"] == 0 for a in annotations)
    assert {a["stage"] for a in annotations} == {"START", "END"}
    times = [a["time_us"] for a in annotations]
    assert times == sorted(times)
    pairs = _pairs(annotations)
    for name in (*PHASE_RANGES, "my_block"):
        assert len(pairs[name]) == 2, name  # once per step of the window (steps 1 and 2)
    assert any(name.startswith("Optimizer.step#AdamW") for name in pairs)  # torch's own range of the optimizer

    marks = snapshot["memtrace"]["phases"]
    window_start = min(m["time_us"] for m in marks)
    window_end = snapshot["device_traces"][0][-1]["time_us"]  # the closing marker event
    for name, ranges in pairs.items():
        for start, end in ranges:
            assert window_start <= start <= end <= window_end, name
    # the phase ranges follow the phase marks, one after the other within each step
    by_step = {}
    for m in marks:
        by_step.setdefault(m["step"], {})[m["phase"]] = m["time_us"]
    for (f0, f1), (b0, b1), (o0, o1), step in zip(pairs["forward"], pairs["backward"], pairs["optimizer_step"], (1, 2)):
        assert (f0, f1, b1, o1) == (
            by_step[step]["batch_start"],
            by_step[step]["after_forward"],
            by_step[step]["after_backward"],
            by_step[step]["after_optimizer_step"],
        )
        assert f1 == b0 and b1 == o0
    # the user's range lies inside the forward pass of its step
    for (m0, m1), (f0, f1) in zip(pairs["my_block"], pairs["forward"]):
        assert f0 <= m0 <= m1 <= f1


def test_snapshot_with_annotations_still_opens_in_torch_readers(lightning_snapshot):
    _, snapshot = lightning_snapshot
    _memory_viz.segsum(snapshot)
    assert _memory_viz.trace(snapshot).startswith("Device 0")
    assert len(_memory_viz.trace_plot(snapshot)) > 1000
    assert len(_memory_viz.segment_plot(snapshot)) > 1000


def test_reader_live_bytes_at_each_annotation_match_a_brute_force_replay(lightning_snapshot):
    path, snapshot = lightning_snapshot
    dev = replay(load_snapshot(path)).devices[0]
    rows = annotation_rows(dev)
    assert len(rows) == len(snapshot["external_annotations"])
    for row in rows:
        assert row["live_bytes"] == _brute_force_live(snapshot, row["time_us"]), row
    trace = snapshot["device_traces"][0]
    for r in annotated_ranges(dev):
        inside = [_brute_force_live(snapshot, e["time_us"]) for e in trace if r.start_us <= e["time_us"] <= r.end_us]
        assert r.peak_bytes == max([r.start_live_bytes, *inside]), r.name
        assert sum(r.by_category.values()) == r.peak_bytes
    forward = [r for r in annotated_ranges(dev) if r.name == "forward"]
    assert [r.step for r in forward] == [1, 2]
    assert all(r.by_category.get("activations", 0) > 0 for r in forward)


def test_summary_and_report_show_the_annotated_ranges(lightning_snapshot, tmp_path, capsys, monkeypatch):
    from lightning_memtrace.cli import main

    monkeypatch.setenv("COLUMNS", "200")
    path, _ = lightning_snapshot
    dev = replay(load_snapshot(path)).devices[0]
    ranges = annotated_ranges(dev)
    assert main(["summary", str(path)]) == 0
    text = capsys.readouterr().out
    assert "annotations" in text and "my_block" in text
    first_backward = next(r for r in ranges if r.name == "backward")
    assert f"{first_backward.peak_bytes:,}" in text

    out = tmp_path / "report.html"
    assert main(["report", str(path), "-o", str(out)]) == 0
    html = out.read_text()
    assert "<h2>Annotated ranges</h2>" in html
    summary = json.loads(re.search(r'id="memtrace-summary">(.*?)</script>', html, re.DOTALL).group(1))
    assert summary["annotated_ranges"] == [r.as_dict() for r in ranges]
    assert [a["live_bytes"] for a in summary["annotations"]] == [a["live_bytes"] for a in annotation_rows(dev)]


@pytest.mark.parametrize("backend", ["reports", "dispatch"])
def test_record_function_ranges_in_a_plain_loop(tmp_path, backend):
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs = {} if backend == "reports" else {"allocation_backend": "dispatch"}
    with MemoryRecorder(model, [optimizer], output_dir=tmp_path, history_skip_steps=1, history_steps=1, **kwargs) as rec:
        for step in range(3):
            x = torch.randn(8, 32)
            rec.begin_batch(x, step=step)
            with torch.autograd.profiler.record_function("outer"), torch.profiler.record_function("inner"):
                loss = model(x).square().mean()
            rec.mark_forward_done()
            loss.backward()
            rec.mark_backward_done()
            optimizer.step()
            optimizer.zero_grad()
            rec.end_batch()
    if backend == "reports" and rec.tracker.backend != "reports":
        pytest.skip(f"allocator reports unavailable here: {rec.tracker.fallback_reason}")
    with open(tmp_path / "snapshot_rank0_steps1-1.pickle", "rb") as handle:
        snapshot = pickle.load(handle)
    pairs = _pairs(snapshot["external_annotations"])
    assert len(pairs["outer"]) == len(pairs["inner"]) == 1  # only the window's step
    (o0, o1), (i0, i1) = pairs["outer"][0], pairs["inner"][0]
    assert o0 <= i0 <= i1 <= o1 <= pairs["forward"][0][1]
    assert {"forward", "backward", "optimizer_step", "after_step"} <= set(pairs)


def test_dispatch_mode_notes_ranges_only_inside_the_window():
    tracker = AllocationTracker("cpu", backend="dispatch")
    with tracker:
        with torch.profiler.record_function("before"):
            torch.ones(4)
        tracker.record_history(True)
        with torch.profiler.record_function("a"), torch.profiler.record_function("b"):
            torch.ones(4)
        tracker.record_history(False)
    snapshot = tracker.snapshot()
    assert [(a["name"], a["stage"]) for a in snapshot["external_annotations"]] == [
        ("a", "START"), ("b", "START"), ("b", "END"), ("a", "END")
    ]


def test_an_end_without_a_start_is_not_noted():
    state = AllocationState(torch.device("cpu"), 0, 8, 16)
    state.capture_all_frames = True
    state.note_range("END")
    state.note_range("START", "x")
    state.note_range("END")
    assert [(stage, name) for _, stage, name in state.annotations] == [("START", "x"), ("END", "x")]


def test_phase_annotations_from_marks():
    marks = [
        (0, "batch_start", 100), (0, "after_forward", 200), (0, "after_backward", 300),
        (0, "after_optimizer_step", 400), (0, "batch_end", 500),
        (0, "val_batch_start", 600), (0, "val_batch_end", 700),
        (1, "batch_start", 800), (1, "after_forward", 900),
    ]
    notes = phase_annotations(marks, since_us=150, now_us=950, device_index=2)
    assert [(a["name"], a["stage"], a["time_us"]) for a in notes] == [
        ("forward", "START", 100), ("forward", "END", 200),
        ("backward", "START", 200), ("backward", "END", 300),
        ("optimizer_step", "START", 300), ("optimizer_step", "END", 400),
        ("after_step", "START", 400), ("after_step", "END", 500),
        ("validation", "START", 600), ("validation", "END", 700),
        ("forward", "START", 800), ("forward", "END", 900),
        ("backward", "START", 900), ("backward", "END", 950),  # still running when the snapshot was taken
    ]
    assert {a["device"] for a in notes} == {2}
    assert phase_annotations(marks, since_us=450, now_us=950, device_index=0)[0]["name"] == "after_step"
