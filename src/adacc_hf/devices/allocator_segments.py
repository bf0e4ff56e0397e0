"""What the caching allocator model (`caching_allocator`) holds: blocks, pools, the device's
memory and expandable segments.

`CachingAllocatorModel` decides which block serves a request (rounding, best fit, splitting,
releasing the cache); this module keeps the memory those decisions act on: `Block` and its
`Segment`, the sorted sets of a `Pool`, `DeviceMemory` (the bytes reserved against the device's
capacity and the virtual address space), and `ExpandableSegments` (``expandable_segments:True``:
pages mapped and unmapped inside one growing segment). Names are the source's
(``c10/cuda/CUDACachingAllocator.cpp``).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

__all__ = [
    "K_SMALL_BUFFER",
    "Block",
    "DeviceMemory",
    "ExpandableSegments",
    "MiB",
    "Pool",
    "Segment",
    "SortedBlocks",
    "Stat",
    "ceil_to",
]

MiB = 2**20
K_SMALL_BUFFER = 2 * MiB  # small pool segments / expandable pages; the gap between ranges


def ceil_to(n: int, k: int) -> int:
    """`n` rounded up to a multiple of `k`."""
    return -(-n // k) * k


class Stat:
    """A c10 ``Stat``: the current value and its peak."""

    def __init__(self) -> None:
        self.current = self.peak = 0

    def add(self, n: int) -> None:
        self.current += n
        self.peak = max(self.peak, self.current)


@dataclass(eq=False)
class Segment:
    """An expandable segment: one virtual range mapped in pages (ExpandableSegment)."""

    ptr: int
    page: int


@dataclass(eq=False, slots=True)
class Block:
    """A range of a segment, free or allocated (Block), linked to its neighbours by address."""

    stream: int
    size: int
    ptr: int
    small: bool
    segment: Segment | None
    allocated: bool = False
    mapped: bool = True
    requested: int = 0
    prev: Block | None = None
    next: Block | None = None

    def splice(self, before: Block | None, after: Block | None) -> None:
        if before is not None:
            before.next = self
        if after is not None:
            after.prev = self
        self.prev, self.next = before, after


class SortedBlocks:
    """A std::set of blocks: by (stream, size, address) (BlockComparatorSize) or by (stream,
    address) (BlockComparatorAddress). A block is never resized while inside one."""

    def __init__(self, by_size: bool) -> None:
        self.by_size = by_size
        self.keys: list[tuple[int, int, int]] = []
        self.blocks: list[Block] = []

    def key(self, b: Block) -> tuple[int, int, int]:
        return (b.stream, b.size if self.by_size else 0, b.ptr)

    def add(self, b: Block) -> None:
        i = bisect.bisect_left(self.keys, self.key(b))
        self.keys.insert(i, self.key(b))
        self.blocks.insert(i, b)

    def remove(self, b: Block) -> None:
        i = bisect.bisect_left(self.keys, self.key(b))
        assert self.blocks[i] is b
        del self.keys[i], self.blocks[i]


class Pool:
    """A BlockPool: the free mapped blocks of the small or the large pool, and (expandable
    segments) their unmapped ranges."""

    def __init__(self, small: bool) -> None:
        self.small = small
        self.blocks = SortedBlocks(by_size=True)  # free, mapped
        self.unmapped = SortedBlocks(by_size=False)  # expandable segments' unmapped ranges

    def merge(self, dst: Block, src: Block | None) -> None:
        """try_merge_blocks: `dst` absorbs its free neighbour `src` of the same mapped state."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        (self.blocks if src.mapped else self.unmapped).remove(src)
        if dst.prev is src:
            dst.ptr = src.ptr
            dst.splice(src.prev, dst.next)
        else:
            dst.splice(dst.prev, src.next)
        dst.size += src.size


class DeviceMemory:
    """The device under the allocator: the bytes reserved from it (segments, mapped pages) and
    the virtual addresses handed to new segments.

    Args:
        capacity: bytes the device can give (cudaMalloc / cuMemCreate fail past them); ``None``:
            unlimited.
    """

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.reserved = Stat()
        self._address = K_SMALL_BUFFER  # next free virtual address

    def fits(self, nbytes: int) -> bool:
        """Whether `nbytes` more can be reserved."""
        return self.capacity is None or self.reserved.current + nbytes <= self.capacity

    def new_range(self, nbytes: int, align: int) -> int:
        """The address of a new virtual range of `nbytes`, never adjacent to another one."""
        ptr = ceil_to(self._address, align)
        self._address = ptr + ceil_to(nbytes, K_SMALL_BUFFER) + K_SMALL_BUFFER
        return ptr


