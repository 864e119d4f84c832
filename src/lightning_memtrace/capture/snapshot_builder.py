"""The tracker's state in the dict format of ``torch.cuda.memory._snapshot()`` (what memory_viz and our readers open).

``segments`` hold one segment per live storage (the CPU allocator has no caching, so reserved equals allocated);
``device_traces[device_index]`` holds the history's events since a time. Allocations and blocks carry ``category`` and
``user_metadata`` (the phase and step they were made in). ``external_annotations`` holds the ``record_function``
ranges entered and left inside the history window, in torch's form (``{"name", "stage": "START" | "END", "time_us",
"device"}``, what ``torch.cuda.memory._snapshot()`` holds for them on CUDA); the window adds MemTrace's phases to it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from lightning_memtrace.capture.allocation_state import ALLOC, FREE, LiveAllocation, OutOfMemoryEvent
from lightning_memtrace.schema import CATEGORY_FIELD, TAG_FIELD, UNKNOWN_CATEGORY
from lightning_memtrace.types import Category

#: The category of an allocation alive where MemTrace named the live storages that was none of them (as the rows
#: count it).
UNNAMED_CATEGORY = Category.OTHER.value


def build_snapshot(
    entries: Iterable[LiveAllocation],
    events: Iterable[tuple],
    since_us: int,
    device_index: int,
    metadata: str,
    annotations: Iterable[tuple[int, str, str]] = (),
    naming_points: Iterable[tuple | None] = (),
) -> dict[str, Any]:
    """The snapshot dict of the live ``entries`` and the history ``events`` since ``since_us`` (Unix microseconds).

    ``metadata`` is the tag of the stage now (the trace's closing marker event carries it); ``annotations`` are the
    ``(time_us, "START" | "END", name)`` of the ranges noted (those since ``since_us`` are kept); ``naming_points``
    the newest event at each point where the live storages were named (an allocation alive across one without a
    category gets :data:`UNNAMED_CATEGORY`).
    """
    events = list(events)
    unnamed = unnamed_at_naming(events, naming_points)
    segments = [_segment(entry, device_index, unnamed) for entry in sorted(entries, key=lambda e: e.addr)]
    trace = _trace(events, since_us, unnamed)
    if trace:
        trace.append(unknown_marker(time.time_ns() // 1000, metadata))
    device_traces: list[list[dict[str, Any]]] = [[] for _ in range(device_index + 1)]
    device_traces[device_index] = trace
    external = [
        {"name": name, "stage": stage, "time_us": time_us, "device": device_index}
        for time_us, stage, name in annotations
        if time_us >= since_us
    ]
    return {
        "segments": segments,
        "device_traces": device_traces,
        "allocator_settings": {},
        "external_annotations": external,
    }


def unknown_marker(time_us: int, metadata: str) -> dict[str, Any]:
    """A ``snapshot`` event of category ``unknown``, which every reader treats as a no-op.

    MemoryViz.js colours allocations by ``category`` and then appends "unknown" to its category list with a typo
    (``snapshot.categores``) that throws unless "unknown" is already listed: a trace with categories ends with this.
    """
    return {
        "action": "snapshot",
        "addr": 0,
        "size": 0,
        "stream": 0,
        "time_us": time_us,
        TAG_FIELD: metadata,
        CATEGORY_FIELD: UNKNOWN_CATEGORY,
        "frames": [],
    }


def unnamed_at_naming(events: list[tuple], naming_points: Iterable[tuple | None]) -> set[int]:
    """The ``id`` of every allocation in ``events`` without a category that was alive at a naming point (made before
    it, freed after it or never): one that the naming found to be none of the named kinds."""
    points = {id(point) for point in naming_points if point is not None}
    if not points:
        return set()
    namings = 0
    alive: dict[int, tuple[int, LiveAllocation]] = {}  # allocation -> (naming points passed when it was made, it)
    unnamed: set[int] = set()
    for event in events:
        kind = event[0]
        if kind == ALLOC:
            alive[id(event[2])] = (namings, event[2])
        elif kind == FREE and id(event[2]) in alive:
            passed, entry = alive.pop(id(event[2]))
            if namings > passed and entry.category is None:
                unnamed.add(id(entry))
        if id(event) in points:
            namings += 1
    unnamed.update(key for key, (passed, entry) in alive.items() if namings > passed and entry.category is None)
    return unnamed


def _category(entry: LiveAllocation, unnamed: set[int]) -> str:
    return entry.category or (UNNAMED_CATEGORY if id(entry) in unnamed else UNKNOWN_CATEGORY)


def _segment(entry: LiveAllocation, device_index: int, unnamed: set[int]) -> dict[str, Any]:
    block = {
        "address": entry.addr,
        "size": entry.nbytes,
        "requested_size": entry.nbytes,
        "state": "active_allocated",
        "frames": entry.frames or [],
        CATEGORY_FIELD: _category(entry, unnamed),
        TAG_FIELD: entry.metadata,
    }
    return {
        "device": device_index,
        "address": entry.addr,
        "total_size": entry.nbytes,
        "allocated_size": entry.nbytes,
        "active_size": entry.nbytes,
        "requested_size": entry.nbytes,
        "stream": 0,
        "segment_type": "large" if entry.nbytes > 1024**2 else "small",
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "frames": [],
        "blocks": [block],
    }


def _trace(events: Iterable[tuple], since_us: int, unnamed: set[int]) -> list[dict[str, Any]]:
    trace: list[dict[str, Any]] = []
    for event in events:
        if event[1] < since_us:
            continue
        kind = event[0]
        if kind == ALLOC:
            entry = event[2]
            category = _category(entry, unnamed)
            trace.append(_trace_entry("alloc", entry, event[1], entry.frames or [], entry.metadata, category))
        elif kind == FREE:
            entry = event[2]
            category = _category(entry, unnamed)
            trace.append(_trace_entry("free_requested", entry, event[1], [], event[3], category))
            trace.append(_trace_entry("free_completed", entry, event[1], [], event[3], category))
        else:
            trace.append(_oom_entry(event[2]))
    return trace


def _trace_entry(
    action: str, entry: LiveAllocation, time_us: int, frames: list, metadata: str, category: str
) -> dict[str, Any]:
    return {
        "action": action,
        "addr": entry.addr,
        "size": entry.nbytes,
        "stream": 0,
        "time_us": time_us,
        TAG_FIELD: metadata,
        CATEGORY_FIELD: category,
        "frames": frames,
    }


def _oom_entry(oom: OutOfMemoryEvent) -> dict[str, Any]:
    return {
        "action": "oom",
        "addr": 0,
        "size": oom.requested_bytes or 0,
        "stream": 0,
        "time_us": oom.time_us,
        "device_free": 0,
        TAG_FIELD: oom.metadata,
        "frames": oom.frames,
    }
