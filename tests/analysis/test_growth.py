"""Memory held between training batches that rises batch after batch: found in the rows, in numbers; nothing found
where the rows only move with the batch (its inputs, a skipped step's gradients) or by a few bytes."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest

from lightning_memtrace.analysis.findings import growth_finding
from lightning_memtrace.analysis.growth import SKIPPED_BATCHES, Growth, growth, records_growth
from lightning_memtrace.analysis.postmortem import render_post_mortem
from lightning_memtrace.types import Phase, PhaseRecord
from test_postmortem_text import _post_mortem

KIB = 1024
BASE = 400 * KIB  # parameters + optimizer state held at every batch's start


def _rows(other: list[int], inputs: list[int] | None = None, gradients: list[int] | None = None,
          epoch_of=lambda i: 0, rank: int = 0, run: str = "r1", every: int = 1) -> pd.DataFrame:
    """A phases table: for each batch a ``batch_start`` row (``other`` bytes besides the model's) and an
    ``after_forward`` row (with activations, which must not count), one optimizer step a batch."""
    rows = []
    for i, kept in enumerate(other):
        grads = gradients[i] if gradients else 100 * KIB
        batch = inputs[i] if inputs else 8 * KIB
        common = dict(step=i * every, epoch=epoch_of(i), batch_idx=i * every, rank=rank, run=run, reserved_bytes=0, time_s=float(i),
                      parameters_bytes=100 * KIB, optimizer_state_bytes=BASE - 100 * KIB, gradients_bytes=grads,
                      inputs_bytes=batch, other_bytes=kept, unsharded_parameters_bytes=0,
                      unsharded_gradients_bytes=0, dataloader_idx=0)
        held = BASE + grads + batch + kept
        rows.append(dict(common, phase="batch_start", allocated_bytes=held, peak_bytes=held, activations_bytes=0))
        act = 50 * KIB * (1 + i % 3)
        rows.append(dict(common, phase="after_forward", allocated_bytes=held + act, peak_bytes=held + act,
                         activations_bytes=act))
    return pd.DataFrame(rows)


def test_a_steady_rise_is_found_with_its_bytes_per_batch_and_category():
    found = growth(_rows([16 * KIB * i for i in range(12)]))
    assert len(found) == 1
    rise = found[0]
    # the first SKIPPED_BATCHES batches are left out: the rise is counted from batch 2 to batch 11
    assert (rise.first_step, rise.last_step, rise.batches) == (SKIPPED_BATCHES, 11, 11 - SKIPPED_BATCHES)
    assert rise.total_bytes == 16 * KIB * 9 and rise.bytes_per_batch == 16 * KIB
    assert rise.start_bytes == BASE + 32 * KIB  # held less inputs and gradients, where it began
    assert rise.by_category == {"other": 16 * KIB * 9} and not rise.freed and rise.rises == 1


def test_the_finding_is_a_warning_with_its_numbers_and_a_projection():
    (finding,) = growth_finding(_rows([16 * KIB * i for i in range(12)]))
    assert finding.code == "growth" and finding.severity == "warning"
    assert finding.numbers["bytes_per_batch"] == 16 * KIB and finding.numbers["ranks_and_runs_growing"] == 1
    assert "grew by 16.0 KiB a batch from step 2 (epoch 0, batch 2) to step 11 (epoch 0, batch 11) on rank 0" in (
        finding.message
    )
    assert "+144.0 KiB (147,456 B) over 9 batches" in finding.message and "other +144.0 KiB" in finding.message
    assert "still held at the latest row" in finding.message
    assert "1,000 more batches at this rate hold 15.6 MiB more" in finding.message


def test_a_rise_freed_at_every_epochs_end_is_information():
    # ten batches an epoch; each keeps 8 KiB until the epoch ends
    other = [8 * KIB * (i % 10) for i in range(40)]
    (finding,) = growth_finding(_rows(other, epoch_of=lambda i: i // 10))
    assert finding.severity == "info" and finding.numbers["freed"] and finding.numbers["rises"] == 4
    assert finding.numbers["total_bytes"] == 9 * 8 * KIB and finding.numbers["bytes_per_batch"] == 8 * KIB
    assert "freed again afterwards (4 such rises)" in finding.message


def test_rows_taken_every_few_steps_give_the_bytes_of_one_batch():
    # every_n_steps=5: a row every fifth batch, 80 KiB more each time
    (rise,) = growth(_rows([80 * KIB * i for i in range(12)], every=5))
    assert (rise.first_step, rise.last_step, rise.batches) == (10, 55, 45)
    assert rise.bytes_per_batch == 16 * KIB


def test_a_rise_that_begins_late_is_counted_from_where_it_begins():
    other = [0] * 20 + [4 * KIB * i for i in range(1, 11)]
    (rise,) = growth(_rows(other))
    assert (rise.first_step, rise.last_step, rise.total_bytes) == (19, 29, 40 * KIB)  # from the batch before


@pytest.mark.parametrize(
    "case",
    ["flat", "noise", "inputs vary", "skipped steps", "too small", "too few"],
)
def test_no_rise_where_nothing_is_kept(case):
    n = 30
    other, inputs, gradients = [0] * n, None, None
    if case == "noise":  # scalars come and go: a few hundred bytes up and down
        other = [(i * 37) % 600 for i in range(n)]
    if case == "inputs vary":  # longer and shorter batches, rising on the whole
        inputs = [KIB * (8 + i) for i in range(n)]
    if case == "skipped steps":  # every other step returns None: no gradients at the next batch's start
        gradients = [0 if i % 2 else 100 * KIB for i in range(n)]
    if case == "too small":  # 32 B a batch: under a thousandth of what is held
        other = [32 * i for i in range(n)]
    if case == "too few":
        other = [16 * KIB * i for i in range(SKIPPED_BATCHES + 4)]
    assert growth(_rows(other, inputs, gradients)) == []
    assert growth_finding(_rows(other, inputs, gradients)) == []


def test_a_small_dip_does_not_end_a_rise_and_a_fall_does():
    other = [16 * KIB * i for i in range(12)]
    other[7] -= 2 * KIB  # a dip: well under half of the rise so far
    (rise,) = growth(_rows(other))
    assert (rise.first_step, rise.last_step, rise.freed) == (2, 11, False)
    other = [16 * KIB * i for i in range(12)] + [0] * 3  # all of it given back: the rise was freed
    (rise,) = growth(_rows(other))
    assert rise.last_step == 11 and rise.freed


def test_each_rank_and_run_is_read_alone_and_the_largest_rise_comes_first():
    table = pd.concat([
        _rows([0] * 12, rank=0),
        _rows([4 * KIB * i for i in range(12)], rank=1),
        _rows([16 * KIB * i for i in range(12)], rank=0, run="r2"),
    ])
    found = growth(table)
    assert [(g.rank, g.run, g.bytes_per_batch) for g in found] == [(0, "r2", 16 * KIB), (1, "r1", 4 * KIB)]
    assert growth_finding(table)[0].numbers["ranks_and_runs_growing"] == 2


def test_a_recorders_rows_and_the_dict_round_trip():
    table = _rows([16 * KIB * i for i in range(12)])
    records = [PhaseRecord(**{**row, "phase": Phase(row["phase"])}) for row in table.to_dict("records")]
    rise = records_growth(records)
    assert rise == growth(table)[0]
    assert Growth.from_dict(rise.as_dict()) == rise and rise.as_dict()["bytes_per_batch"] == 16 * KIB
    assert records_growth([]) is None


def test_the_post_mortem_names_the_rise_first_in_what_to_change(expected):
    rise = growth(_rows([16 * KIB * i for i in range(12)]))[0]
    pm = dataclasses.replace(_post_mortem("cuda:0"), growth=rise.as_dict())
    expected(render_post_mortem(pm), "postmortem_growth.txt")
