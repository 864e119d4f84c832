"""The CUDA caching allocator's model: torch's rules one by one (real GPUs' traces: test_allocator_replay.py)."""

from __future__ import annotations

import random

import pytest

from lightning_memtrace.analysis.allocator_settings import AllocatorSettings
from lightning_memtrace.analysis.caching_allocator import CachingAllocatorModel, SimulatedOutOfMemory, allocation_size

MIB = 1 << 20


def test_requests_are_rounded_to_512_bytes_and_pooled_by_size():
    model = CachingAllocatorModel()
    assert [model.round_size(n) for n in (1, 511, 512, 513, 4_000_000)] == [512, 512, 512, 1024, 4_000_256]
    # up to 1 MiB: a 2 MiB segment; up to 10 MiB: a 20 MiB one; larger: its own size in 2 MiB steps
    assert [allocation_size(n) for n in (512, MIB, MIB + 512, 10 * MIB - 512, 10 * MIB, 10 * MIB + 512)] == [
        2 * MIB, 2 * MIB, 20 * MIB, 20 * MIB, 10 * MIB, 12 * MIB,
    ]
    blocks = [model.malloc(512 * 1024) for _ in range(5)]  # four fill one small segment, the fifth opens another
    assert (model.allocated, model.reserved, model.segment_allocs) == (5 * 512 * 1024, 4 * MIB, 2)
    assert [b.addr - blocks[0].addr for b in blocks[:4]] == [0, 512 * 1024, MIB, 1536 * 1024]


def test_power_of_two_divisions_round_as_torch_does():
    model = CachingAllocatorModel(AllocatorSettings(roundup_power2_divisions=4))
    # 1,200,000 B lies between 1 MiB and 2 MiB; four divisions of that range: 1.25 MiB is the next
    assert model.round_size(1_200_000) == 1_310_720
    assert model.round_size(2 * MIB) == 2 * MIB
    assert model.round_size(1000) == 1024  # at most 512 x 4: plain 512-byte rounding


def test_a_block_is_cut_only_where_more_than_1_mib_would_be_left():
    model = CachingAllocatorModel()
    whole = model.malloc(19 * MIB + 512 * 1024)  # a 20 MiB segment; 0.5 MiB left: not cut, the block is 20 MiB
    assert (whole.size, model.allocated, model.reserved) == (20 * MIB, 20 * MIB, 20 * MIB)
    start = whole.addr
    model.free(whole)
    cut = model.malloc(18 * MIB)  # the cached 20 MiB block, 2 MiB left: cut
    assert (cut.addr, cut.size, model.allocated, model.reserved) == (start, 18 * MIB, 18 * MIB, 20 * MIB)


def test_best_fit_takes_the_smallest_free_block_large_enough():
    model = CachingAllocatorModel()
    a, b = model.malloc(30 * MIB), model.malloc(24 * MIB)
    a_addr, b_addr = a.addr, b.addr  # a freed block object is merged and cut again: keep the addresses
    model.free(a)
    model.free(b)
    assert model.malloc(22 * MIB).addr == b_addr
    assert model.malloc(26 * MIB).addr == a_addr
    assert model.segment_allocs == 2


def test_free_space_in_pieces_does_not_serve_a_larger_request_fragmentation():
    model = CachingAllocatorModel()
    first, second = model.malloc(8 * MIB), model.malloc(8 * MIB)  # one 20 MiB segment: 8 + 8, 4 MiB free at its end
    start = first.addr
    assert second.addr == start + 8 * MIB and model.reserved == 20 * MIB
    model.free(first)  # 12 MiB free in the segment, in two pieces (8 and 4)
    third = model.malloc(10 * MIB)
    assert model.reserved == 30 * MIB and third.addr not in range(start, start + 20 * MIB)
    model.free(second)  # the segment's pieces merge into one free 20 MiB block
    assert model.malloc(20 * MIB).addr == start
    assert model.reserved == 30 * MIB


def test_when_cuda_has_no_more_the_cache_is_freed_before_running_out():
    model = CachingAllocatorModel(capacity=30 * MIB)
    model.free(model.malloc(16 * MIB))
    held = model.malloc(24 * MIB)  # 16 MiB cached + 24 MiB > 30 MiB: the cached segment is given back first
    held_addr = held.addr
    assert (model.reserved, model.alloc_retries, model.segment_frees) == (24 * MIB, 1, 1)
    with pytest.raises(SimulatedOutOfMemory) as raised:
        model.malloc(10 * MIB)
    assert (raised.value.requested, raised.value.reserved, raised.value.allocated) == (10 * MIB, 24 * MIB, 24 * MIB)
    model.free(held)
    assert model.malloc(10 * MIB).addr == held_addr  # cut from the cached block, nothing new reserved
    assert model.reserved == 24 * MIB


