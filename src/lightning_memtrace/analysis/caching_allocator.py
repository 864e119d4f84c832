"""A model of torch's CUDA caching allocator: what a sequence of allocations and frees reserves, without a GPU.

``torch.cuda.memory_reserved()`` (what ``nvidia-smi`` shows, less the CUDA context) is not the bytes of live tensors:
the allocator rounds every request up to 512 B, carves requests of 1 MiB or less out of 2 MiB segments and those up to
10 MiB out of 20 MiB ones, cuts a free block for a smaller request only where more than 1 MiB would be left (so a
block can be up to 1 MiB larger than asked for, and ``memory_allocated()`` counts that too), never moves a block,
and asks CUDA for a new segment when no free block is large enough, even where enough is free in pieces. When CUDA
has no more to give, it frees every cached segment that holds nothing and tries again; only then is the run out of
memory. :class:`CachingAllocatorModel` follows those rules (torch's native allocator,
``c10/cuda/CUDACachingAllocator.cpp``): best fit among the free blocks of the pool and stream, lowest address among
equals; blocks merged with free neighbours when freed; ``max_split_size_mb``, ``roundup_power2_divisions`` and
``expandable_segments`` from ``PYTORCH_CUDA_ALLOC_CONF`` (see :class:`AllocatorSettings`). With expandable segments
a pool grows one segment per stream by 2 MiB (small) or 20 MiB (large) pages, and on running out unmaps the free
pages before failing.

Checked against real GPUs' snapshots (:func:`~lightning_memtrace.analysis.allocator_replay.replay_allocator`): served
the trace of a 2.7B-parameter model's training step, the model puts each of its 6,771 allocations at the address the
GPU's allocator gave it and asks for the same 783 new segments, and ends with the snapshot's segments block for block.

Not modelled: CUDA graphs' private pools, ``garbage_collection_threshold`` (it acts only under a memory fraction),
blocks kept for other streams' use (``record_stream``), and the driver's own choice of addresses (new segments take
increasing addresses here, which only breaks ties among equally sized free blocks).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from lightning_memtrace.analysis.allocator_blocks import Block, ExpandableSegment, Pool, expandable_size, segment_heads
from lightning_memtrace.analysis.allocator_settings import AllocatorSettings

#: ``kMinBlockSize``: every request is rounded up to a multiple of this.
MIN_BLOCK = 512
#: ``kSmallSize``: the largest (rounded) request served from the small pool.
SMALL_SIZE = 1 << 20
#: ``kSmallBuffer``: the segment a small request gets (and the page of a small expandable segment).
SMALL_BUFFER = 2 << 20
#: ``kLargeBuffer``: the segment a request up to :data:`MIN_LARGE_ALLOC` gets (and a large expandable page).
LARGE_BUFFER = 20 << 20
#: ``kMinLargeAlloc``: from this size on a request gets a segment of its own size, rounded to :data:`ROUND_LARGE`.
MIN_LARGE_ALLOC = 10 << 20
#: ``kRoundLarge``.
ROUND_LARGE = 2 << 20
#: The address space an expandable segment reserves where the device's memory is not known (it maps pages lazily).
_UNBOUNDED = 1 << 48


class SimulatedOutOfMemory(Exception):
    """The modelled allocator could not serve a request within its capacity, even after freeing its cache."""

    def __init__(self, requested: int, reserved: int, allocated: int, capacity: int) -> None:
        self.requested, self.reserved, self.allocated, self.capacity = requested, reserved, allocated, capacity
        super().__init__(
            f"out of memory: {requested:,} B requested with {allocated:,} B allocated and {reserved:,} B reserved "
            f"of {capacity:,} B"
        )


class CachingAllocatorModel:
    """torch's native CUDA caching allocator, replayed in Python over requests of known sizes.

    Args:
        settings: The allocator's settings (``PYTORCH_CUDA_ALLOC_CONF``).
        capacity: Bytes CUDA can give the allocator (the device's memory less the CUDA context and what else the
            process holds outside it); None: unlimited (nothing is ever given back).
        segment_address: Where CUDA puts a new segment of the given size (None: increasing addresses, 2 MiB apart).

    Attributes:
        allocated: Bytes of allocated blocks (``torch.cuda.memory_allocated()``: rounded, whole unsplit blocks).
        reserved: Bytes of segments (``torch.cuda.memory_reserved()``).
        peak_allocated, peak_reserved: Highest values since :meth:`reset_peak`; ``max_allocated`` /
            ``max_reserved`` since the model was made.
        segment_allocs, segment_frees, alloc_retries: cudaMalloc (or page-map) calls, cudaFree (or unmap) calls, and
            requests that had to free the cache first.
    """

    def __init__(
        self,
        settings: AllocatorSettings | None = None,
        capacity: int | None = None,
        segment_address: Callable[[int], int] | None = None,
    ) -> None:
        self.settings = settings or AllocatorSettings()
        self.capacity = capacity
        self._segment_address = segment_address or self._next_address
        self._address_end = 1 << 40
        self._pools = {True: Pool(small=True), False: Pool(small=False)}
        #: Segments from cudaMalloc by their first block's address (expandable ones are found from their blocks).
        self._segments: dict[int, Block] = {}
        self.allocated = self.reserved = 0
        self.peak_allocated = self.peak_reserved = 0
        self._max_allocated = self._max_reserved = 0
        self.segment_allocs = self.segment_frees = self.alloc_retries = 0

    # ------------------------------------------------------------------------------------------------ public
    def malloc(self, nbytes: int, stream: int = 0) -> Block:
        """Serve a request of ``nbytes`` on ``stream`` as the allocator would; raises :class:`SimulatedOutOfMemory`."""
        size = self.round_size(nbytes)
        pool = self._pools[size <= SMALL_SIZE]
        block = self._free_block(pool, size, stream)
        if block is None:
            block = self._new_block(pool, size, stream)
            if block is None and self._release_oversize(pool, size, stream):
                block = self._new_block(pool, size, stream)
            if block is None:
                self.alloc_retries += 1
                self.empty_cache()
                block = self._new_block(pool, size, stream)
            if block is None:
                assert self.capacity is not None
                raise SimulatedOutOfMemory(size, self.reserved, self.allocated, self.capacity)
        if self._should_split(block, size):
            block = self._split(pool, block, size)
        block.allocated = True
        block.requested = int(nbytes)
        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return block

    def free(self, block: Block) -> None:
        """Give ``block`` back to its pool, merged with free neighbours."""
        if not block.allocated:
            raise ValueError(f"{block!r} is not allocated")
        block.allocated = False
        self.allocated -= block.size
        block.requested = 0
        pool = self._pools[block.small]
        for neighbour in (block.prev, block.next):
            self._merge(pool, block, neighbour)
        pool.free.add(block)

    def adopt_segment(
        self, address: int, size: int, allocated: Sequence[tuple[int, int, int]], stream: int = 0, small: bool = False
    ) -> list[Block]:
        """Take in a segment that exists already (a snapshot's, from before its trace), holding ``allocated``
        ``(address, block size, requested bytes)`` blocks, free between them; returns those blocks, in order."""
        out: list[Block] = []
        pieces: list[Block] = []
        cursor = address
        for addr, block_size, requested in sorted(allocated):
            if addr < cursor or addr + block_size > address + size:
                raise ValueError(f"block {addr:#x} (+{block_size}) does not fit segment {address:#x} (+{size})")
            if addr > cursor:
                pieces.append(Block(cursor, addr - cursor, stream, small))
            block = Block(addr, block_size, stream, small)
            block.allocated, block.requested = True, int(requested)
            pieces.append(block)
            out.append(block)
            cursor = addr + block_size
        if cursor < address + size:
            pieces.append(Block(cursor, address + size - cursor, stream, small))
        for before, piece in zip(pieces, pieces[1:]):
            piece.splice(before, None)
        self._segments[address] = pieces[0]
        pool = self._pools[small]
        for piece in pieces:
            if not piece.allocated:
                pool.free.add(piece)
        self._reserve(size)
        self.allocated += sum(block.size for block in out)
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self._address_end = max(self._address_end, address + size + ROUND_LARGE)
        return out

    def empty_cache(self) -> None:
        """Give CUDA every cached segment that holds nothing (``torch.cuda.empty_cache()``, and what the allocator
        does before it fails); with expandable segments, unmap every free page."""
        for pool in self._pools.values():
            expandable = []
            for block in pool.free:
                if block.segment is not None:
                    expandable.append(block)
                elif not block.is_split:
                    self._release_segment(pool, block)
            for block in expandable:
                self._unmap(pool, block)

    def release_segment(self, address: int) -> bool:
        """Give CUDA the segment at ``address`` if it holds nothing (as the allocator does when it frees its cache);
        True if it did."""
        head = self._segments.get(address)
        if head is None or head.allocated or head.is_split:
            return False
        self._release_segment(self._pools[head.small], head)
        return True

    def cached_blocks(self) -> Iterator[Block]:
        """The blocks that hold nothing: free ones in the segments, and expandable segments' unmapped ranges."""
        for pool in self._pools.values():
            yield from pool.free
            yield from pool.unmapped_blocks.values()

    def reset_peak(self) -> None:
        """Start new peaks from the current values (``torch.cuda.reset_peak_memory_stats()``)."""
        self._max_allocated = self.max_allocated
        self._max_reserved = self.max_reserved
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    @property
    def max_allocated(self) -> int:
        return max(self._max_allocated, self.peak_allocated)

    @property
    def max_reserved(self) -> int:
        return max(self._max_reserved, self.peak_reserved)

    def round_size(self, nbytes: int) -> int:
        """The bytes a request of ``nbytes`` is served with (``round_size``)."""
        if nbytes < MIN_BLOCK:
            return MIN_BLOCK
        divisions = self.settings.roundup_power2_divisions
        if divisions > 1 and nbytes > MIN_BLOCK * divisions:
            return _roundup_power2_division(nbytes, divisions)
        return -(-nbytes // MIN_BLOCK) * MIN_BLOCK

    def segments(self) -> list[dict[str, Any]]:
        """The segments as ``torch.cuda.memory._snapshot()["segments"]`` lists them (by address), with their blocks
        (``active_allocated`` / ``inactive``); an expandable segment lists its mapped part."""
        heads = list(self._segments.values())
        for pool in self._pools.values():
            for block in segment_heads(pool):
                if block.segment is not None and block.prev is None:
                    heads.append(block)
        out = []
        for head in sorted(heads, key=lambda b: b.addr):
            blocks = []
            block: Block | None = head
            while block is not None:
                if block.mapped:
                    state = "active_allocated" if block.allocated else "inactive"
                    blocks.append(
                        {"address": block.addr, "size": block.size, "requested_size": block.requested, "state": state}
                    )
                block = block.next
            total = sum(b["size"] for b in blocks)
            if total == 0:
                continue
            out.append(
                {
                    "address": head.addr,
                    "total_size": total,
                    "allocated_size": sum(b["size"] for b in blocks if b["state"] == "active_allocated"),
                    "stream": head.stream,
                    "segment_type": "small" if head.small else "large",
                    "is_expandable": head.segment is not None,
                    "blocks": blocks,
                }
            )
        return out

    # ------------------------------------------------------------------------------------------------ finding
    def _free_block(self, pool: Pool, size: int, stream: int) -> Block | None:
        """Best fit among ``pool``'s free blocks on ``stream`` (``get_free_block``)."""
        free = pool.free
        index = free.at_least(stream, size)
        keys = free.keys
        if index >= len(keys) or keys[index][0] != stream:
            return None
        block = free.blocks[keys[index]]
        if block.segment is not None:
            if not self.settings.expandable_segments:
                return None  # expandable blocks left from when the setting was on: not modelled
            # An expandable block counts as large as it can grow (into the unmapped range after it).
            while block.segment is not None and index + 1 < len(keys) and keys[index + 1][0] == stream:
                following = free.blocks[keys[index + 1]]
                if expandable_size(following) >= expandable_size(block):
                    break
                index, block = index + 1, following
        max_split = self.settings.max_split_size
        if max_split is not None:
            if size < max_split and block.size >= max_split:
                return None  # an oversize block is not cut for a smaller request
            if size >= max_split and block.size >= size + LARGE_BUFFER:
                return None
        free.remove(block)
        return block

    def _should_split(self, block: Block, size: int) -> bool:
        remaining = block.size - size
        if block.small or self.settings.expandable_segments:
            return remaining >= MIN_BLOCK
        max_split = self.settings.max_split_size
        return (max_split is None or size < max_split) and remaining > SMALL_SIZE

    def _split(self, pool: Pool, block: Block, size: int) -> Block:
        """Cut ``size`` bytes off the front of free ``block``; the rest stays free after it."""
        front = Block(block.addr, size, block.stream, block.small, block.segment)
        if block.prev is None and block.segment is None:
            self._segments[front.addr] = front
        front.splice(block.prev, block)
        block.addr += size
        block.size -= size
        pool.free.add(block)
        return front

    def _merge(self, pool: Pool, block: Block, neighbour: Block | None) -> None:
        """Absorb free ``neighbour`` into ``block`` (``try_merge_blocks``)."""
        if neighbour is None or neighbour.allocated or neighbour.mapped != block.mapped:
            return
        if neighbour.mapped:
            pool.free.remove(neighbour)
        else:
            pool.remove_unmapped(neighbour)
        if neighbour is block.prev:
            block.addr = neighbour.addr
            block.prev = neighbour.prev
            if block.prev is not None:
                block.prev.next = block
            elif block.segment is None:
                self._segments[block.addr] = block
        else:
            block.next = neighbour.next
            if block.next is not None:
                block.next.prev = block
        block.size += neighbour.size

    # ------------------------------------------------------------------------------------------------ new memory
    def _new_block(self, pool: Pool, size: int, stream: int) -> Block | None:
        """A new segment for a request of ``size`` (``alloc_block``), or None where CUDA has no more to give."""
        if self.settings.expandable_segments:
            return self._expand(pool, size, stream)
        alloc_size = allocation_size(size)
        if self.capacity is not None and self.reserved + alloc_size > self.capacity:
            return None
        block = Block(self._segment_address(alloc_size), alloc_size, stream, pool.small)
        self._segments[block.addr] = block
        self._reserve(alloc_size)
        return block

    def _reserve(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.segment_allocs += 1
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved

    def _next_address(self, nbytes: int) -> int:
        addr = self._address_end
        self._address_end += -(-nbytes // ROUND_LARGE) * ROUND_LARGE + ROUND_LARGE
        return addr

    def _release_oversize(self, pool: Pool, size: int, stream: int) -> bool:
        """Free cached oversize segments, the smallest large enough or else the largest first, until ``size`` would
        fit (``release_available_cached_blocks``); only with ``max_split_size``."""
        max_split = self.settings.max_split_size
        if max_split is None:
            return False
        target = max(size, max_split)
        free = pool.free
        index = free.at_least(stream, target)
        if index < len(free.keys) and free.keys[index][0] == stream:
            block = free.blocks[free.keys[index]]
            if block.is_split or block.segment is not None:
                return False
            self._release_segment(pool, block)
            return True
        released = 0
        index -= 1
        while released < target and index >= 0:
            stream_of, block_size, _ = free.keys[index]
            if stream_of != stream or block_size < max_split:
                break
            block = free.blocks[free.keys[index]]
            index -= 1
            if block.is_split or block.segment is not None:
                continue
            released += block.size
            self._release_segment(pool, block)
        return released >= target

    def _release_segment(self, pool: Pool, block: Block) -> None:
        pool.free.remove(block)
        del self._segments[block.addr]
        self.reserved -= block.size
        self.segment_frees += 1

    # ------------------------------------------------------------------------------------------------ expandable
    def _expand(self, pool: Pool, size: int, stream: int) -> Block | None:
        """Map pages for ``size`` bytes at the lowest address of a segment of ``pool`` on ``stream`` that has room
        (``try_allocate_expandable_block``), or None where CUDA has no more to give."""
        candidate = self._expandable_room(pool, size, stream)
        if not candidate.mapped and not self._map(pool, candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            following = candidate.next
            assert following is not None
            if not self._map(pool, following, min(size - candidate.size, following.size)):
                return None
            candidate = following  # it absorbed the block before it
        pool.free.remove(candidate)
        return candidate

    def _expandable_room(self, pool: Pool, size: int, stream: int) -> Block:
        """The lowest block of free or unmapped address space that, with those after it, holds ``size`` bytes
        (``find_expandable_block``); a new segment's range where none does."""

        def usable(block: Block | None) -> bool:
            return block is not None and not block.allocated

        def has_room(block: Block | None) -> bool:
            total = 0
            while total < size and usable(block):
                assert block is not None
                total += block.size
                block = block.next
            return total >= size

        start = bisect.bisect_left(pool.unmapped, (stream, -1))
        for key in pool.unmapped[start:]:
            if key[0] != stream:
                break
            candidate = pool.unmapped_blocks[key]
            if usable(candidate.prev):
                candidate = candidate.prev  # type: ignore[assignment]
            if has_room(candidate):
                return candidate
        page = SMALL_BUFFER if pool.small else LARGE_BUFFER
        span = _UNBOUNDED if self.capacity is None else self.capacity + self.capacity // 8
        span = -(-span // page) * page
        segment = ExpandableSegment(self._segment_address(span), page)
        block = Block(segment.addr, span, stream, pool.small, segment)
        block.mapped = False
        pool.add_unmapped(block)
        return block

    def _map(self, pool: Pool, block: Block, size: int) -> bool:
        """Map the pages that cover the first ``size`` bytes of unmapped ``block`` (``map_block``)."""
        segment = block.segment
        assert segment is not None and not block.mapped
        page = segment.page_size
        mapped = min(-(-size // page) * page, block.size)
        if self.capacity is not None and self.reserved + mapped > self.capacity:
            return False
        pool.remove_unmapped(block)
        block.mapped = True
        if mapped < block.size:
            rest = Block(block.addr + mapped, block.size - mapped, block.stream, block.small, segment)
            rest.mapped = False
            rest.splice(block, block.next)
            block.size = mapped
            pool.add_unmapped(rest)
        self._merge(pool, block, block.prev)
        self._merge(pool, block, block.next)
        pool.free.add(block)
        self._reserve(mapped)
        return True

    def _unmap(self, pool: Pool, block: Block) -> None:
        """Unmap the whole pages inside free ``block`` of an expandable segment (``unmap_block``)."""
        segment = block.segment
        assert segment is not None
        page = segment.page_size
        offset = block.addr - segment.addr
        begin = -(-offset // page) * page
        end = (offset + block.size) // page * page
        if end <= begin:
            return
        pool.free.remove(block)
        before = begin - offset
        after = offset + block.size - end
        start_addr = segment.addr + begin
        if before:
            head = Block(block.addr, before, block.stream, block.small, segment)
            head.splice(block.prev, block)
            pool.free.add(head)
        if after:
            tail = Block(segment.addr + end, after, block.stream, block.small, segment)
            tail.splice(block, block.next)
            pool.free.add(tail)
        block.addr, block.size, block.mapped = start_addr, end - begin, False
        self.reserved -= block.size
        self.segment_frees += 1
        self._merge(pool, block, block.prev)
        self._merge(pool, block, block.next)
        pool.add_unmapped(block)


def allocation_size(size: int) -> int:
    """The segment a request of ``size`` (rounded) bytes gets where no free block serves it
    (``get_allocation_size``)."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


def _roundup_power2_division(size: int, divisions: int) -> int:
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> int(math.log2(divisions))
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step
