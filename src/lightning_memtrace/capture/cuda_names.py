"""The rows' categories on the CUDA allocator's own snapshot.

On CUDA the snapshot is ``torch.cuda.memory._snapshot()``, which knows no categories. Each time MemTrace names the
live storages while the allocator's history is recorded (a row inside the window, the post-mortem's walk), the
window keeps their addresses by category (:func:`naming_of`). :func:`name_allocations` then gives every allocation of
the trace the category it had at the latest naming it was alive for, ``other`` where namings saw it alive and named
it nothing, and ``unknown`` where none saw it (readers infer those), as MemTrace's CPU snapshots carry them
(:mod:`~lightning_memtrace.capture.snapshot_builder`). Lifetimes and namings are compared by time: the trace's
``time_us`` and the naming's are both Unix microseconds.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

from lightning_memtrace.capture.categories import NamedStorages
from lightning_memtrace.capture.snapshot_builder import UNNAMED_CATEGORY, unknown_marker
from lightning_memtrace.schema import CATEGORY_FIELD, UNKNOWN_CATEGORY

#: ``(time_us, {address: category})``: the live storages as one naming named them.
Naming = tuple[int, dict[int, str]]


def naming_of(named: NamedStorages, time_us: int) -> Naming:
    """The addresses of the storages ``named`` named at ``time_us``, with their categories."""
    return time_us, {storage.data_ptr(): category.value for category, storage in named.storages.values()}


class _Namings:
    """Namings in time order, asked what an address was over a stretch of time."""

    def __init__(self, namings: Sequence[Naming]) -> None:
        ordered = sorted(namings, key=lambda naming: naming[0])
        self.times = [time_us for time_us, _ in ordered]
        self.names = [names for _, names in ordered]

    def category(self, addr: Any, start_us: int | None, end_us: int | None) -> str:
        """The category of the allocation at ``addr`` alive from ``start_us`` (None: before the trace) until
        ``end_us`` (None: still alive): the latest naming's inside that time that named it; else ``other`` where a
        naming saw it alive (made inside the trace); else ``unknown``."""
        lo = 0 if start_us is None else bisect.bisect_left(self.times, start_us)
        hi = len(self.times) if end_us is None else bisect.bisect_left(self.times, end_us)
        for names in reversed(self.names[lo:hi]):
            category = names.get(addr)
            if category is not None:
                return category
        return UNNAMED_CATEGORY if hi > lo and start_us is not None else UNKNOWN_CATEGORY


def name_allocations(snapshot: dict[str, Any], namings: Sequence[Naming], device_index: int) -> None:
    """Put ``category`` on every event of ``device_index``'s trace and every block of its segments, in place.

    An allocation's time runs from its ``alloc`` to its ``free_requested`` (the program let go of it there; the
    ``free_completed`` after it, once the streams are done with it, gets the same category).
    """
    by_time = _Namings(namings)
    traces = snapshot.get("device_traces") or []
    trace = traces[device_index] if 0 <= device_index < len(traces) and isinstance(traces[device_index], list) else []
    made: dict[Any, dict[str, Any]] = {}  # address -> the alloc event of the allocation alive there
    freed: dict[Any, str] = {}  # address -> the category of the allocation freed there, until its free completes
    for event in trace:
        action, addr = event.get("action"), event.get("addr")
        if action == "alloc":
            made[addr] = event
            event[CATEGORY_FIELD] = UNKNOWN_CATEGORY
        elif action == "free_requested" or (action == "free_completed" and addr in made):
            # (a free_completed with its allocation still open: a trace without free_requested events)
            alloc = made.pop(addr, None)
            end = _time(event)
            category = _lifetime_category(by_time, addr, alloc, end) if end is not None else UNKNOWN_CATEGORY
            if alloc is not None:
                alloc[CATEGORY_FIELD] = category
            event[CATEGORY_FIELD] = category
            if action == "free_requested":
                freed[addr] = category
        elif action == "free_completed":
            event[CATEGORY_FIELD] = freed.pop(addr, UNKNOWN_CATEGORY)
        else:
            event.setdefault(CATEGORY_FIELD, UNKNOWN_CATEGORY)
    for addr, alloc in made.items():  # alive at the end
        alloc[CATEGORY_FIELD] = _lifetime_category(by_time, addr, alloc, None)
    if trace and all(event.get(CATEGORY_FIELD) != UNKNOWN_CATEGORY for event in trace):
        trace.append(unknown_marker(trace[-1].get("time_us", 0), ""))
    for segment in snapshot.get("segments") or []:
        if isinstance(segment, dict) and segment.get("device", device_index) == device_index:
            _name_blocks(segment, made, by_time)


def _time(event: dict[str, Any]) -> int | None:
    value = event.get("time_us")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _lifetime_category(by_time: _Namings, addr: Any, alloc: dict[str, Any] | None, end_us: int | None) -> str:
    """The category of the allocation at ``addr`` made by ``alloc`` (None: before the trace) and freed at ``end_us``
    (None: alive at the end); ``unknown`` where its making has no time."""
    if alloc is None:
        return by_time.category(addr, None, end_us)
    start = _time(alloc)
    return by_time.category(addr, start, end_us) if start is not None else UNKNOWN_CATEGORY


def _name_blocks(segment: dict[str, Any], made: dict[Any, dict[str, Any]], by_time: _Namings) -> None:
    """The live blocks of a segment: the category of their allocation in the trace, else of the latest naming."""
    addr = segment.get("address")
    for block in segment.get("blocks") or []:
        if not isinstance(block, dict):
            continue
        # torch before 2.1 gives blocks no address: they lie one after the other from the segment's
        block_addr = block.get("address", addr)
        if str(block.get("state", "")).startswith("active"):
            alloc = made.get(block_addr)
            block[CATEGORY_FIELD] = (
                alloc[CATEGORY_FIELD] if alloc is not None else by_time.category(block_addr, None, None)
            )
        if isinstance(block_addr, int) and isinstance(block.get("size"), int):
            addr = block_addr + block["size"]
