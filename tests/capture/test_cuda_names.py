"""The rows' categories put on the CUDA allocator's own snapshot (``capture.cuda_names``), and the window's wiring."""

from __future__ import annotations

import pickle
from typing import Any

import torch
from shared_files import fixture_path
from torch.cuda import _memory_viz

from lightning_memtrace.analysis.loader import load_snapshot
from lightning_memtrace.analysis.replay import replay
from lightning_memtrace.capture.categories import NamedStorages
from lightning_memtrace.capture.cuda_names import name_allocations, naming_of
from lightning_memtrace.types import Category


def _event(action: str, addr: int, size: int, time_us: int) -> dict[str, Any]:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": time_us, "frames": []}


def _freed(addr: int, size: int, time_us: int) -> list[dict[str, Any]]:
    return [_event("free_requested", addr, size, time_us), _event("free_completed", addr, size, time_us + 1)]


def _snapshot() -> dict[str, Any]:
    """A torch-format trace around two namings, at times 100 and 200 (a row after the forward, one after the backward).

    0x1000 saved activation (made 10, freed 150); 0x2000 kept by the step, never named (made 20, alive);
    0x3000 a temporary between the namings (110-120); 0x3000 again, made after the second naming (210, alive);
    0x4000 made before the trace (a parameter, alive); 0x5000 made before the trace, freed at 120 (never named).
    """
    trace = [
        _event("alloc", 0x1000, 512, 10),
        _event("alloc", 0x2000, 1024, 20),
        _event("alloc", 0x3000, 512, 110),
        *_freed(0x3000, 512, 120),
        *_freed(0x5000, 2048, 130),
        *_freed(0x1000, 512, 150),
        _event("alloc", 0x3000, 512, 210),
    ]
    blocks = [
        {"address": 0x2000, "size": 1024, "state": "active_allocated"},
        {"address": 0x3000, "size": 512, "state": "active_allocated"},
        {"address": 0x4000, "size": 4096, "state": "active_allocated"},
        {"address": 0x6000, "size": 512, "state": "inactive"},
    ]
    segment = {"device": 0, "address": 0x2000, "total_size": 8192, "stream": 0, "blocks": blocks}
    return {"segments": [segment], "device_traces": [trace]}


NAMINGS = [
    (100, {0x1000: "activations", 0x4000: "parameters"}),
    (200, {0x4000: "parameters", 0x7000: "gradients"}),
]


def _categories(snapshot: dict[str, Any]) -> list[tuple[str, int, str]]:
    return [(e["action"], e["addr"], e["category"]) for e in snapshot["device_traces"][0]]


def test_each_allocation_gets_its_category_by_the_namings_it_lived_through() -> None:
    snapshot = _snapshot()
    name_allocations(snapshot, NAMINGS, 0)
    assert _categories(snapshot) == [
        ("alloc", 0x1000, "activations"),  # named at 100
        ("alloc", 0x2000, "other"),  # alive at both namings, named by neither
        ("alloc", 0x3000, "unknown"),  # lived between them: no naming saw it (readers infer)
        ("free_requested", 0x3000, "unknown"),
        ("free_completed", 0x3000, "unknown"),
        ("free_requested", 0x5000, "unknown"),  # made before the trace, never named
        ("free_completed", 0x5000, "unknown"),
        ("free_requested", 0x1000, "activations"),
        ("free_completed", 0x1000, "activations"),
        ("alloc", 0x3000, "unknown"),  # the address again, after the last naming
    ]
    blocks = {b["address"]: b.get("category") for b in snapshot["segments"][0]["blocks"]}
    assert blocks == {0x2000: "other", 0x3000: "unknown", 0x4000: "parameters", 0x6000: None}


def test_the_replay_reads_them_as_recorded() -> None:
    snapshot = _snapshot()
    for event in snapshot["device_traces"][0]:
        event["user_metadata"] = "phase=forward step=1"
    name_allocations(snapshot, NAMINGS, 0)
    allocations = replay(snapshot).main.allocations.sort_values(["alloc_index", "size"])
    assert [(int(r.size), str(r.category), bool(r.inferred)) for r in allocations.itertuples()] == [
        (2048, "pre_existing", True),  # freed in the trace, never named
        (4096, "parameters", False),
        (512, "activations", False),
        (1024, "other", False),
        (512, "intermediates", True),  # made and freed inside the forward
        (512, "activations", True),  # made after the last naming, alive: inferred from where it was made
    ]


