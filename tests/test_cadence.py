"""The maxima logged at a step are those of that optimizer step's rows, also when rows arrive batches late."""

from __future__ import annotations

from lightning_memtrace.trainer.cadence import RowMaxima
from lightning_memtrace.types import Phase, PhaseRecord
from lightning_memtrace.units import MIB


def _row(step: int, phase: Phase, allocated: int) -> PhaseRecord:
    return PhaseRecord(
        step=step, epoch=0, batch_idx=step, rank=0, phase=phase, time_s=0.0, allocated_bytes=allocated,
        reserved_bytes=allocated, peak_bytes=allocated, parameters_bytes=0, gradients_bytes=0,
        optimizer_state_bytes=0, activations_bytes=0, inputs_bytes=0, other_bytes=allocated,
    )


def test_rows_taken_before_a_hand_out_stay_out_of_the_next_maxima():
    maxima = RowMaxima()
    key = "memtrace/batch_start/allocated"
    maxima.add(_row(0, Phase.BATCH_START, 9 * MIB))
    # step 0 ends having taken two training rows, one of them not arrived yet: its maxima are dropped (not logged)
    assert maxima.take_train(rows_taken=2)[key] == 9.0
    maxima.add(_row(0, Phase.AFTER_FORWARD, 8 * MIB))  # arrives late: step 0's
    maxima.add(_row(1, Phase.BATCH_START, 3 * MIB))
    maxima.add(_row(1, Phase.AFTER_FORWARD, 4 * MIB))
    # validation rows count apart and never shift the training rows' numbering
    maxima.add(_row(1, Phase.VAL_BATCH_START, 7 * MIB))
    logged = maxima.take_train(rows_taken=4)
    assert (logged[key], logged["memtrace/after_forward/allocated"]) == (3.0, 4.0)
    assert maxima.take_val()["memtrace/val_batch_start/allocated"] == 7.0
    assert maxima.take_train(rows_taken=4) == {}


def test_clear_starts_the_numbering_again():
    maxima = RowMaxima()
    maxima.add(_row(0, Phase.BATCH_START, MIB))
    maxima.take_train(rows_taken=5)
    maxima.clear()
    maxima.add(_row(0, Phase.BATCH_START, 2 * MIB))
    assert maxima.take_train(rows_taken=1)["memtrace/batch_start/allocated"] == 2.0
