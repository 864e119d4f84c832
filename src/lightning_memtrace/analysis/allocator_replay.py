"""A snapshot's trace driven through the caching allocator's model: the same blocks at the same addresses.

The model (:mod:`~lightning_memtrace.analysis.caching_allocator`) is what the estimate's ``reserved_bytes`` come
from; a real snapshot's trace is where it can be checked against the GPU's own allocator. :func:`replay_allocator`
starts the model from the segments that existed when the trace began (the snapshot's segments less those the trace
makes; in them, the blocks alive at the dump that the trace never touches, and those whose first event is a free),
gives each new segment the address the trace says CUDA gave it, and then serves every ``alloc`` and
``free_completed`` of the trace, counting the allocations the model put at another address than the GPU did.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_memtrace.analysis.allocator_blocks import Block
from lightning_memtrace.analysis.allocator_settings import AllocatorSettings
from lightning_memtrace.analysis.caching_allocator import (
    MIN_BLOCK,
    SMALL_SIZE,
    CachingAllocatorModel,
    SimulatedOutOfMemory,
)

#: Traces longer than this are not served again for a what-if (about 3 microseconds an event, each time served).
MAX_EVENTS = 200_000


@dataclasses.dataclass
class AllocatorReplay:
    """How the model served a snapshot's trace.

    Attributes:
        model: The model after the trace (its ``segments()`` compare with the snapshot's).
        allocations: ``alloc`` events served.
        misplaced: Allocations the model put at another address than the trace's.
        new_segments: Segments the model asked CUDA for during the trace (the trace's ``segment_alloc`` events, where
            the model matches).
        oom: At the trace's first out-of-memory error: the most the allocator could have reserved then (what it
            reserved, and what CUDA said was free) and the request that failed; None where there is none. The
            replay stops there.
    """

    model: CachingAllocatorModel
    allocations: int = 0
    misplaced: int = 0
    new_segments: int = 0
    oom: tuple[int, int] | None = None


def replay_allocator(snapshot: Mapping[str, Any], device: int = 0, strict: bool = False) -> AllocatorReplay:
    """Serve ``snapshot``'s trace of ``device`` with the model, under the settings the snapshot recorded.

    Raises:
        ValueError: the trace frees or allocates in a way no allocator state explains (a block the model does not
            hold is freed, or a new segment's size differs from the trace's), the snapshot has no trace, or
            (``strict``) the model puts a block at another address than the trace's.
    """
    trace, segments, made_at = _trace_of(snapshot, device)
    made = [(int(e["addr"]), int(e["size"])) for e in trace if e.get("action") == "segment_alloc"]
    pending: deque[tuple[int, int]] = deque(made)

    def address_of(size: int) -> int:
        if not pending:
            raise ValueError(f"the model made a segment of {size:,} B that the trace does not")
        addr, real = pending.popleft()
        if real != size:
            raise ValueError(f"the model made a segment of {size:,} B where the trace made one of {real:,} B")
        return addr

    model = CachingAllocatorModel(AllocatorSettings.from_snapshot(snapshot), segment_address=address_of)
    live = _seed(model, segments, trace, made_at)
    replay = AllocatorReplay(model)
    before = model.segment_allocs
    for event in trace:
        action = event.get("action")
        if action == "alloc":
            block = model.malloc(int(event["size"]), int(event.get("stream", 0) or 0))
            replay.allocations += 1
            addr = int(event["addr"])
            if block.addr != addr:
                if strict:
                    raise ValueError(f"the model put a block at {block.addr:#x} where the trace has {addr:#x}")
                replay.misplaced += 1
            live[addr] = block
        elif action == "free_completed":
            _free_traced(model, live, event)
        elif action == "segment_free" and not model.release_segment(int(event["addr"])):
            raise ValueError(f"the trace gives back segment {int(event['addr']):#x}, which the model holds in use")
        elif action == "oom":
            replay.oom = (model.reserved + int(event.get("device_free", 0) or 0), int(event["size"]))
            break
    replay.new_segments = model.segment_allocs - before
    return replay


def _free_traced(model: CachingAllocatorModel, live: dict[int, Block], event: Mapping[str, Any]) -> None:
    """Serve a trace's ``free_completed``: the block the model holds at its address goes back to the model."""
    held = live.pop(int(event["addr"]), None)
    if held is None:
        raise ValueError(f"the trace frees {int(event['addr']):#x}, which the model does not hold")
    model.free(held)


