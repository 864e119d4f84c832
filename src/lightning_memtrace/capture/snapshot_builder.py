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
from lightning_memtrace.schema import CATEGORY_FIELD, TAG_FIELD

#: The category of an allocation that is none of parameters, gradients, optimizer state, inputs or activations.
UNKNOWN_CATEGORY = "unknown"


def build_snapshot(
    entries: Iterable[LiveAllocation],
    events: Iterable[tuple],
    since_us: int,
    device_index: int,
    metadata: str,
    annotations: Iterable[tuple[int, str, str]] = (),
) -> dict[str, Any]:
    """The snapshot dict of the live ``entries`` and the history ``events`` since ``since_us`` (Unix microseconds).

    ``metadata`` is the tag of the stage now (the trace's closing marker event carries it); ``annotations`` are the
    ``(time_us, "START" | "END", name)`` of the ranges noted (those since ``since_us`` are kept).
    """
    segments = [_segment(entry, device_index) for entry in sorted(entries, key=lambda e: e.addr)]
    trace = _trace(events, since_us)
    if trace:
        # MemoryViz.js colours allocations by `category` and then appends "unknown" to its category list with a
        # typo (`snapshot.categores`) that throws unless "unknown" is already listed: make sure it is, with a
        # `snapshot` marker event, which every reader treats as a no-op.
        trace.append(
            {
                "action": "snapshot",
                "addr": 0,
                "size": 0,
                "stream": 0,
                "time_us": time.time_ns() // 1000,
                TAG_FIELD: metadata,
                CATEGORY_FIELD: UNKNOWN_CATEGORY,
                "frames": [],
            }
        )
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


def _segment(entry: LiveAllocation, device_index: int) -> dict[str, Any]:
    block = {
        "address": entry.addr,
        "size": entry.nbytes,
        "requested_size": entry.nbytes,
        "state": "active_allocated",
        "frames": entry.frames or [],
        CATEGORY_FIELD: entry.category or UNKNOWN_CATEGORY,
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


def _trace(events: Iterable[tuple], since_us: int) -> list[dict[str, Any]]:
    trace: list[dict[str, Any]] = []
    for event in events:
        if event[1] < since_us:
            continue
        kind = event[0]
        if kind == ALLOC:
            entry = event[2]
            trace.append(_trace_entry("alloc", entry, event[1], entry.frames or [], entry.metadata))
        elif kind == FREE:
            entry = event[2]
            trace.append(_trace_entry("free_requested", entry, event[1], [], event[3]))
            trace.append(_trace_entry("free_completed", entry, event[1], [], event[3]))
        else:
            trace.append(_oom_entry(event[2]))
    return trace


def _trace_entry(action: str, entry: LiveAllocation, time_us: int, frames: list, metadata: str) -> dict[str, Any]:
    return {
        "action": action,
        "addr": entry.addr,
        "size": entry.nbytes,
        "stream": 0,
        "time_us": time_us,
        TAG_FIELD: metadata,
        CATEGORY_FIELD: entry.category or UNKNOWN_CATEGORY,
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
