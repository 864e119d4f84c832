"""Memory that grows from one training batch to the next: what each batch starts with, batch after batch.

At a training batch's start nothing of the batch's own work is alive yet: what is held there is what the run keeps
between batches (parameters, optimizer state, the last step's gradients, and whatever the user's code keeps). In a
healthy run it is the same at every batch once the first steps have made the optimizer state and gradients. Where it
rises batch after batch, something keeps tensors from every batch: outputs appended to a list, a cache, a metric that
stores every prediction. Left alone, that ends in an out-of-memory error hours into a run; this module finds it in
MemTrace's per-phase rows (a log folder's CSV, or the rows a recorder holds while the run goes on or when the error
comes).

The rows' ``batch_start`` bytes are compared less the batch's inputs (batches differ in size) and the gradients (a
step skipped by returning ``None`` has none), from the :data:`SKIPPED_BATCHES` + 1st batch on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lightning_memtrace.types import ROW_CATEGORIES, Phase, PhaseRecord, category_label
from lightning_memtrace.units import format_bytes, percent

if TYPE_CHECKING:  # pandas is not imported during training (the recorder reads its own rows)
    import pandas as pd

#: The first training batches of a fit make the optimizer state, the first gradients, a DDP's buckets: not growth.
SKIPPED_BATCHES = 2
#: Batches in which the held bytes must rise, at least, for a rise to count (and in at least half of its batches).
MIN_RISING_BATCHES = 4
#: A rise smaller than this share of what was held where it began is not worth a finding.
MIN_SHARE = 0.01
#: Changes of at most this many bytes (or 0.01 % of what is held, where more) are no change: scalars come and go.
FLAT_BYTES = 1024
#: The rise is put in numbers for this many more batches.
PROJECTED_BATCHES = 1000


@dataclasses.dataclass(frozen=True)
class Growth:
    """A rise of the bytes held at training batches' starts, batch after batch, on one rank of one run.

    Attributes:
        rank: The rank whose rows rose.
        run: The run id of the rows.
        first_step: The step of the batch where the rise began (``first_epoch``, ``first_batch_idx``: its epoch and
            index in the epoch).
        last_step: The step of the batch where it ended: the last rise (``last_epoch``, ``last_batch_idx``).
        batches: Training batches from its start to its end (one fewer than its rows, where a row is taken at every
            batch).
        start_bytes: Held at the start of the rise (allocated less inputs and gradients).
        total_bytes: How much more was held at its end.
        by_category: The growth of each category that grew, largest first (bytes).
        freed: Whether the bytes fell back afterwards (at an epoch's end, say) before the last row, after this rise or
            after another one of the rows (then the rises come and go: this one too is taken for one that falls back).
        rises: How many separate rises there were (after each fall, another: every epoch, say).
    """

    rank: int
    run: str
    first_step: int
    last_step: int
    first_epoch: int
    first_batch_idx: int
    last_epoch: int
    last_batch_idx: int
    batches: int
    start_bytes: int
    total_bytes: int
    by_category: dict[str, int]
    freed: bool
    rises: int = 1

    @property
    def bytes_per_batch(self) -> int:
        return self.total_bytes // max(1, self.batches)

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["bytes_per_batch"] = self.bytes_per_batch
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Growth:
        """The rise :meth:`as_dict` described (its derived ``bytes_per_batch`` aside)."""
        return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})

    def sentence(self) -> str:
        """What rose, by how much, in one sentence, and what usually causes it."""
        grew = ", ".join(f"{category_label(c)} +{format_bytes(b)}" for c, b in self.by_category.items())
        text = (
            f"the memory held at the start of each training batch grew by {format_bytes(self.bytes_per_batch)} a batch "
            f"from step {self.first_step} (epoch {self.first_epoch}, batch {self.first_batch_idx}) to step "
            f"{self.last_step} (epoch {self.last_epoch}, batch {self.last_batch_idx}) on rank {self.rank}: "
            f"+{format_bytes(self.total_bytes)} ({self.total_bytes:,} B) over {self.batches} batches, "
            f"{percent(self.total_bytes, self.start_bytes):.0f}% of the {format_bytes(self.start_bytes)} held where it "
            f"began{'; ' + grew if grew else ''}. "
        )
        if self.freed:
            text += (
                "It was freed again afterwards"
                + (f" ({self.rises} such rises)" if self.rises > 1 else "")
                + ": tensors kept until an epoch ends (outputs kept for on_train_epoch_end, a metric that stores every "
                "batch until it is reset); the longer the epoch, the more they hold"
            )
        else:
            text += (
                "It was still held at the latest row: something keeps tensors from every batch, such as outputs or "
                "predictions appended to a list (detached or not, they stay on the device: keep .item() values, a "
                "running sum or .cpu() copies), a cache that keeps growing, or a metric that stores every batch; "
                f"{PROJECTED_BATCHES:,} more batches at this rate hold "
                f"{format_bytes(self.bytes_per_batch * PROJECTED_BATCHES)} more"
            )
        if self.by_category and next(iter(self.by_category)) == "optimizer_state":
            text += " (the optimizer state grows: SGD's momentum for sparse gradients grows with the rows touched)"
        return text


Row = Mapping[str, Any]
#: The fields of a row the rule reads.
FIELDS = ("step", "epoch", "batch_idx", "rank", "run", "allocated_bytes", *(f"{c}_bytes" for c in ROW_CATEGORIES))
#: Left out of what is held between batches (see the module's docstring).
_NOT_HELD = ("inputs", "gradients")


def _held(row: Row) -> int:
    return int(row["allocated_bytes"]) - sum(int(row[f"{c}_bytes"]) for c in _NOT_HELD)


def _rises(held: list[int], flat: int) -> list[tuple[int, int]]:
    """``(start, end)`` indices of the stretches of ``held`` that no fall ends: a fall of more than ``flat`` that gives
    back at least half of what the stretch had gained (a smaller dip does not end a rise)."""
    stretches, start = [], 0
    for index in range(1, len(held)):
        fall = held[index - 1] - held[index]
        if fall > flat and 2 * fall >= held[index - 1] - held[start]:
            stretches.append((start, index - 1))
            start = index
    stretches.append((start, len(held) - 1))
    return stretches


def _batches_between_rows(starts: Sequence[Row]) -> int:
    """Training batches from one ``batch_start`` row to the next: 1, or more where rows are taken every few steps
    (``every_n_steps``), told by the rows' ``batch_idx`` within an epoch."""
    gaps = sorted(
        int(b["batch_idx"]) - int(a["batch_idx"])
        for a, b in zip(starts, starts[1:])
        if a["epoch"] == b["epoch"] and b["batch_idx"] > a["batch_idx"]
    )
    return gaps[len(gaps) // 2] if gaps else 1


def rank_growth(starts: Sequence[Row]) -> Growth | None:
    """The largest rise of one rank's ``batch_start`` rows of one run (in the order they were taken, each a mapping
    with the :data:`FIELDS`), or None.

    A rise counts where the held bytes rise (by more than :data:`FLAT_BYTES`) in at least :data:`MIN_RISING_BATCHES`
    batches and in half of its batches or more, give back no more than half of their gain at once meanwhile, and grow by
    :data:`MIN_SHARE` or more of what was held where it began.
    """
    starts = starts[SKIPPED_BATCHES:]
    if len(starts) <= MIN_RISING_BATCHES:
        return None
    held = [_held(row) for row in starts]
    flat = max(FLAT_BYTES, sorted(held)[len(held) // 2] // 10_000)
    found = []
    for stretch_start, stretch_end in _rises(held, flat):
        rising = [i for i in range(stretch_start + 1, stretch_end + 1) if held[i] > held[i - 1] + flat]
        if len(rising) < MIN_RISING_BATCHES:
            continue
        # from the batch before the first rise to the last rise: a flat run before or after is no part of it
        start, end = rising[0] - 1, rising[-1]
        total = held[end] - held[start]
        if 2 * len(rising) >= end - start and total >= MIN_SHARE * max(1, held[start]):
            found.append((total, start, end, stretch_end))
    if not found:
        return None
    # the largest rise; where another one fell back (every epoch's outputs, say), the last one, still rising where the
    # rows end, is taken for one more of them
    total, start, end, _ = max(found, key=lambda f: (f[0], f[3] < len(held) - 1))
    first, last = starts[start], starts[end]
    grown = {c: int(last[f"{c}_bytes"]) - int(first[f"{c}_bytes"]) for c in ROW_CATEGORIES if c not in _NOT_HELD}
    return Growth(
        rank=int(first["rank"]),
        run=str(first["run"]),
        first_step=int(first["step"]),
        last_step=int(last["step"]),
        first_epoch=int(first["epoch"]),
        first_batch_idx=int(first["batch_idx"]),
        last_epoch=int(last["epoch"]),
        last_batch_idx=int(last["batch_idx"]),
        batches=(end - start) * _batches_between_rows(starts),
        start_bytes=held[start],
        total_bytes=total,
        by_category={c: b for c, b in sorted(grown.items(), key=lambda kv: -kv[1]) if b > flat},
        freed=any(f[3] < len(held) - 1 for f in found),
        rises=len(found),
    )


def records_growth(records: Iterable[PhaseRecord]) -> Growth | None:
    """The largest rise among one recorder's rows (:attr:`MemoryRecorder.records <lightning_memtrace.capture.recorder.
    MemoryRecorder.records>`: one run, one rank), or None. Reads only the ``batch_start`` rows' few fields: it runs
    while the run goes on."""
    starts = [{f: getattr(r, f) for f in FIELDS} for r in records if r.phase == Phase.BATCH_START]
    return rank_growth(starts) if starts else None


def growth(phases: pd.DataFrame) -> list[Growth]:
    """Every rank's and run's largest rise in a phases table (:func:`~lightning_memtrace.load_phases`), the largest
    first."""
    if not len(phases) or "phase" not in phases:
        return []
    starts = phases.loc[phases["phase"] == Phase.BATCH_START.value, list(FIELDS)]
    groups: dict[tuple[str, int], list[Row]] = {}
    for row in starts.to_dict("records"):
        groups.setdefault((str(row["run"]), int(row["rank"])), []).append(row)
    found = [g for rows in groups.values() if (g := rank_growth(rows)) is not None]
    return sorted(found, key=lambda g: -g.total_bytes)
