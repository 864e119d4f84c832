"""The CUDA code paths that a CPU machine cannot run, with the CUDA allocator mocked.

The same paths run for real in tests/gpu/ on a machine with a GPU.
"""

from __future__ import annotations

import torch

from lightning_memtrace import cuda_history
from lightning_memtrace.counters import CudaCounters, allocator_counters


def test_cuda_counters_read_and_reset_peak(monkeypatch):
    state = {"allocated": 1000, "reserved": 4096, "peak": 3000, "resets": 0}
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: state["reserved"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["peak"])

    def reset(device=None):
        state["resets"] += 1
        state["peak"] = state["allocated"]

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    counters = CudaCounters(torch.device("cuda", 0))
    assert state["resets"] == 1
    state["peak"] = 5000
    assert counters.read() == (1000, 4096, 5000)
    assert state["resets"] == 2
    # the next phase's peak starts from what is allocated now
    assert counters.read() == (1000, 4096, 1000)


def test_history_uses_python_stacks_and_ring_buffer(monkeypatch):
    calls = []

    def record(enabled="all", context="all", stacks="all", max_entries=0, **kwargs):
        calls.append((enabled, context, stacks, max_entries))

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history_impl", record, raising=False)
    cuda_history.start_cuda_history(12345)
    cuda_history.stop_cuda_history()
    assert calls == [("all", "all", "python", 12345), (None, "all", "all", 0)]


def test_oom_observer_forwards_to_live_listeners(monkeypatch):
    attached = []
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", attached.append, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_history, "_OBSERVER_ATTACHED", False)

    class Listener:
        def __init__(self):
            self.seen = []

        def on_cuda_oom(self, device, requested, allocated, free):
            self.seen.append((device, requested, allocated, free))

    first, second = Listener(), Listener()
    assert cuda_history.add_cuda_oom_listener(first)
    assert cuda_history.add_cuda_oom_listener(second)
    assert len(attached) == 1  # one process-wide observer
    cuda_history.remove_cuda_oom_listener(second)
    attached[0](0, 2 * 1024**3, 10, 20)
    assert first.seen == [(0, 2 * 1024**3, 10, 20)] and second.seen == []
    cuda_history.remove_cuda_oom_listener(first)


def test_no_allocator_counters_on_cpu():
    assert allocator_counters(torch.device("cpu")) is None