def _trace_of(
    snapshot: Mapping[str, Any], device: int
) -> tuple[Sequence[Mapping[str, Any]], list[Mapping[str, Any]], set[int]]:
    """``device``'s trace, its segments at the dump, and the addresses of the segments the trace makes."""
    traces = snapshot.get("device_traces") or []
    if device >= len(traces) or not traces[device]:
        raise ValueError(f"the snapshot has no trace for device {device}")
    trace: Sequence[Mapping[str, Any]] = traces[device]
    segments = [s for s in snapshot.get("segments", []) if int(s.get("device", device)) == device]
    return trace, segments, {int(e["addr"]) for e in trace if e.get("action") == "segment_alloc"}


def _seed(
    model: CachingAllocatorModel,
    segments: Sequence[Mapping[str, Any]],
    trace: Sequence[Mapping[str, Any]],
    made: set[int],
) -> dict[int, Block]:
    """Put the segments that existed when the trace began into ``model``; returns their allocated blocks by address."""
    live: dict[int, Block] = {}
    for segment, small, held in _starting_segments(model, segments, trace, made):
        start, total = int(segment["address"]), int(segment["total_size"])
        stream = int(segment.get("stream", 0) or 0)
        live.update((block.addr, block) for block in model.adopt_segment(start, total, held, stream, small))
    return live


def _starting_segments(
    model: CachingAllocatorModel,
    segments: Sequence[Mapping[str, Any]],
    trace: Sequence[Mapping[str, Any]],
    made: set[int],
) -> list[tuple[Mapping[str, Any], bool, list[tuple[int, int, int]]]]:
    """The segments that existed when the trace began, each with whether it is a small one and the ``(address, block
    size, requested)`` blocks it held then: those alive at the dump that the trace never touches, and those whose
    first event is a free."""
    first: dict[int, Mapping[str, Any]] = {}
    for event in trace:
        if event.get("action") in ("alloc", "free_completed"):
            first.setdefault(int(event["addr"]), event)
    out = []
    for segment in sorted(segments, key=lambda s: int(s["address"])):
        start, total = int(segment["address"]), int(segment["total_size"])
        if start in made:
            continue
        small = segment.get("segment_type") == "small"
        held = [
            (int(b["address"]), int(b["size"]), int(b.get("requested_size", b["size"])))
            for b in segment.get("blocks", [])
            if str(b.get("state", "")).startswith("active") and int(b["address"]) not in first
        ]
        held += [
            (addr, model.round_size(int(event["size"])), int(event["size"]))
            for addr, event in first.items()
            if event.get("action") == "free_completed" and start <= addr < start + total
        ]
        out.append((segment, small, _whole_blocks(sorted(held), start + total, small)))
    return out


def _whole_blocks(held: list[tuple[int, int, int]], end: int, small: bool) -> list[tuple[int, int, int]]:
    """Blocks freed before the trace shows their size: widened over a gap after them too small to be a free block
    (the allocator does not cut a block where 1 MiB or less would be left in the large pool, 512 B in the small)."""
    out = []
    for index, (addr, size, requested) in enumerate(held):
        following = held[index + 1][0] if index + 1 < len(held) else end
        gap = following - (addr + size)
        if 0 < gap and (gap < MIN_BLOCK if small else gap <= SMALL_SIZE):
            size += gap
        out.append((addr, size, requested))
    return out


@dataclasses.dataclass(frozen=True)
class ExpandableWhatIf:
    """What a snapshot's trace would have reserved with ``expandable_segments:True``.

    Attributes:
        reserved_bytes: The most the allocator reserved over the trace as it ran (the model serving it again).
        expandable_reserved_bytes: The most it would reserve with expandable segments.
        oom_requested_bytes: The request the trace's first out-of-memory error failed on (None: it has none).
        oom_served: Whether, with expandable segments and the memory the GPU had then (what was reserved and what
            CUDA said was free), every request up to that one and that one would have been served (None: no error).
    """

    reserved_bytes: int
    expandable_reserved_bytes: int
    oom_requested_bytes: int | None = None
    oom_served: bool | None = None


