"""A row's numbers: its categories named from the live storages, and its allocated/peak/reserved bytes.

A row is read at once (allocator counters, or the tracker after it took in the reports so far), or, while the tracker
defers (the CPU allocator's reports outside the history window), named now and read later, where the report stream
reaches the row's mark (:class:`~lightning_memtrace.capture.tracker.RowMark`).
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections import deque
from collections.abc import Callable
from itertools import filterfalse
from typing import Any, NamedTuple

import torch

from lightning_memtrace.capture.categories import (
    CategoryCounter,
    NamedStorages,
    SavedTensorsRecorder,
    input_storages,
)
from lightning_memtrace.capture.counters import MemoryCounters
from lightning_memtrace.capture.storages import storage_of
from lightning_memtrace.capture.tracker import AllocationTracker, RowMark
from lightning_memtrace.types import Category, Phase, PhaseRecord

_CATEGORY_NAMES = {category: category.value for category in Category}
_DATA_PTR = torch.UntypedStorage.data_ptr
_NBYTES = torch.UntypedStorage.nbytes
Labels = list[tuple[int, str]]
Foreign = list[tuple[weakref.ref, str]]


class RowPlace(NamedTuple):
    """Where a row was taken: everything of it but its byte counts."""

    phase: Phase
    step: int
    epoch: int
    batch_idx: int
    rank: int
    time_s: float
    run: str
    dataloader_idx: int = 0


_PARAMETERS, _GRADIENTS, _OPTIMIZER_STATE = Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATE
_ACTIVATIONS, _INPUTS = Category.ACTIVATIONS, Category.INPUTS
_UNSHARDED_PARAMETERS, _UNSHARDED_GRADIENTS = Category.UNSHARDED_PARAMETERS, Category.UNSHARDED_GRADIENTS
_new_object = object.__new__


def make_record(
    place: RowPlace, allocated: int, reserved: int, peak: int, totals: dict[Category, int]
) -> PhaseRecord:
    """The row: ``other`` is what is allocated beyond the named categories (never negative)."""
    # Made for every row (two per validation batch): its fields are filled as one dict update, since the frozen
    # dataclass's __init__ sets them one by one through object.__setattr__ (three times slower).
    record = _new_object(PhaseRecord)
    record.__dict__.update(
        step=place.step,
        epoch=place.epoch,
        batch_idx=place.batch_idx,
        rank=place.rank,
        phase=place.phase,
        time_s=place.time_s,
        allocated_bytes=allocated,
        reserved_bytes=reserved,
        peak_bytes=max(peak, allocated),
        parameters_bytes=totals[_PARAMETERS],
        gradients_bytes=totals[_GRADIENTS],
        optimizer_state_bytes=totals[_OPTIMIZER_STATE],
        activations_bytes=totals[_ACTIVATIONS],
        inputs_bytes=totals[_INPUTS],
        other_bytes=max(0, allocated - sum(totals.values())),
        run=place.run,
        unsharded_parameters_bytes=totals[_UNSHARDED_PARAMETERS],
        unsharded_gradients_bytes=totals[_UNSHARDED_GRADIENTS],
        dataloader_idx=place.dataloader_idx,
    )
    return record


def row_parts(
    tracker: AllocationTracker | None, named: NamedStorages, refs: dict[int, weakref.ref] | None = None
) -> tuple[dict[Category, int], Labels, Foreign]:
    """Totals by category, and for the tracker the ``(address, category)`` labels and the storages at addresses it does
    not count yet (adopted at the row's mark), each by the weak reference ``refs`` holds for its key, if any (a
    batch's inputs: :meth:`AllocationTracker.watch`)."""
    totals = dict(named.totals)
    if tracker is None or not named.storages:
        return totals, [], []
    # Runs for every storage of every row: a field at a time, at C speed.
    categories, storages = zip(*named.storages.values())
    names = list(map(_CATEGORY_NAMES.__getitem__, categories))
    addrs = list(map(_DATA_PTR, storages))
    labels: Labels = list(zip(addrs, names))
    blocks, live_addrs = tracker.counted_addresses()
    uncounted = set(filterfalse(live_addrs.__contains__, filterfalse(blocks.__contains__, addrs)))
    if not uncounted:
        return totals, labels, []
    refs = refs or {}
    foreign: Foreign = []
    for key, addr, storage, name in zip(named.storages, addrs, storages, names):
        if addr in uncounted:
            ref = refs.get(key)
            foreign.append((ref if ref is not None else weakref.ref(storage), name))
    return totals, labels, foreign


@dataclasses.dataclass(eq=False)
class RowReader:
    """Names and reads the rows of one recorder.

    In training every row names its storages anew. In validation nothing trains, so the model states (parameters,
    gradients, optimizer state) are named once per validation run (:meth:`begin_batch` with ``training=False`` keeps
    them) and only the batch's inputs per row; activations are 0 there.
    """

    device: torch.device
    categories: CategoryCounter
    saved: SavedTensorsRecorder
    tracker: AllocationTracker | None
    counters: MemoryCounters | None
    training: bool = dataclasses.field(default=False, init=False)
    #: Told of every naming of the live storages and its time (Unix microseconds), or None.
    on_named: Callable[[NamedStorages, int], None] | None = dataclasses.field(default=None, init=False)
    #: Rows named and waiting for the report stream to reach their marks, oldest first.
    deferred: deque[RowMark] = dataclasses.field(default_factory=deque, init=False)
    _inputs: dict[int, weakref.ref] = dataclasses.field(default_factory=dict, init=False)
    # The last batch's input references (a batch whose storages it shares keeps them: one reference per storage).
    _input_refs: dict[int, weakref.ref] = dataclasses.field(default_factory=dict, init=False)
    _model_states: tuple[NamedStorages, dict[Category, int], Labels, Foreign] | None = dataclasses.field(
        default=None, init=False
    )

    def begin_batch(self, batch: Any, training: bool) -> None:
        """A batch starts: its tensors are the inputs; a training batch (or a new validation run) names anew."""
        self.training = training
        if training or self._model_states is None:
            self._model_states = None
            self.categories.refresh()
        self._inputs = self._input_references(input_storages(batch, self.device)) if batch is not None else {}

    def _input_references(self, storages: dict[int, torch.UntypedStorage]) -> dict[int, weakref.ref]:
        """Weak references to the batch's input storages: watched ones while rows are deferred (an input may be gone
        where the report stream reaches the rows that named it)."""
        tracker = self.tracker
        if tracker is None or not tracker.deferring:
            self._input_refs = {}
            return {key: weakref.ref(storage) for key, storage in storages.items()}
        previous, refs = self._input_refs, {}
        for key, storage in storages.items():
            ref = previous.get(key)
            refs[key] = ref if ref is not None and ref() is storage else tracker.watch(storage)
        self._input_refs = refs
        return refs

    def end_batch(self) -> None:
        self._inputs = {}

    def _live_inputs(self) -> dict[int, torch.UntypedStorage]:
        out = {}
        for key, ref in self._inputs.items():
            storage = storage_of(ref)
            if storage is not None:
                out[key] = storage
        return out

    def classify(self) -> NamedStorages:
        """Every storage nameable now; the tracker counts those it did not see made and tags all of them."""
        time_us = time.time_ns() // 1000 if self.on_named is not None else 0  # before naming: all of it exists then
        named = self.categories.name(
            inputs=self._live_inputs(), saved=self.saved.live_storages() if self.training else None
        )
        if self.tracker is not None:
            self.tracker.label(named.storages)
        if self.on_named is not None:
            self.on_named(named, time_us)
        return named

    def _validation_parts(self, tracker: AllocationTracker | None) -> tuple[dict[Category, int], Labels, Foreign]:
        first = self._model_states is None
        if self._model_states is None:
            states = self.categories.name()
            self._model_states = (states, *row_parts(tracker, states))
        states, state_totals, state_labels, state_foreign = self._model_states
        named = states.storages
        inputs = {key: st for key, st in self._live_inputs().items() if key not in named}
        totals = dict(state_totals)
        totals[_ACTIVATIONS] = 0
        if tracker is None:  # nothing to label: the inputs' bytes are all a row needs (two rows per batch)
            totals[_INPUTS] += sum(map(_NBYTES, inputs.values()))
            return totals, [], []
        named_inputs = NamedStorages()
        named_inputs.add(inputs, _INPUTS)
        input_totals, labels, foreign = row_parts(tracker, named_inputs, self._inputs)
        totals[_INPUTS] += input_totals[_INPUTS]
        if first:  # the model states keep their labels for the rest of the validation run
            labels, foreign = state_labels + labels, state_foreign + foreign
        return totals, labels, foreign

    def read(self, place: RowPlace) -> PhaseRecord:
        """The row now (with a tracker: as far as the reports taken in so far go)."""
        if self.training or self.tracker is not None:
            totals = self.classify().totals
            if not self.training:
                totals[Category.ACTIVATIONS] = 0
        else:
            totals = self._validation_parts(None)[0]
        if self.counters is not None:
            allocated, reserved, peak = self.counters.read()
        else:
            allocated = reserved = peak = sum(totals.values())
        return make_record(place, int(allocated), int(reserved), int(peak), totals)

    def defer(self, place: RowPlace) -> None:
        """Name the row now and read its allocated/peak bytes where the report stream reaches its mark."""
        tracker = self.tracker
        assert tracker is not None
        if self.training:
            named = self.categories.name(inputs=self._live_inputs(), saved=self.saved.live_storages())
            totals, labels, foreign = row_parts(tracker, named, self._inputs)
        else:
            totals, labels, foreign = self._validation_parts(tracker)
        row = RowMark(tracker.stage, tracker.metadata, labels, foreign, (place, totals), names=True)
        tracker.mark(row)
        self.deferred.append(row)

    def ready(self) -> list[PhaseRecord]:
        """The deferred rows the report stream has reached, in order."""
        rows = self.deferred
        records = []
        while rows and rows[0].allocated is not None:
            row = rows.popleft()
            place, totals = row.payload
            allocated = int(row.allocated)
            records.append(make_record(place, allocated, allocated, int(row.peak or 0), totals))
        return records