def test_blocks_without_addresses_lie_one_after_the_other() -> None:
    """torch before 2.1 gives blocks no address: the segment's address, then each block's size on from it."""
    blocks = [
        {"size": 1024, "state": "active_allocated"},  # 0x2000: made in the trace, alive at both namings
        {"size": 512, "state": "inactive"},  # 0x2400
        {"size": 512, "state": "active_allocated"},  # 0x2600: made before the trace, named
        {"size": 512, "state": "active_allocated"},  # 0x2800: made before the trace, never named
    ]
    trace = [_event("alloc", 0x2000, 1024, 20)]
    snapshot = {"segments": [{"device": 0, "address": 0x2000, "blocks": blocks}], "device_traces": [trace]}
    name_allocations(snapshot, [(100, {0x2600: "parameters"})], 0)
    assert [b.get("category") for b in blocks] == ["other", None, "parameters", "unknown"]


def test_a_trace_whose_every_allocation_is_named_keeps_unknown_among_its_categories() -> None:
    """MemoryViz.js throws where no event is ``unknown`` (see ``snapshot_builder.unknown_marker``)."""
    snapshot = {"segments": [], "device_traces": [[_event("alloc", 0x1000, 512, 10)]]}
    name_allocations(snapshot, [(100, {0x1000: "parameters"})], 0)
    trace = snapshot["device_traces"][0]
    assert [(e["action"], e["category"]) for e in trace] == [("alloc", "parameters"), ("snapshot", "unknown")]


def test_naming_of_takes_the_storages_addresses() -> None:
    weight = torch.zeros(16)
    named = NamedStorages()
    named.add({1: weight.untyped_storage()}, Category.PARAMETERS)
    assert naming_of(named, 7) == (7, {weight.untyped_storage().data_ptr(): "parameters"})


def test_a_real_gpu_snapshot_named_stays_whole_and_opens_in_torchs_viewer() -> None:
    """kkaitlyn's 2.7B step: its live blocks at the dump named as parameters after the last event; the peak stands,
    what those blocks hold is recorded, and torch's own readers open it."""
    path = fixture_path("kkaitlyn111_memory_files_memory_ctx128_fullstep.pickle")
    before = replay(load_snapshot(path))
    snapshot = pickle.loads(path.read_bytes())
    trace = snapshot["device_traces"][0]
    end = max(e.get("time_us", 0) for e in trace) + 1
    live = {
        b["address"]: "parameters"
        for s in snapshot["segments"]
        for b in s["blocks"]
        if b["state"] == "active_allocated"
    }
    name_allocations(snapshot, [(end, live)], 0)
    after = replay(snapshot)
    assert after.peak.live_bytes == before.peak.live_bytes
    allocations = after.main.allocations
    alive = allocations[allocations["end_index"] >= after.main.num_events]
    assert (alive["category"].astype(str) == "parameters").all() and not alive["inferred"].any()
    freed = allocations[allocations["end_index"] < after.main.num_events]
    assert freed["inferred"].all()  # no naming saw them: inferred as before
    _memory_viz.segsum(snapshot)
    _memory_viz.trace(snapshot)


