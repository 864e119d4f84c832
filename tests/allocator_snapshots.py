"""Snapshots as torch dumps them at an out-of-memory error, made by the caching allocator's model (tests of what
expandable segments would have changed, without a GPU)."""

from __future__ import annotations

from lightning_memtrace.analysis.caching_allocator import CachingAllocatorModel, SimulatedOutOfMemory

MIB = 1 << 20


def snapshot_of_an_oom(blocks: int, limit: int) -> dict:
    """A snapshot as torch dumps one at an out-of-memory error, made by the caching allocator's model under a limit
    of ``limit`` bytes: ``blocks`` blocks of 8 MiB (two to a 20 MiB segment), every other one freed, then a 12 MiB
    request that no free piece (8 or 4 MiB) holds."""
    trace: list[dict] = []
    where = [1 << 32]

    def segment_at(size: int) -> int:
        addr, where[0] = where[0], where[0] + size + 2 * MIB
        trace.append({"action": "segment_alloc", "addr": addr, "size": size, "stream": 0})
        return addr

    model = CachingAllocatorModel(capacity=limit, segment_address=segment_at)
    made = []
    for _ in range(blocks):
        block = model.malloc(8 * MIB)
        trace.append({"action": "alloc", "addr": block.addr, "size": 8 * MIB, "stream": 0})
        made.append((block, block.addr))
    for block, addr in made[::2]:
        model.free(block)
        trace += [{"action": action, "addr": addr, "size": 8 * MIB, "stream": 0}
                  for action in ("free_requested", "free_completed")]
    try:
        model.malloc(12 * MIB)
    except SimulatedOutOfMemory:
        pass
    else:
        raise AssertionError("the 12 MiB request was served: no out-of-memory error to snapshot")
    trace.append({"action": "oom", "device_free": limit - model.reserved, "size": 12 * MIB, "stream": 0})
    return {"segments": model.segments(), "device_traces": [trace], "allocator_settings": {}}