def reserved_with(
    snapshot: Mapping[str, Any], settings: AllocatorSettings, device: int = 0, capacity: int | None = None
) -> tuple[int, bool]:
    """Serve ``snapshot``'s trace of ``device`` under ``settings``: the blocks alive when the trace began asked for
    first (in the order of their addresses), then every allocation and free, up to the trace's first out-of-memory
    error and its request. Returns the most reserved and whether every request was served (with ``capacity``, the
    most the allocator may reserve; unlimited: always).

    Raises:
        ValueError: the trace frees a block the model does not hold, or there is no trace.
    """
    trace, segments, made = _trace_of(snapshot, device)
    model = CachingAllocatorModel(settings, capacity=capacity)
    live: dict[int, Block] = {}
    try:
        for _, _, held in _starting_segments(model, segments, trace, made):
            for addr, _, requested in held:
                live[addr] = model.malloc(requested)
        for event in trace:
            action = event.get("action")
            if action == "alloc":
                live[int(event["addr"])] = model.malloc(int(event["size"]), int(event.get("stream", 0) or 0))
            elif action == "free_completed":
                _free_traced(model, live, event)
            elif action == "oom":
                model.malloc(int(event["size"]), int(event.get("stream", 0) or 0))
                break
    except SimulatedOutOfMemory:
        return model.max_reserved, False
    return model.max_reserved, True


def expandable_segments_what_if(snapshot: Mapping[str, Any], device: int = 0) -> ExpandableWhatIf | None:
    """What ``snapshot``'s trace would have reserved with ``expandable_segments:True``, and whether its out-of-memory
    error would have happened. None where the trace is longer than :data:`MAX_EVENTS`, the snapshot ran with
    expandable segments already, or the model cannot serve its trace as the GPU did (the snapshot is untrusted: any
    failure is None)."""
    try:
        found = _served_as_recorded(snapshot, device)
        if found is None:
            return None
        recorded, settings = found
        expandable, _ = reserved_with(snapshot, settings, device)
        if recorded.oom is None:
            return ExpandableWhatIf(recorded.model.max_reserved, expandable)
        capacity, requested = recorded.oom
        _, served = reserved_with(snapshot, settings, device, capacity=capacity)
        return ExpandableWhatIf(recorded.model.max_reserved, expandable, requested, served)
    except Exception:  # noqa: BLE001 - an untrusted file's trace: no figure rather than a failed summary
        return None


def expandable_segments_serve_the_oom(snapshot: Mapping[str, Any], device: int = 0) -> bool | None:
    """:attr:`ExpandableWhatIf.oom_served` alone (what a post-mortem asks, without serving the trace unlimited): None
    where :func:`expandable_segments_what_if` is, or the trace holds no out-of-memory error."""
    try:
        found = _served_as_recorded(snapshot, device)
        if found is None or found[0].oom is None:
            return None
        recorded, settings = found
        capacity, _ = recorded.oom
        return reserved_with(snapshot, settings, device, capacity=capacity)[1]
    except Exception:  # noqa: BLE001 - an untrusted file's trace: no answer rather than a failed post-mortem
        return None


def _served_as_recorded(snapshot: Mapping[str, Any], device: int) -> tuple[AllocatorReplay, AllocatorSettings] | None:
    """The trace served with the snapshot's own settings, and those settings with expandable segments on; None where
    the trace is too long or empty, or expandable segments were on already."""
    traces = snapshot.get("device_traces") or []
    if device >= len(traces) or not traces[device] or len(traces[device]) > MAX_EVENTS:
        return None
    recorded_settings = AllocatorSettings.from_snapshot(snapshot)
    if recorded_settings.expandable_segments:
        return None
    recorded = replay_allocator(snapshot, device, strict=True)
    return recorded, dataclasses.replace(recorded_settings, expandable_segments=True)
