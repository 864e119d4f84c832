"""Each tracker backend on its own, writing into a fresh counting state: exact allocated and peak bytes."""

from __future__ import annotations

import pytest
import torch

from lightning_memtrace.capture.allocation_state import ALLOC, FREE, AllocationState, RowMark
from lightning_memtrace.capture.dispatch_backend import DispatchBackend
from lightning_memtrace.capture.reports_backend import MARK_BYTES, ReportsBackend

A, B, C, M = 0x10000, 0x20000, 0x30000, 0x40000


def _state(history_size: int = 100) -> AllocationState:
    return AllocationState(torch.device("cpu"), frames_min_bytes=1 << 62, stack_depth=8, history_size=history_size)


def _queue_mark(backend: ReportsBackend, addr: int, mark: RowMark) -> None:
    # What ReportsBackend.mark does, at an address of our choosing (it allocates a real block of MARK_BYTES).
    backend._marks.append((addr, mark))


def test_reports_apply_counts_frees_reaches_a_mark_and_drops_a_stale_block():
    state = _state()
    backend = ReportsBackend(state)
    row = RowMark("after_forward", "phase=after_forward step=0", labels=[(A, "parameters")])
    _queue_mark(backend, M, row)
    backend.apply(
        [
            (1_000_000, A, 100),
            (2_000_000, B, 300),
            (3_000_000, B, -300),
            (4_000_000, M, MARK_BYTES),  # the row's mark: read here, neither report counted
            (5_000_000, M, -MARK_BYTES),
            (6_000_000, A, 40),  # A handed out again with no free reported: the old block is gone
            (7_000_000, C, 10),
        ]
    )
    assert (row.allocated, row.peak) == (100, 400)
    assert (state.allocated, state.peak, state.max_allocated) == (50, 100, 400)
    assert sorted((e.addr, e.nbytes, e.stage) for e in state.entries()) == [
        (A, 40, "after_forward"),
        (C, 10, "after_forward"),
    ]
    # the row named A's block "parameters": the block the stale report replaced, freed at that report
    [(_, stale_time, stale, _)] = [e for e in state.events if e[0] == FREE and e[2].addr == A]
    assert (stale.nbytes, stale.category, stale_time) == (100, "parameters", 6_000)
    assert not backend._marks


def test_reports_apply_history_in_stream_order():
    state = _state()
    backend = ReportsBackend(state)
    _queue_mark(backend, M, RowMark("backward", "phase=backward"))
    backend.apply([(1_000, A, 8), (2_000, M, MARK_BYTES), (3_000, M, -MARK_BYTES), (4_000, A, 16), (5_000, A, -16)])
    kinds = [(event[0], event[2].addr, event[2].nbytes, event[1]) for event in state.events]
    assert kinds == [(ALLOC, A, 8, 1), (FREE, A, 8, 4), (ALLOC, A, 16, 4), (FREE, A, 16, 5)]
    assert (state.allocated, state.peak) == (0, 16)
    assert state.events[1][3] == "phase=backward"  # the stale block's free is tagged with the stage at the report


def test_a_mark_sized_block_without_a_queued_mark_is_counted():
    state = _state()
    ReportsBackend(state).apply([(1_000, M, MARK_BYTES), (2_000, M, -MARK_BYTES), (3_000, A, 5)])
    assert (state.allocated, state.peak) == (5, MARK_BYTES)


def test_reports_apply_gives_temporaries_the_nearest_outputs_stack():
    state = _state()
    state.capture_all_frames = True
    backend = ReportsBackend(state)
    stack = [{"filename": "model.py", "line": 3, "name": "forward"}]
    backend.pending_frames[B] = [stack]
    backend.apply([(1_000, A, 1), (2_000, B, 2), (3_000, C, 4)])  # A and C: temporaries around the output B
    assert {e.addr: e.frames for e in state.entries()} == {A: stack, B: stack, C: stack}
    assert not backend.pending_frames


def test_dispatch_backend_counts_operator_outputs_exactly():
    state = _state()
    backend = DispatchBackend(state, on_oom=None)
    backend.start()
    try:
        a = torch.empty(1000, dtype=torch.float32)
        view = a[::2]  # a view: no new bytes
        b = torch.ones(250, dtype=torch.float64)
        assert (state.allocated, state.peak) == (6000, 6000)
        del a, view
        assert (state.allocated, state.peak) == (2000, 6000)
        c = torch.empty(10, dtype=torch.uint8)
        c.resize_(100)  # resized in place: a free of 10 bytes and an allocation of 100
        assert state.allocated == 2100
    finally:
        backend.stop()
    assert not backend.active
    del b, c
    assert state.allocated == 0
    assert [event[0] for event in state.events][-2:] == [FREE, FREE]


def test_dispatch_backend_hands_an_out_of_memory_error_to_on_oom():
    state = _state()
    errors: list[BaseException] = []
    backend = DispatchBackend(state, on_oom=errors.append)
    with pytest.raises(RuntimeError):
        backend.start()
        try:
            torch.empty(10**15, dtype=torch.uint8)
        finally:
            backend.stop()
    assert len(errors) == 1 and "10" in str(errors[0])
    assert state.allocated == 0


def test_dispatch_backend_noting_frames_counts_nothing():
    state = _state()
    pending: dict = {}
    backend = DispatchBackend(state, on_oom=None)
    backend.note_frames_into(pending)
    backend.start()
    try:
        out = torch.empty(64, dtype=torch.uint8)
    finally:
        backend.stop()
    assert state.allocated == 0 and not state.events
    (noted,) = pending[out.data_ptr()]  # one stack per output made at the address, oldest first
    assert noted[0]["filename"] == __file__
