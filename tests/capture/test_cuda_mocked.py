"""The CUDA code paths that a CPU machine cannot run, with the CUDA allocator mocked.

The same paths run for real in tests/gpu/ on a machine with a GPU.
"""

from __future__ import annotations

import torch

from lightning_memtrace.capture import cuda_history
from lightning_memtrace.capture.counters import CudaCounters, allocator_counters


def test_cuda_counters_read_and_reset_peak(monkeypatch):
    state = {"allocated": 1000, "reserved": 4096, "peak": 3000, "peak_reserved": 8192, "resets": 0, "reads": 0}

    def nested_stats(device=None):
        state["reads"] += 1
        return {
            "allocated_bytes": {"all": {"current": state["allocated"], "peak": state["peak"]}},
            "reserved_bytes": {"all": {"current": state["reserved"], "peak": state["peak_reserved"]}},
        }

    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", nested_stats)

    def reset(device=None):
        state["resets"] += 1
        state["peak"] = state["allocated"]
        state["peak_reserved"] = state["reserved"]

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    counters = CudaCounters(torch.device("cuda", 0))
    assert state["resets"] == 1
    assert (counters.max_allocated, counters.max_reserved) == (3000, 8192)  # the peak held before MemTrace started
    state["peak"] = 5000
    assert counters.read() == (1000, 4096, 5000)
    assert state["resets"] == 2
    # one read of the statistics per row (memory_allocated and its kin each flatten them all)
    assert state["reads"] == 2
    # the next phase's peak starts from what is allocated now
    assert counters.read() == (1000, 4096, 1000)
    assert (counters.max_allocated, counters.max_reserved) == (5000, 8192)


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


class _FakeCudaAllocator:
    """The CUDA allocator's counters as torch.cuda exposes them: one peak per device, reset on demand."""

    def __init__(self, monkeypatch, allocated: int, reserved: int, peak: int, peak_reserved: int) -> None:
        self.allocated, self.reserved, self.peak, self.peak_reserved = allocated, reserved, peak, peak_reserved
        for name, value in (
            ("memory_allocated", lambda device=None: self.allocated),
            ("memory_reserved", lambda device=None: self.reserved),
            ("max_memory_allocated", lambda device=None: self.peak),
            ("max_memory_reserved", lambda device=None: self.peak_reserved),
            ("memory_stats_as_nested_dict", lambda device=None: self.nested_stats()),
            ("reset_peak_memory_stats", lambda device=None: self.reset()),
            ("is_available", lambda: True),
            ("current_device", lambda: 0),
        ):
            monkeypatch.setattr(torch.cuda, name, value)

    def nested_stats(self) -> dict:
        return {
            "allocated_bytes": {"all": {"current": self.allocated, "peak": self.peak}},
            "reserved_bytes": {"all": {"current": self.reserved, "peak": self.peak_reserved}},
        }

    def reset(self) -> None:
        self.peak, self.peak_reserved = self.allocated, self.reserved

    def use(self, nbytes: int) -> None:
        """Allocate ``nbytes`` and free them again (a phase's transient peak)."""
        self.peak = max(self.peak, self.allocated + nbytes)
        self.peak_reserved = max(self.peak_reserved, self.reserved + nbytes)


def test_cuda_counters_keep_the_runs_maximum_while_resetting_per_phase(monkeypatch):
    fake = _FakeCudaAllocator(monkeypatch, allocated=1000, reserved=4096, peak=9000, peak_reserved=10240)
    counters = CudaCounters(torch.device("cuda", 0))
    assert (counters.max_allocated, counters.max_reserved) == (9000, 10240)  # the user's peak before MemTrace
    fake.use(3000)
    assert counters.read() == (1000, 4096, 4000)  # the phase's own peak
    assert torch.cuda.max_memory_allocated() == 1000  # what the user's counter reads now: the peak since the row
    fake.use(20000)
    assert counters.read()[2] == 21000
    assert (counters.max_allocated, counters.max_reserved) == (21000, 24096)


def test_recorder_on_cuda_exposes_the_runs_maximum(monkeypatch, tmp_path):
    from lightning_memtrace import MemoryRecorder

    fake = _FakeCudaAllocator(monkeypatch, allocated=2048, reserved=8192, peak=50_000, peak_reserved=60_000)
    recorder = MemoryRecorder(None, device="cuda:0", output_dir=tmp_path, history=False, post_mortem=False)
    with recorder:
        for step, transient in enumerate((70_000, 10_000)):
            recorder.begin_batch(None, step=step)
            fake.use(transient)
            recorder.mark_forward_done()
            recorder.mark_backward_done()
            recorder.end_batch(next_step=step + 1)
    peaks = [record.peak_bytes for record in recorder.records]
    assert max(peaks) == 72_048 and peaks[-3:] == [12_048, 2048, 2048]
    assert recorder.max_allocated_bytes == 72_048
    assert recorder.max_reserved_bytes == 78_192
    assert torch.cuda.max_memory_allocated() == 2048  # reset at the last row: why max_allocated_bytes exists


