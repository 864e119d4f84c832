"""The CPU allocator's own reports as the tracker's source: exact bytes, user profilers, no stray C++ warnings."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lightning_memtrace import MemoryRecorder, MemTrace, load_phases
from lightning_memtrace.capture.reports_backend import AllocatorReports, SessionLost
from lightning_memtrace.capture.torch_private import another_profiler_active
from lightning_memtrace.capture.storages import unique_storage_bytes
from lightning_memtrace.capture.tracker import AllocationTracker
from lm_helpers import MLP, trainer


def test_reports_give_each_allocation_and_free_with_address_and_size():
    reports = AllocatorReports()
    reports.start()
    try:
        block = torch.empty(1000, dtype=torch.float32)
        addr = block.data_ptr()
        del block
        events = reports.drain()
    finally:
        reports.stop()
    mine = [(size) for _, ptr, size in events if ptr == addr]
    assert mine == [4000, -4000]
    assert [e[0] for e in events] == sorted(e[0] for e in events)
    assert not another_profiler_active()


def test_reports_tracker_counts_exact_bytes_and_the_peak_between_reads():
    tracker = AllocationTracker("cpu", backend="reports")
    with tracker:
        assert tracker.backend == "reports"
        base = tracker.allocated
        tracker.reset_peak()
        kept = torch.empty(3 * 10**6, dtype=torch.uint8)
        gone = torch.empty(5 * 10**6, dtype=torch.uint8)
        del gone
        # the counters are current when read, without an explicit sync
        assert tracker.allocated == base + 3 * 10**6
        assert tracker.peak == base + 8 * 10**6
        entry = next(e for e in tracker.live_allocations() if e.addr == kept.data_ptr())
        assert entry.nbytes == 3 * 10**6
        # a temporary freed before the read still counts in the peak (a 4 MB contiguous copy, summed and dropped)
        tracker.reset_peak()
        matrix = torch.ones(1000, 1000)
        after_alloc = tracker.allocated
        tracker.reset_peak()
        matrix.t().contiguous().sum()
        assert tracker.peak >= after_alloc + 4 * 10**6
        assert tracker.allocated == after_alloc
        del kept, matrix
        assert tracker.allocated == base


def test_a_user_profiler_takes_the_session_over_and_training_goes_on(tmp_path):
    class ProfiledOnce(MLP):
        def training_step(self, batch, batch_idx):
            if batch_idx == 1:
                with torch.profiler.profile() as profile:
                    loss = super().training_step(batch, batch_idx)
                assert len(profile.events()) > 0  # the user's profiler recorded its operators
                return loss
            return super().training_step(batch, batch_idx)

    callback = MemTrace()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, [callback], max_steps=4).fit(ProfiledOnce())
    said = [str(w.message) for w in caught if "MemTrace" in str(w.message)]
    assert len(said) == 1 and "another profiler took over" in said[0]
    phases = load_phases(callback.output_dir)
    assert len(phases) == 20
    # the session came back after the user's profiler: the last step still sees its activations and temporaries
    last = phases[phases.step == 3]
    forward = last[last.phase == "after_forward"].iloc[0]
    assert forward.allocated_bytes >= forward.parameters_bytes + forward.activations_bytes > 0


def test_trainer_with_pytorch_profiler_uses_the_dispatch_tracker(tmp_path):
    callback = MemTrace()
    run = trainer(tmp_path, [callback], max_steps=2, profiler="pytorch")
    run.fit(MLP())
    assert callback.tracker_backend == "dispatch"
    phases = load_phases(callback.output_dir)
    assert len(phases) == 10 and (phases.allocated_bytes > 0).all()


def test_auto_backend_falls_back_to_dispatch_when_a_profiler_is_recording():
    model = torch.nn.Linear(32, 32)
    with torch.profiler.profile():
        with MemoryRecorder(model, []) as recorder:
            assert recorder.tracker.backend == "dispatch"
            assert "another profiler" in recorder.tracker.fallback_reason
            kept = torch.empty(1 << 20, dtype=torch.uint8)
            assert recorder.tracker.allocated >= unique_storage_bytes(model.parameters()) + (1 << 20)
            del kept
    with pytest.raises(RuntimeError, match="cannot run"):
        with torch.profiler.profile():
            AllocationTracker("cpu", backend="reports").start()


_RUN_FREEING_OLD_BLOCKS = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from lightning_memtrace import MemTrace
from lm_helpers import MLP, trainer
before = [torch.empty(1000) for _ in range(50)]  # made before MemTrace starts, freed while it runs


class FreesOldBlocks(MLP):
    def on_train_batch_end(self, outputs, batch, batch_idx):
        before.clear()


callback = MemTrace()
trainer(sys.argv[2], [callback], max_steps=2).fit(FreesOldBlocks())
print("backend", callback.tracker_backend)
"""