class ExpandableSegments:
    """``expandable_segments:True``: one growing segment per stream and pool, reserving address
    space up front and mapping it in pages of 2 MiB (small pool) / `large_page` (large pool).

    Args:
        memory: the device the pages are mapped from (its reserved bytes count them).
        large_page: the large pool's page, ``large_segment_size``.
    """

    def __init__(self, memory: DeviceMemory, large_page: int) -> None:
        self.memory = memory
        self.large_page = large_page

    def allocate(self, pool: Pool, stream: int, size: int) -> Block | None:
        """try_allocate_expandable_block: map pages at the lowest address that can hold the
        request, merging them with the free block before them."""
        c = self._find(pool, stream, size)
        if not c.mapped and not self._map(pool, c, min(c.size, size)):
            return None
        while c.size < size:
            nxt = c.next
            assert nxt is not None
            if not self._map(pool, nxt, min(size - c.size, nxt.size)):
                return None
            c = nxt
        pool.blocks.remove(c)
        return c

    def release(self, pool: Pool) -> None:
        """release_blocks' expandable part: unmap every whole free page of `pool` and drop
        segments left with nothing mapped (release_expandable_segment)."""
        for block in [b for b in pool.blocks.blocks if b.segment is not None]:
            self._unmap(pool, block)
            if block.prev is None and block.next is None and not block.mapped:
                pool.unmapped.remove(block)

    def _find(self, pool: Pool, stream: int, size: int) -> Block:
        """find_expandable_block: the lowest unmapped range of this stream (with the free block
        before it) with room for `size`, else a new segment reserving 9/8 of the device's
        memory in address space, nothing mapped."""

        def room(b: Block | None) -> bool:
            total = 0
            while total < size and b is not None and not b.allocated:
                total, b = total + b.size, b.next
            return total >= size

        u = pool.unmapped
        for i in range(bisect.bisect_left(u.keys, (stream, 0, -1)), len(u.keys)):
            if u.keys[i][0] != stream:
                break
            c = u.blocks[i]
            if c.prev is not None and not c.prev.allocated:
                c = c.prev
            if room(c):
                return c
        page = K_SMALL_BUFFER if pool.small else self.large_page
        capacity = self.memory.capacity
        memory = capacity if capacity is not None else 2**40
        span = ceil_to(memory + memory // 8, page)
        seg = Segment(self.memory.new_range(span, page), page)
        c = Block(stream, span, seg.ptr, pool.small, seg)
        c.mapped = False
        pool.unmapped.add(c)
        return c

    def _map(self, pool: Pool, b: Block, size: int) -> bool:
        """map_block: map the pages covering `size` bytes from the start of unmapped `b`
        (ExpandableSegment::map rounds up to whole pages); they merge with free neighbours."""
        seg = b.segment
        assert seg is not None and (b.ptr - seg.ptr) % seg.page == 0
        nbytes = ceil_to(b.ptr + size - seg.ptr, seg.page) - (b.ptr - seg.ptr)
        if not self.memory.fits(nbytes):  # cuMemCreate failed: nothing stays mapped
            return False
        pool.unmapped.remove(b)
        b.mapped = True
        if nbytes < b.size:
            rest = Block(b.stream, b.size - nbytes, b.ptr + nbytes, pool.small, seg)
            rest.mapped = False
            rest.splice(b, b.next)
            pool.unmapped.add(rest)
            b.size = nbytes
        pool.merge(b, b.prev)
        pool.merge(b, b.next)
        pool.blocks.add(b)
        self.memory.reserved.add(nbytes)
        return True

    def _unmap(self, pool: Pool, b: Block) -> None:
        """unmap_block: unmap the whole pages strictly inside free block `b`; the partial pages
        at its ends stay mapped as free blocks."""
        seg = b.segment
        assert seg is not None
        first = ceil_to(b.ptr - seg.ptr, seg.page) + seg.ptr
        end = (b.ptr + b.size - seg.ptr) // seg.page * seg.page + seg.ptr
        if first >= end:
            return
        pool.blocks.remove(b)
        if first > b.ptr:
            before = Block(b.stream, first - b.ptr, b.ptr, pool.small, seg)
            before.splice(b.prev, b)
            pool.blocks.add(before)
        if b.ptr + b.size > end:
            after = Block(b.stream, b.ptr + b.size - end, end, pool.small, seg)
            after.splice(b, b.next)
            pool.blocks.add(after)
        b.ptr, b.size, b.mapped = first, end - first, False
        pool.merge(b, b.prev)
        pool.merge(b, b.next)
        pool.unmapped.add(b)
        self.memory.reserved.add(first - end)
