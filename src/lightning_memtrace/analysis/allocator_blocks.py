"""The caching allocator's model's pieces: blocks of segments, and a pool's free blocks in torch's order."""

from __future__ import annotations

import bisect
from collections.abc import Iterator


class Block:
    """A piece of a segment: allocated, free (cached), or (expandable segments) address space with no pages."""

    __slots__ = ("addr", "size", "requested", "allocated", "stream", "small", "prev", "next", "segment", "mapped")

    def __init__(self, addr: int, size: int, stream: int, small: bool, segment: ExpandableSegment | None = None):
        self.addr = addr
        self.size = size
        self.requested = 0
        self.allocated = False
        self.stream = stream
        self.small = small
        self.prev: Block | None = None
        self.next: Block | None = None
        #: The expandable segment the block is part of (None: a segment of its own, from cudaMalloc).
        self.segment = segment
        self.mapped = True

    @property
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def splice(self, before: Block | None, after: Block | None) -> None:
        """Link this block in between ``before`` and ``after`` (neighbours until now)."""
        self.prev, self.next = before, after
        if before is not None:
            before.next = self
        if after is not None:
            after.prev = self

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else ("free" if self.mapped else "unmapped")
        return f"Block({self.addr:#x}, {self.size}, {state})"


class ExpandableSegment:
    """An expandable segment's address range, from ``addr``: pages of ``page_size`` mapped on demand."""

    __slots__ = ("addr", "page_size")

    def __init__(self, addr: int, page_size: int) -> None:
        self.addr, self.page_size = addr, page_size


class FreeBlocks:
    """A pool's free blocks in torch's order: by stream, then size, then address (``BlockComparatorSize``)."""

    def __init__(self) -> None:
        self.keys: list[tuple[int, int, int]] = []
        self.blocks: dict[tuple[int, int, int], Block] = {}

    def add(self, block: Block) -> None:
        key = (block.stream, block.size, block.addr)
        bisect.insort(self.keys, key)
        self.blocks[key] = block

    def remove(self, block: Block) -> None:
        key = (block.stream, block.size, block.addr)
        index = bisect.bisect_left(self.keys, key)
        if index < len(self.keys) and self.keys[index] == key:
            del self.keys[index]
            del self.blocks[key]

    def at_least(self, stream: int, size: int) -> int:
        """The index of the smallest block of ``stream`` of at least ``size`` bytes (may be past that stream)."""
        return bisect.bisect_left(self.keys, (stream, size, -1))

    def __iter__(self) -> Iterator[Block]:
        return iter([self.blocks[key] for key in self.keys])


class Pool:
    def __init__(self, small: bool) -> None:
        self.small = small
        self.free = FreeBlocks()
        #: Expandable segments' unmapped ranges, by (stream, address).
        self.unmapped: list[tuple[int, int]] = []
        self.unmapped_blocks: dict[tuple[int, int], Block] = {}

    def add_unmapped(self, block: Block) -> None:
        key = (block.stream, block.addr)
        bisect.insort(self.unmapped, key)
        self.unmapped_blocks[key] = block

    def remove_unmapped(self, block: Block) -> None:
        key = (block.stream, block.addr)
        index = bisect.bisect_left(self.unmapped, key)
        if index < len(self.unmapped) and self.unmapped[index] == key:
            del self.unmapped[index]
            del self.unmapped_blocks[key]


def expandable_size(block: Block) -> int:
    following = block.next
    return block.size + (following.size if following is not None and not following.mapped else 0)


def segment_heads(pool: Pool) -> Iterator[Block]:
    """Every block of ``pool``'s expandable segments reachable from a free or unmapped one (to find their heads)."""
    seen: set[int] = set()
    starts = [*pool.free.blocks.values(), *pool.unmapped_blocks.values()]
    for start in starts:
        block: Block | None = start
        while block is not None and block.prev is not None:
            block = block.prev
        if block is not None and id(block) not in seen:
            seen.add(id(block))
            yield block