def test_the_window_keeps_its_rows_namings_for_the_cuda_snapshot(monkeypatch) -> None:
    """While the window records, each naming of the live storages is kept; the CUDA snapshot written at its end
    carries their categories."""
    from lightning_memtrace.capture import cuda_history
    from lightning_memtrace.capture import window as window_module
    from lightning_memtrace.capture.config import RecorderConfig

    weight = torch.zeros(128)
    addr = weight.untyped_storage().data_ptr()
    trace = [_event("alloc", addr, 512, 10), _event("alloc", addr + 4096, 512, 20)]
    monkeypatch.setattr(cuda_history, "cuda_history_supported", lambda: True)
    monkeypatch.setattr(cuda_history, "cuda_history_enabled", lambda: True)
    monkeypatch.setattr(cuda_history, "tag_allocations", lambda text: True)
    monkeypatch.setattr(cuda_history, "cuda_snapshot", lambda: {"segments": [], "device_traces": [list(trace)]})
    monkeypatch.setattr(window_module, "cuda_allocated", lambda device: 0)

    class Files:
        written: dict[str, Any] = {}

        def write_snapshot(self, name, snapshot):
            self.written[name] = snapshot

    named = NamedStorages()
    named.add({1: weight.untyped_storage()}, Category.PARAMETERS)
    window = window_module.HistoryWindow(
        RecorderConfig(history_skip_steps=0, history_steps=1), torch.device("cuda", 0), 0, None, Files(),
        lambda: named, lambda: None, lambda kind, message: None,
    )
    window.note_names(named, 100)  # before the window: not kept
    assert not window.namings
    window.maybe_open(0)
    window.note_names(named, 100)
    window.close(0)
    written = Files.written["snapshot_rank0_steps0-0.pickle"]["device_traces"][0]
    assert [(e["addr"], e["category"]) for e in written if e["action"] == "alloc"] == [
        (addr, "parameters"),
        (addr + 4096, "other"),
    ]


def test_events_without_times_are_left_unknown() -> None:
    """Lifetimes are read from ``time_us``: an allocation or free without one gets no category from the namings."""
    trace = [_event("alloc", 0x1000, 512, 10), _event("alloc", 0x2000, 512, 20), *_freed(0x2000, 512, 150)]
    del trace[0]["time_us"]
    trace[2]["time_us"] = None  # the free_requested of 0x2000
    snapshot = {"segments": [], "device_traces": [trace]}
    name_allocations(snapshot, [(100, {0x1000: "activations", 0x2000: "parameters"})], 0)
    assert _categories(snapshot) == [
        ("alloc", 0x1000, "unknown"),
        ("alloc", 0x2000, "unknown"),
        ("free_requested", 0x2000, "unknown"),
        ("free_completed", 0x2000, "unknown"),
    ]


def test_a_trace_without_free_requested_events_ends_allocations_at_free_completed() -> None:
    trace = [_event("alloc", 0x1000, 512, 10), _event("free_completed", 0x1000, 512, 150)]
    snapshot = {"segments": [], "device_traces": [trace]}
    name_allocations(snapshot, [(100, {0x1000: "activations"}), (200, {0x1000: "gradients"})], 0)
    assert _categories(snapshot)[:2] == [("alloc", 0x1000, "activations"), ("free_completed", 0x1000, "activations")]


def test_a_failure_to_name_the_cuda_snapshot_is_one_warning_and_the_snapshot_is_written(monkeypatch) -> None:
    from lightning_memtrace.capture import cuda_history
    from lightning_memtrace.capture import window as window_module
    from lightning_memtrace.capture.config import RecorderConfig

    trace = [_event("alloc", 0x1000, 512, 10)]
    monkeypatch.setattr(cuda_history, "cuda_history_supported", lambda: True)
    monkeypatch.setattr(cuda_history, "cuda_history_enabled", lambda: True)
    monkeypatch.setattr(cuda_history, "tag_allocations", lambda text: True)
    monkeypatch.setattr(cuda_history, "cuda_snapshot", lambda: {"segments": [], "device_traces": [list(trace)]})
    monkeypatch.setattr(window_module, "cuda_allocated", lambda device: 0)

    def broken(*_: Any) -> None:
        raise ValueError("odd trace")

    monkeypatch.setattr(window_module, "name_allocations", broken)
    written: dict[str, Any] = {}
    warnings: list[tuple[str, str]] = []

    class Files:
        def write_snapshot(self, name, snapshot):
            written[name] = snapshot

    window = window_module.HistoryWindow(
        RecorderConfig(history_skip_steps=0, history_steps=1), torch.device("cuda", 0), 0, None, Files(),
        NamedStorages, lambda: None, lambda kind, message: warnings.append((kind, message)),
    )
    window.maybe_open(0)
    window.close(0)
    assert [e["addr"] for e in written["snapshot_rank0_steps0-0.pickle"]["device_traces"][0]] == [0x1000]
    assert warnings == [("snapshot_categories", "could not put the rows' categories on the CUDA snapshot: "
                         "ValueError('odd trace')")]
