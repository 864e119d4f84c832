"""The per-phase CSV: whole lines, header once, append on resume, and load_phases across ranks."""

from __future__ import annotations

import pytest

from lightning_memtrace import load_phases
from lightning_memtrace.capture.phases_writer import PhaseCsvWriter
from lightning_memtrace.types import PHASE_COLUMNS as COLUMNS
from lightning_memtrace.types import Phase, PhaseRecord


def _record(step: int, rank: int = 0, allocated: int = 1000) -> PhaseRecord:
    return PhaseRecord(
        step=step, epoch=0, batch_idx=step, rank=rank, phase=Phase.AFTER_FORWARD, time_s=1.5,
        allocated_bytes=allocated, reserved_bytes=allocated, peak_bytes=allocated + 1,
        parameters_bytes=400, gradients_bytes=0, optimizer_state_bytes=0, activations_bytes=500,
        inputs_bytes=64, other_bytes=allocated - 964,
    )


def test_rows_header_and_append(tmp_path):
    path = tmp_path / "phases_rank0.csv"
    writer = PhaseCsvWriter(path)
    for step in range(3):
        writer.write(_record(step))
    writer.close()
    writer = PhaseCsvWriter(path)  # resume: append, no second header
    writer.write(_record(3, allocated=2**40))
    writer.close()
    lines = path.read_text().splitlines()
    assert lines[0] == ",".join(COLUMNS)
    assert len(lines) == 5
    frame = load_phases(path)
    assert list(frame.step) == [0, 1, 2, 3]
    assert frame.allocated_bytes.iloc[-1] == 2**40 and str(frame.allocated_bytes.dtype) == "int64"


def test_cut_line_is_skipped_and_repaired(tmp_path):
    path = tmp_path / "phases_rank0.csv"
    writer = PhaseCsvWriter(path)
    writer.write(_record(0))
    writer.close()
    with open(path, "a") as handle:
        handle.write("1,0,1,0,after_forward,1.5,10")  # a line cut by SIGKILL
    assert list(load_phases(path).step) == [0]
    writer = PhaseCsvWriter(path)
    writer.write(_record(2))
    writer.close()
    assert list(load_phases(path).step) == [0, 2]


def test_row_cap(tmp_path):
    writer = PhaseCsvWriter(tmp_path / "phases_rank0.csv", max_rows=2)
    assert [writer.write(_record(i)) for i in range(4)] == [True, True, False, False]
    writer.close()
    assert len(load_phases(tmp_path)) == 2


def test_all_ranks_concatenated_from_log_dir(tmp_path):
    folder = tmp_path / "version_0" / "memtrace"
    for rank in (1, 0):
        writer = PhaseCsvWriter(folder / f"phases_rank{rank}.csv")
        writer.write(_record(0, rank=rank))
        writer.write(_record(1, rank=rank))
        writer.close()
    frame = load_phases(tmp_path / "version_0")
    assert list(frame["rank"]) == [0, 0, 1, 1]


def test_missing_or_foreign_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no MemTrace phases CSV"):
        load_phases(tmp_path)
    foreign = tmp_path / "phases_rank0.csv"
    foreign.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="missing columns"):
        load_phases(foreign)
