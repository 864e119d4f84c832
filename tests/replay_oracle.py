"""An independent replay of a torch CUDA memory snapshot: plain Python, one event at a time, written from torch's
snapshot format (``torch.cuda.memory._snapshot()``, read by ``torch/cuda/_memory_viz.py`` and ``MemoryViz.js``)
without any of ``lightning_memtrace.analysis``. The tests compare MemTrace's replay with it.

Format (torch): ``{"segments": [...], "device_traces": [[event, ...] per device], ...}``, or the old bare list of
segments (no trace). An event is ``{"action", "addr", "size", "time_us"?, "frames", ...}``; the actions are ``alloc``,
``free_requested`` (the tensor was released), ``free_completed`` (the allocator took the block back, after the streams
that used it finished), the legacy ``free``, ``segment_alloc``/``segment_free``/``segment_map``/``segment_unmap``
(cudaMalloc'd memory: reserved, not live), ``snapshot`` and ``oom`` (no change of live memory). A segment is
``{"device", "address", "total_size", "blocks": [{"address", "size", "requested_size", "state", ...}]}`` at dump time.

Conventions (those MemTrace's replay states in its docstrings; where torch's viewer differs, it says so):

1. An allocation is live from its ``alloc`` event until the event that ends it: ``free_completed`` when the device's
   trace holds any ``free_completed`` (the block is only reusable then: this is what MemoryViz.js draws), else
   ``free_requested`` (a trace recorded without completion events); a legacy ``free`` always ends one.
   (MemoryViz.js never ends an allocation at a lone ``free_requested``.) An ``alloc`` at an address whose
   allocation is still live (a malformed trace) ends that one; MemoryViz.js would keep both.
2. Sizes: ``alloc`` counts its ``size`` (the requested bytes, not the rounded block); the end of an allocation
   removes what its ``alloc`` added.
3. Before the first event (the "seed"), live memory holds
   a. every block whose first event is an ending free (the free of a block allocated before recording began),
      with the free's ``size``; a free of an address whose previous event is already a free adds nothing;
   b. every block of this device's dump-time ``segments`` whose ``state`` is active (``active_allocated``, or
      ``active_pending_free``: freed but not yet completed, still live by rule 1) and whose address no ``alloc`` or
      ending free of the trace mentions, with its ``requested_size`` (its ``size`` when that is missing or 0).
      (MemoryViz.js seeds ``active_allocated`` blocks whose address is not live at the end of the trace; on a
      trace consistent with its dump, the two rules pick the same blocks.)
4. Live bytes after event ``i`` = seed + what events ``0..i`` added and removed.
5. The peak is the highest live-bytes point, the state before the first event included (index ``-1``). Among the
   events the first maximum counts; the state before the first event counts only when it holds strictly more than
   every event: on a tie an event wins, even a later one (MemTrace's choice, stated in ``questions.highest``; torch's
   viewer leaves that state out of its maximum altogether). So a torch trace that begins with the
   ``free_requested`` of a block older than the trace peaks at event 0, which removes nothing.
6. A device is replayed when its trace has events or a segment lives on it (device 0 when there is neither).
7. Categories (snapshots MemTrace wrote): an allocation's category is the ``category`` field of its ``alloc``
   event; for a block freed before its allocation was seen, that of the freeing event; for a seeded block, that of
   the block. MemoryViz.js colours allocations by the same field.
"""

from __future__ import annotations

import dataclasses
from typing import Any

STARTS = "alloc"
ACTIVE_STATES = ("active_allocated", "active_pending_free")
NO_CATEGORY = ""


@dataclasses.dataclass
class Allocation:
    size: int
    start: int  # event index, -1: before the first event
    end: int | None = None  # event index of its end, None: alive at the end
    category: str = NO_CATEGORY
    has_stack: bool = True  # False: made before the trace and no frames tell where


@dataclasses.dataclass
class OracleDevice:
    device: int
    seed_bytes: int
    live: list[int]  # live bytes after each event
    allocations: list[Allocation]

    @property
    def peak(self) -> tuple[int, int]:
        """(peak bytes, peak index); index -1: before the first event."""
        best, index = None, -1
        for i, value in enumerate(self.live):
            if best is None or value > best:
                best, index = value, i
        if best is None or self.seed_bytes > best:
            return self.seed_bytes, -1
        return best, index

    def live_at(self, index: int) -> list[Allocation]:
        """The allocations live just after event ``index`` (-1: before the first event)."""
        return [a for a in self.allocations if a.start <= index and (a.end is None or a.end > index)]

    def categories_at(self, index: int) -> dict[str, int]:
        out: dict[str, int] = {}
        for a in self.live_at(index):
            out[a.category] = out.get(a.category, 0) + a.size
        return out


def _parts(snapshot: Any) -> tuple[list[dict], list[list[dict]]]:
    if isinstance(snapshot, list):  # torch.cuda.memory_snapshot(): segments only
        return snapshot, []
    return list(snapshot.get("segments") or []), list(snapshot.get("device_traces") or [])


def devices(snapshot: Any) -> list[int]:
    segments, traces = _parts(snapshot)
    found = {d for d, trace in enumerate(traces) if trace}
    found |= {int(s["device"]) for s in segments if "device" in s}
    return sorted(found) or [0]


def replay_device(snapshot: Any, device: int) -> OracleDevice:
    segments, traces = _parts(snapshot)
    trace = traces[device] if device < len(traces) else []
    end_action = "free_completed" if any(e["action"] == "free_completed" for e in trace) else "free_requested"

    def ends(event: dict) -> bool:
        return event["action"] in (end_action, "free")

    allocations: list[Allocation] = []
    open_at: dict[int, Allocation] = {}  # address -> its live allocation made in the trace
    seen: set[int] = set()  # addresses an alloc or an ending free mentioned so far
    pre_trace: list[Allocation] = []
    deltas: list[int] = []
    for i, event in enumerate(trace):
        action, addr = event["action"], event.get("addr")
        delta = 0
        if action == STARTS:
            if addr in open_at:  # a second alloc without a free between: the first one ends here
                old = open_at.pop(addr)
                old.end = i
                delta -= old.size
            a = Allocation(int(event["size"]), i, None, event.get("category", NO_CATEGORY))
            allocations.append(a)
            open_at[addr] = a
            delta += a.size
            seen.add(addr)
        elif ends(event):
            if addr in open_at:
                a = open_at.pop(addr)
                a.end = i
                delta -= a.size
            elif addr not in seen:  # allocated before recording began
                a = Allocation(int(event["size"]), -1, i, event.get("category", NO_CATEGORY), has_stack=False)
                pre_trace.append(a)
                delta -= a.size
            seen.add(addr)
        deltas.append(delta)

    seeded = []
    for seg in segments:
        if seg.get("device", device) != device:
            continue
        for block in seg.get("blocks") or []:
            if block.get("state") not in ACTIVE_STATES or block.get("address") in seen:
                continue
            size = block.get("requested_size") or block.get("size") or 0
            category = block.get("category", NO_CATEGORY)
            seeded.append(Allocation(int(size), -1, None, category, has_stack=bool(block.get("frames"))))

    seed_bytes = sum(a.size for a in pre_trace) + sum(a.size for a in seeded)
    live, running = [], seed_bytes
    for delta in deltas:
        running += delta
        live.append(running)
    return OracleDevice(device, seed_bytes, live, allocations + pre_trace + seeded)


def replay(snapshot: Any) -> dict[int, OracleDevice]:
    return {d: replay_device(snapshot, d) for d in devices(snapshot)}
