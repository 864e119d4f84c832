"""The storage-level tracker on CPU: exact bytes, views counted once, frees, peak, bounded history, OOM."""

from __future__ import annotations

import pytest
import torch

from lightning_memtrace.capture.oom_errors import is_out_of_memory, requested_bytes_from_message
from lightning_memtrace.capture.tracker import AllocationTracker


def test_counts_new_storages_exactly_and_frees():
    tracker = AllocationTracker("cpu")
    with tracker:
        a = torch.empty(1000, dtype=torch.float32)
        assert tracker.allocated == 4000
        b = a.view(10, 100)  # a view: same storage, no new bytes
        c = a[::2]
        assert tracker.allocated == 4000
        d = torch.ones(250, dtype=torch.float64)
        assert tracker.allocated == 6000
        del a, b, c
        assert tracker.allocated == 2000
        assert tracker.peak == 6000
        tracker.reset_peak()
        assert tracker.peak == 2000
        del d
    assert tracker.allocated == 0


def test_inplace_ops_and_tuple_outputs():
    tracker = AllocationTracker("cpu")
    x = torch.randn(64, 64)  # made before tracking: not counted
    with tracker:
        x.add_(1.0)
        assert tracker.allocated == 0
        values, indices = torch.max(x, dim=1)
        assert tracker.allocated == 64 * 4 + 64 * 8
        parts = torch._foreach_mul([x, x], 2.0)
        assert tracker.allocated == 64 * 4 + 64 * 8 + 2 * 64 * 64 * 4
        del values, indices, parts
    assert tracker.allocated == 0


def test_adopt_counts_existing_storage_once():
    tracker = AllocationTracker("cpu")
    w = torch.zeros(100)
    assert tracker.adopt(w) is True
    assert tracker.adopt(w[10:]) is False
    assert tracker.allocated == 400
    del w
    assert tracker.allocated == 0


def test_history_is_a_bounded_ring_buffer():
    tracker = AllocationTracker("cpu", max_entries=50)
    with tracker:
        for _ in range(200):
            torch.empty(8)
    snapshot = tracker.snapshot()
    # 200 allocs + 200 frees were recorded, only the last 50 events are kept (a free expands to two entries).
    events = snapshot["device_traces"][0]
    assert 50 <= len(events) <= 100
    assert tracker.events_since(0) == 50


def test_snapshot_frames_only_for_large_allocations_outside_window():
    tracker = AllocationTracker("cpu", frames_min_bytes=1024)
    with tracker:
        small = torch.empty(16)
        big = torch.empty(1024)
        tracker.capture_all_frames = True
        small2 = torch.empty(16)
    by_line = {}
    for entry in tracker.live_allocations():
        by_line[entry.frames[0]["line"] if entry.frames else None] = entry
    # The small allocation before the window has no stack; the big one and the one inside the window have one.
    assert None in by_line and by_line[None].nbytes == 64
    stacked = sorted((e.nbytes, e.frames[0]["filename"], e.frames[0]["name"]) for k, e in by_line.items() if k)
    name = "test_snapshot_frames_only_for_large_allocations_outside_window"
    assert stacked == [(64, __file__, name), (4096, __file__, name)]
    del small, big, small2


def test_cpu_oom_is_seen_with_requested_size():
    tracker = AllocationTracker("cpu")
    seen = []
    tracker.oom_listeners.append(seen.append)
    with tracker, pytest.raises(RuntimeError) as info:
        torch.empty(10**15, dtype=torch.uint8)
    assert is_out_of_memory(info.value)
    assert requested_bytes_from_message(str(info.value)) == 10**15
    assert len(seen) == 1 and seen[0].requested_bytes == 10**15
    assert seen[0].frames[0]["filename"] == __file__
    oom_events = [e for e in tracker.snapshot()["device_traces"][0] if e["action"] == "oom"]
    assert oom_events and oom_events[0]["size"] == 10**15


def test_is_out_of_memory_classification():
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes."))
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_out_of_memory(ValueError("out of memory"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert requested_bytes_from_message("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0)") == 2 * 1024**3
    # host memory running out in Python or numpy is the CPU's out-of-memory, not an accelerator's
    assert is_out_of_memory(MemoryError()) and is_out_of_memory(MemoryError(), "cpu")
    assert not is_out_of_memory(MemoryError(), torch.device("cuda", 0))
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory."), "cuda:0")
    numpy_message = "Unable to allocate 1.00 EiB for an array with shape (1152921504606846976,) and data type uint8"
    assert requested_bytes_from_message(numpy_message) == 2**60
    assert requested_bytes_from_message("Unable to allocate 7.5 MiB for an array") == int(7.5 * 1024**2)


def test_other_device_storages_are_ignored_and_meta_storages_counted():
    tracker = AllocationTracker("meta")
    with tracker:
        cpu = torch.empty(100)  # a CPU tensor: not this tracker's device
        assert tracker.allocated == 0
        m1 = torch.empty(100, device="meta")
        m2 = torch.empty(50, device="meta")
    assert tracker.allocated == 600
    addresses = [s["address"] for s in tracker.snapshot()["segments"]]
    assert len(set(addresses)) == 2 and 0 not in addresses
    del m1, m2, cpu