def test_no_cpp_warning_about_blocks_made_before_profiling(tmp_path):
    # A fresh process: the allocator logs that line on the first such free of the process (and every 1000th).
    done = subprocess.run(
        [sys.executable, "-c", _RUN_FREEING_OLD_BLOCKS, str(Path(__file__).parents[1]), str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "backend reports" in done.stdout
    assert "unknown size" not in done.stderr


def test_drain_after_a_session_was_taken_raises_session_lost():
    reports = AllocatorReports()
    reports.start()
    with torch.profiler.profile():
        pass
    with pytest.raises(SessionLost):
        reports.drain()
    assert not reports.active
    assert reports.stop() == []


def test_a_torch_without_the_log_levels_falls_back_to_the_dispatch_mode_with_one_warning(tmp_path, monkeypatch):
    from lightning_memtrace.capture import reports_backend, torch_private
    from lightning_memtrace.capture.recorder import MemTraceWarning

    monkeypatch.setattr(torch_private, "native_logging", lambda: None)
    assert "log levels" in reports_backend.unavailable_reason()
    callback = MemTrace(dirpath=tmp_path / "mt")
    module = MLP()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, [callback], max_steps=3).fit(module)
    ours = [str(w.message) for w in caught if issubclass(w.category, MemTraceWarning)]
    assert len(ours) == 1 and "dispatch mode" in ours[0] and "log levels" in ours[0]
    assert callback.tracker_backend == "dispatch"
    phases = load_phases(tmp_path / "mt")
    assert len(phases) == 15
    assert (phases.parameters_bytes == unique_storage_bytes(module.parameters())).all()


def test_deferred_rows_equal_rows_read_at_every_mark():
    """Rows read at their marks in the report stream give the bytes of reading the reports at each row."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(32, 64)

    def run(window: bool) -> list[tuple]:
        rows = []
        recorder = MemoryRecorder(model, [optimizer], history=window, history_skip_steps=0, history_steps=10,
                                  on_record=rows.append)
        recorder.tracker.window_stacks = False  # the window reads the reports at every row, without a dispatch mode
        with recorder:
            for step in range(4):
                recorder.begin_batch(x, step=step)
                kept = torch.empty(1000 + step, dtype=torch.uint8)  # a different size each step
                loss = model(x).pow(2).mean()
                recorder.mark_forward_done()
                loss.backward()
                recorder.mark_backward_done()
                optimizer.step()
                optimizer.zero_grad()
                del kept
                recorder.end_batch()
            assert recorder.tracker.deferring is not window
        return [(r.phase, r.allocated_bytes, r.peak_bytes, r.parameters_bytes, r.gradients_bytes,
                 r.optimizer_state_bytes, r.activations_bytes, r.inputs_bytes, r.other_bytes) for r in rows]

    run(False)  # warm-up: the first run's lazily made state is not part of the comparison
    deferred, immediate = run(False), run(True)
    assert len(deferred) == 20
    assert deferred == immediate


def _on_another_thread(work) -> None:
    import threading

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()


@contextlib.contextmanager
def _process_group() -> Iterator[None]:
    """A one-process gloo group, as a sharded run has (its worker threads are where the training thread's blocks get
    freed)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_block_another_thread_frees_is_counted_down_when_it_is_freed():
    """A collective's worker thread drops the last reference to a block the training thread made (gloo under FSDP2):
    its free reaches no report of this thread, and the allocator's process-wide total shows it at the next report."""
    tracker = AllocationTracker("cpu", backend="reports")
    with _process_group(), tracker:
        base = tracker.allocated
        holder = [torch.empty(3 * 10**6, dtype=torch.uint8)]
        tracker.reset_peak()
        _on_another_thread(holder.clear)
        after = torch.empty(5 * 10**6, dtype=torch.uint8)
        assert tracker.allocated == base + 5 * 10**6
        assert tracker.peak == base + 5 * 10**6  # not 8 MB: the 3 MB block was gone before the 5 MB one came
        # a block of the same size made later at the same address is counted once
        again = torch.empty(3 * 10**6, dtype=torch.uint8)
        assert tracker.allocated == base + 8 * 10**6
        del after, again
        assert tracker.allocated == base


@pytest.mark.parametrize("freed_there", ["older", "newer"])
def test_the_block_another_thread_frees_among_several_of_its_size_is_found(freed_there):
    """Two counted blocks of one size and another thread frees one of them: the count is right at once (the newest is
    taken first, as a collective's buffer is) and stays right when this thread frees the other one, whichever was
    taken."""
    size = 3 * 10**6
    tracker = AllocationTracker("cpu", backend="reports")
    with _process_group(), tracker:
        base = tracker.allocated
        blocks = {"older": [torch.empty(size, dtype=torch.uint8)], "newer": [torch.empty(size, dtype=torch.uint8)]}
        kept = blocks["newer" if freed_there == "older" else "older"][0]
        _on_another_thread(blocks[freed_there].clear)
        first = torch.empty(16, dtype=torch.uint8)
        assert tracker.allocated == base + size + 16
        assert tracker.peak == base + 2 * size  # one of the two was gone before the 16 bytes came
        blocks.clear()
        del kept
        second = torch.empty(16, dtype=torch.uint8)
        assert tracker.allocated == base + 32
        assert not [e for e in tracker.live_allocations() if e.nbytes == size]
        del first, second
        assert tracker.allocated == base


def test_without_a_process_group_another_threads_free_is_never_taken_for_this_threads_block():
    """Outside a sharded run, a block some other thread frees (its own, made before the session, of the very size of
    one of this thread's) leaves this thread's blocks counted: nothing hands them to another thread there."""
    from lightning_memtrace.capture.reports_backend import track_every_cpu_block

    track_every_cpu_block()
    theirs = [torch.empty(3 * 10**6, dtype=torch.uint8)]  # noted by the allocator, made before the session
    tracker = AllocationTracker("cpu", backend="reports")
    with tracker:
        base = tracker.allocated
        ours = torch.empty(3 * 10**6, dtype=torch.uint8)
        _on_another_thread(theirs.clear)
        small = torch.empty(16, dtype=torch.uint8)
        assert tracker.allocated == base + 3 * 10**6 + 16
        assert [e.nbytes for e in tracker.live_allocations() if e.addr == ours.data_ptr()] == [3 * 10**6]
        del ours, small
        assert tracker.allocated == base


def test_blocks_other_threads_make_and_free_leave_the_count_alone():
    """Another thread's own block (made there, freed there) is not this thread's memory, nor taken for a counted
    block of the same size when it goes."""
    tracker = AllocationTracker("cpu", backend="reports")
    with tracker:
        kept = torch.empty(2 * 10**6, dtype=torch.uint8)
        base = tracker.allocated
        box: list = []
        _on_another_thread(lambda: box.append(torch.empty(2 * 10**6, dtype=torch.uint8)))
        small = torch.empty(16, dtype=torch.uint8)  # the total has gone up by the other thread's block before this
        assert tracker.allocated == base + 16  # (read here: within one read, a rise and fall of the total cancel)
        _on_another_thread(box.clear)
        more = torch.empty(16, dtype=torch.uint8)  # ... and down by as much before this one
        assert tracker.allocated == base + 32
        assert tracker.peak >= base + 32
        assert [e.nbytes for e in tracker.live_allocations() if e.addr == kept.data_ptr()] == [2 * 10**6]
        del small, more, kept


def _block_made_elsewhere_during_a_session(other_threads_blocks: bool) -> list[int]:
    """How a session's reports show the allocator's total changed by a block another thread makes while it records
    (the bytes of each change; see ``AllocatorReports.other_threads``)."""
    reports = AllocatorReports(other_threads_blocks=other_threads_blocks)
    reports.start()
    try:
        theirs: list = []
        before = torch.empty(16, dtype=torch.uint8)  # the first report read sets the total to compare with
        _on_another_thread(lambda: theirs.append(torch.empty(2 * 10**6, dtype=torch.uint8)))
        after = torch.empty(16, dtype=torch.uint8)
        reports.drain()
        shown = [change for _, change in reports.other_threads]
        del before, after
        theirs.clear()
        reports.drain()
    finally:
        reports.stop()
    return shown


def test_without_a_process_group_the_session_notes_no_other_threads_blocks():
    """Noting every block costs the allocator a formatted log line per allocation and free (the largest cost of a
    session); while the session records this thread's blocks, other threads' blocks are noted only where a
    collective's worker thread may free this thread's blocks (a process group runs). Afterwards every block is noted
    again, as MemTrace set it up when made."""
    from lightning_memtrace.capture import torch_private
    from lightning_memtrace.capture.reports_backend import track_every_cpu_block

    native = torch_private.native_logging()
    assert native is not None
    track_every_cpu_block()
    noting = native._report_cpu
    if not noting.value:
        pytest.skip("the C++ log level shows INFO lines here: the allocator never notes every block")
    assert _block_made_elsewhere_during_a_session(other_threads_blocks=True) == [2 * 10**6]
    assert noting.value
    assert _block_made_elsewhere_during_a_session(other_threads_blocks=False) == []
    assert noting.value

    tracker = AllocationTracker("cpu", backend="reports")
    with tracker:
        assert not noting.value
    assert noting.value
    with _process_group(), tracker:
        assert noting.value
    assert noting.value


@pytest.mark.parametrize("collecting", [True, False])
def test_reading_many_reports_triggers_no_garbage_collection_and_leaves_the_collector_as_it_was(collecting):
    import gc

    tracker = AllocationTracker("cpu", backend="reports")
    collections: list[int] = []

    def seen(phase: str, info: dict) -> None:
        if phase == "start":
            collections.append(info["generation"])

    with tracker:
        base = tracker.allocated
        for _ in range(3000):  # thousands of reports: reading them makes several objects each
            torch.empty(4, dtype=torch.uint8)
        kept = torch.empty(100, dtype=torch.uint8)
        gc.collect()
        if not collecting:
            gc.disable()
        gc.callbacks.append(seen)
        try:
            tracker.sync()
        finally:
            gc.callbacks.remove(seen)
            enabled_after = gc.isenabled()
            gc.enable()
        assert tracker.allocated == base + 100
        assert tracker.peak == base + 100
        del kept
    assert collections == []
    assert enabled_after == collecting


def _made_by_first() -> torch.Tensor:
    return torch.ones(4096)


def _made_by_second() -> torch.Tensor:
    return torch.zeros(4096)


def test_blocks_made_at_an_address_handed_out_again_get_their_own_stacks():
    """Between two reads the allocator hands a freed address out again: each block made there gets the stack of the
    operator that made it, in order (a stack noted later at the address is not given to an earlier block)."""
    tracker = AllocationTracker("cpu", backend="reports")
    with tracker:
        tracker.record_history(True)
        kept: list[torch.Tensor] = []
        for _ in range(20):
            first = _made_by_first()
            addr = first.data_ptr()
            del first
            kept = [_made_by_second()]
            if kept[0].data_ptr() == addr:
                break
        else:
            pytest.skip("the allocator did not hand the address out again")
        trace = tracker.snapshot()["device_traces"][0]
        kept.clear()
    made_there = [e for e in trace if e["action"] == "alloc" and e["addr"] == addr]
    names = [{frame["name"] for frame in e["frames"]} for e in made_there[-2:]]
    assert "_made_by_first" in names[0] and "_made_by_second" not in names[0]
    assert "_made_by_second" in names[1] and "_made_by_first" not in names[1]


PAIRING = "Failed to recover relationship between all profiler and kineto events: 1 vs. 0 reconstructed: 0"


def _warn_here(text: str) -> None:
    warnings.warn(text, UserWarning, stacklevel=1)  # one location for every call: Python's once-record applies


def test_pairing_warning_is_dropped_and_every_other_shown_without_touching_the_filters():
    from lightning_memtrace.capture.reports_backend import pairing_warning_dropped

    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")
        filters = list(warnings.filters)
        showing = warnings.showwarning
        _warn_here("the user's warning")
        with pairing_warning_dropped():
            _warn_here(PAIRING)
            _warn_here("another warning of the user's")
            _warn_here("the user's warning")  # shown once already: stays shown once
        assert warnings.showwarning is showing
        _warn_here("the user's warning")
        assert warnings.filters == filters
    assert [str(w.message) for w in shown] == ["the user's warning", "another warning of the user's"]


def test_pairing_warning_under_an_error_filter_neither_raises_nor_hides_other_errors():
    from lightning_memtrace.capture.reports_backend import pairing_warning_dropped

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        before = list(warnings.filters)
        with pairing_warning_dropped():
            _warn_here(PAIRING)  # would end torch's call with its result lost
            with pytest.raises(UserWarning, match="the user's"):
                _warn_here("the user's warning")
        assert warnings.filters == before