def test_an_out_of_memory_error_observed_then_caught_is_forgotten_at_the_next_batch(monkeypatch, tmp_path):
    """The allocator's out-of-memory observer keeps the state where an allocation failed; a batch later (the user's
    code caught that error) the post-mortem of another error tells that error, not the caught one."""
    from lightning_memtrace import MemoryRecorder

    fake = _FakeCudaAllocator(monkeypatch, allocated=2048, reserved=8192, peak=2048, peak_reserved=8192)
    recorder = MemoryRecorder(None, device="cuda:0", output_dir=tmp_path, history=False, post_mortem=False)
    monkeypatch.setattr(recorder.window, "snapshot_now", lambda **_: {"segments": [], "device_traces": [[]]})
    with recorder:
        recorder.begin_batch(None, step=0)
        recorder.on_cuda_oom(0, 10**12, 2048, 0)  # observed; the user's code catches the error
        error = RuntimeError("CUDA out of memory. Tried to allocate 2.00 MiB.")
        assert recorder.oom.post_mortem(error)[0].requested_bytes == 10**12  # in the same batch: the state kept
        recorder.on_cuda_oom(0, 10**12, 2048, 0)
        recorder.end_batch(next_step=1)
        recorder.begin_batch(None, step=1)
        fake.allocated = 4096
        post_mortem = recorder.oom.post_mortem(error)[0]
    assert (post_mortem.requested_bytes, post_mortem.step, post_mortem.allocated_bytes) == (2 * 1024**2, 1, 4096)


def _fake_thread_local_tags(monkeypatch) -> dict[int, list[str]]:
    """The allocator's tag setter, kept per thread as CUDA's allocator keeps it: thread id -> the tags set there."""
    import threading

    from lightning_memtrace.capture import torch_private

    tags: dict[int, list[str]] = {}

    def setter(text: str) -> bool:
        tags.setdefault(threading.get_ident(), []).append(text)
        return True

    monkeypatch.setattr(torch_private, "set_allocation_metadata", setter)
    monkeypatch.setattr(cuda_history, "_tagging_thread", None)
    return tags


def _backward_on_another_thread(loss_of, hook_loss: bool) -> int:
    """Run a backward on a thread of its own, as autograd runs a CUDA backward on its device thread."""
    import threading

    from lightning_memtrace.capture.categories import SavedTensorsRecorder

    seen = {}

    def work():
        seen["thread"] = threading.get_ident()
        weight = torch.randn(8, 8, requires_grad=True)
        saved = SavedTensorsRecorder(torch.device("cpu"))
        saved.push()
        loss = loss_of(weight)
        saved.pop()
        if hook_loss:
            loss.grad_fn.register_prehook(cuda_history.carry_allocation_tag)
        loss.backward()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    return seen["thread"]


def test_the_backward_thread_gets_the_phase_tag_from_the_loss_hook_and_loses_it_when_the_backward_ends(monkeypatch):
    import threading

    tags = _fake_thread_local_tags(monkeypatch)
    assert cuda_history.tag_allocations("phase=backward step=3")
    # no saved tensor in this graph: the loss's pre-hook alone reaches the backward's thread
    worker = _backward_on_another_thread(lambda w: (w * 2.0).sum(), hook_loss=True)
    assert tags[threading.get_ident()] == ["phase=backward step=3"]
    assert tags[worker] == ["phase=backward step=3", ""]


def test_the_saved_tensor_unpack_hook_carries_the_tag_once_per_backward(monkeypatch):
    tags = _fake_thread_local_tags(monkeypatch)
    assert cuda_history.tag_allocations("phase=backward step=0")
    worker = _backward_on_another_thread(lambda w: (w @ w).tanh().sum(), hook_loss=False)
    # three saved tensors unpacked (w twice, tanh's output): one tag, one clear
    assert tags[worker] == ["phase=backward step=0", ""]
    # a new tag reaches the next backward; a backward on the tagging thread itself is left alone
    assert cuda_history.tag_allocations("phase=backward step=1")
    worker = _backward_on_another_thread(lambda w: (w @ w).tanh().sum(), hook_loss=False)
    assert tags[worker][-2:] == ["phase=backward step=1", ""]
    before = {thread: list(values) for thread, values in tags.items()}
    from lightning_memtrace.capture.categories import SavedTensorsRecorder

    weight = torch.randn(4, 4, requires_grad=True)
    saved = SavedTensorsRecorder(torch.device("cpu"))
    saved.push()
    loss = (weight * weight).sum()
    saved.pop()
    loss.grad_fn.register_prehook(cuda_history.carry_allocation_tag)
    loss.backward()
    assert tags == before


def test_without_a_tag_the_hooks_tag_nothing(monkeypatch):
    tags = _fake_thread_local_tags(monkeypatch)
    _backward_on_another_thread(lambda w: (w @ w).tanh().sum(), hook_loss=True)
    assert tags == {}