def test_max_split_size_keeps_oversize_blocks_whole():
    model = CachingAllocatorModel(AllocatorSettings(max_split_size=20 * MIB))
    big = model.malloc(40 * MIB)
    big_addr = big.addr
    model.free(big)
    small = model.malloc(12 * MIB)  # not cut out of the oversize block: a segment of its own
    assert small.addr != big_addr and model.reserved == 52 * MIB
    again = model.malloc(30 * MIB)  # within 20 MiB of the oversize block's size: served whole
    assert (again.addr, again.size) == (big_addr, 40 * MIB)


def test_expandable_segments_grow_one_segment_by_20_mib_pages():
    model = CachingAllocatorModel(AllocatorSettings(expandable_segments=True))
    first, second = model.malloc(8 * MIB), model.malloc(8 * MIB)
    start = first.addr
    assert model.reserved == 20 * MIB and second.addr == start + 8 * MIB
    third = model.malloc(8 * MIB)  # 4 MiB free at the end: one more page mapped after it, the block spans both
    assert model.reserved == 40 * MIB and third.addr == start + 16 * MIB
    big = model.malloc(30 * MIB)  # 16 MiB free at the end: one more page, 36 MiB mapped after the third block
    assert big.addr == start + 24 * MIB and model.reserved == 60 * MIB
    for block in (first, second, third, big):
        model.free(block)
    model.empty_cache()  # every free page unmapped
    assert (model.reserved, model.allocated) == (0, 0)
    assert model.malloc(MIB).addr != start  # the small pool has a segment of its own
    assert model.reserved == 2 * MIB


def test_settings_from_the_environment_text_and_a_snapshot():
    parsed = AllocatorSettings.parse(
        "expandable_segments:True,max_split_size_mb:128,roundup_power2_divisions:[256:1,>:4],"
        "garbage_collection_threshold:0.6"
    )
    assert parsed == AllocatorSettings(expandable_segments=True, max_split_size=128 * MIB, roundup_power2_divisions=0)
    assert parsed.describe() == "expandable segments, max_split_size_mb:128"
    assert AllocatorSettings.from_environment({"PYTORCH_ALLOC_CONF": "roundup_power2_divisions:8"}) == (
        AllocatorSettings(roundup_power2_divisions=8)
    )
    assert AllocatorSettings.from_environment({}) == AllocatorSettings()
    stream_ordered = AllocatorSettings.parse("backend:cudaMallocAsync")
    assert stream_ordered.backend == "cudaMallocAsync"
    assert stream_ordered.describe() == (
        "backend:cudaMallocAsync, not modelled: served with the native allocator's rules"
    )
    assert AllocatorSettings().describe() == "defaults"
    recorded = {"allocator_settings": {"expandable_segments": True, "max_split_size": -1}}
    assert AllocatorSettings.from_snapshot(recorded) == AllocatorSettings(expandable_segments=True)


def _check_invariants(model: CachingAllocatorModel) -> None:
    """Segments tile into blocks, counters add up, the free pools hold exactly the free blocks, and (in cudaMalloc'd
    segments) no two free blocks lie side by side: what every rule above keeps."""
    segments = model.segments()
    assert sum(s["total_size"] for s in segments) == model.reserved
    blocks = [(s, b) for s in segments for b in s["blocks"]]
    assert sum(b["size"] for _, b in blocks if b["state"] == "active_allocated") == model.allocated
    pooled = sorted(key[1] for pool in model._pools.values() for key in pool.free.keys)
    assert pooled == sorted(b["size"] for _, b in blocks if b["state"] == "inactive")
    for segment in segments:
        if segment["is_expandable"]:
            continue
        end, free_before = segment["address"], False
        for block in segment["blocks"]:
            assert block["address"] == end and block["size"] % 512 == 0
            free = block["state"] == "inactive"
            assert not (free and free_before)
            end, free_before = block["address"] + block["size"], free
        assert end == segment["address"] + segment["total_size"]


@pytest.mark.parametrize("capacity", [None, 512 * MIB])
@pytest.mark.parametrize(
    "settings",
    [
        AllocatorSettings(),
        AllocatorSettings(max_split_size=32 * MIB),
        AllocatorSettings(expandable_segments=True),
        AllocatorSettings(roundup_power2_divisions=4),
    ],
    ids=lambda s: s.describe(),
)
def test_random_requests_and_frees_keep_the_allocators_invariants(settings, capacity):
    rng = random.Random(7)
    model = CachingAllocatorModel(settings, capacity=capacity)
    live, refused = [], 0
    for step in range(2000):
        draw = rng.random()
        if draw < 0.55 or not live:
            low, high = rng.choice([(1, 4096), (1, MIB), (MIB, 12 * MIB), (10 * MIB, 64 * MIB)])
            try:
                live.append(model.malloc(rng.randint(low, high)))
            except SimulatedOutOfMemory:
                refused += 1
        elif draw < 0.98:
            model.free(live.pop(rng.randrange(len(live))))
        else:
            model.empty_cache()
        if step % 40 == 0:
            _check_invariants(model)
    _check_invariants(model)
    if capacity is None:
        assert refused == 0
    else:
        assert refused > 0 and model.max_reserved <= capacity  # it ran out, and never reserved past its limit