def test_what_if_device_memory_is_the_limit_the_caching_allocator_enforces(monkeypatch):
    """Under ``set_per_process_memory_fraction`` the allocator fails at that fraction of the card: what fits is judged
    against it (the OOM message's "X GiB allowed")."""
    from types import SimpleNamespace

    from lightning_memtrace.estimator.budget import device_memory_bytes

    total = 150_754_820_096
    fractions = {0: 1.0, 1: 0.5}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(total_memory=total))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda index: fractions[index])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert device_memory_bytes("cuda:0") == total
    assert device_memory_bytes("cuda:1") == total // 2
    assert device_memory_bytes("cuda") == total // 2


def _cuda_window(monkeypatch, users_recording: bool):
    """A history window on a mocked CUDA device (no tracker: the caching allocator records), with the calls it makes
    to the allocator's history recording."""
    from lightning_memtrace.capture import window as window_module
    from lightning_memtrace.capture.categories import NamedStorages
    from lightning_memtrace.capture.config import RecorderConfig

    calls = []
    monkeypatch.setattr(torch._C, "_cuda_isHistoryEnabled", lambda: users_recording, raising=False)
    monkeypatch.setattr(cuda_history, "cuda_history_supported", lambda: True)
    monkeypatch.setattr(cuda_history, "start_cuda_history", lambda max_entries: calls.append(("start", max_entries)))
    monkeypatch.setattr(cuda_history, "stop_cuda_history", lambda: calls.append(("stop",)))
    monkeypatch.setattr(cuda_history, "tag_allocations", lambda text: True)
    monkeypatch.setattr(cuda_history, "cuda_snapshot", lambda: {"segments": [], "device_traces": [[]]})
    monkeypatch.setattr(window_module, "cuda_allocated", lambda device: 0)

    class Files:
        def __init__(self):
            self.written = []

        def write_snapshot(self, name, snapshot):
            self.written.append(name)
            return None

    files = Files()
    window = window_module.HistoryWindow(
        RecorderConfig(history_skip_steps=0, history_steps=1, max_entries=777), torch.device("cuda", 0), 0, None,
        files, NamedStorages, lambda: None, lambda kind, message: None,
    )
    return window, calls, files


def test_history_window_records_and_stops_when_nobody_else_records(monkeypatch):
    window, calls, files = _cuda_window(monkeypatch, users_recording=False)
    window.maybe_open(0)
    assert window.is_open
    window.close(0)
    assert calls == [("start", 777), ("stop",)]
    assert files.written == ["snapshot_rank0_steps0-0.pickle"]


def test_history_window_leaves_the_users_own_recording_on(monkeypatch):
    """A user who called ``torch.cuda.memory._record_memory_history`` keeps recording, with their settings, after the
    window: MemTrace neither restarts it with its own nor stops it (their ``_dump_snapshot`` at the end still works)."""
    window, calls, files = _cuda_window(monkeypatch, users_recording=True)
    window.maybe_open(0)
    assert window.is_open
    window.close(0)
    assert calls == []
    assert files.written == ["snapshot_rank0_steps0-0.pickle"]


def test_a_cuda_post_mortem_says_whether_expandable_segments_would_have_served_the_request(monkeypatch, tmp_path):
    """The snapshot taken at the error holds the allocator's trace: the caching allocator's model serves it again with
    expandable segments in the memory the GPU had, and the advice follows what it finds."""
    from allocator_snapshots import MIB, snapshot_of_an_oom

    from lightning_memtrace import MemoryRecorder
    from lightning_memtrace.analysis.postmortem import advice

    _FakeCudaAllocator(monkeypatch, allocated=24 * MIB, reserved=60 * MIB, peak=24 * MIB, peak_reserved=60 * MIB)
    error = RuntimeError("CUDA out of memory. Tried to allocate 12.00 MiB.")
    found = {}
    for blocks, limit in ((6, 60 * MIB), (4, 40 * MIB), (0, 0)):
        recorder = MemoryRecorder(None, device="cuda:0", output_dir=tmp_path, history=False, post_mortem=False)
        snapshot = snapshot_of_an_oom(blocks, limit) if blocks else {"segments": [], "device_traces": [[]]}
        monkeypatch.setattr(recorder.window, "snapshot_now", lambda snapshot=snapshot, **_: snapshot)
        with recorder:
            recorder.begin_batch(None, step=0)
            recorder.on_cuda_oom(0, 12 * MIB, 24 * MIB, 0)
            found[blocks] = recorder.oom.post_mortem(error)[0]
    assert [found[b].expandable_serves for b in (6, 4, 0)] == [True, False, None]
    assert found[6].as_dict()["expandable_serves"] is True
    tips = advice(found[6])
    expected = "Fragmentation ran it out: with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    assert any(t.startswith(expected) for t in tips)
    # reserved (60 MiB) is 2.5 x allocated (24 MiB): the fragmentation tip, and what the model found
    assert any(t.endswith("(the caching allocator's model, serving this run's recorded requests again with it, runs "
                          "out too).") for t in advice(found[4]))
    assert any(t.endswith("try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.") for t in advice(found[0]))
