"""A model of PyTorch's CUDA caching allocator, to predict on a CPU the bytes a CUDA run reserves.

CUDA runs out of memory when the allocator's *reserved* bytes (its segments) do not fit, not its
allocated ones; replaying a step's allocation sequence through this model gives both peaks.

Modelled on ``c10/cuda/CUDACachingAllocator.cpp`` of the torch 2.9+ line (the stored snapshot
read has ``AcceleratorAllocatorConfig::large_segment_size``, MemPool registration counters and
``no_split_pools``), its constants checked against torch 2.13's installed header
``c10/core/AllocatorConfig.h`` (``kMinBlockSize`` ... ``kRoundLarge``; ``large_segment_size_``
20 MiB; ``max_non_split_rounding_size_`` defaults to it; ``roundup_power2_divisions`` all 0).
Function names below are the source's. Not modelled: streams' cross-use (``recordStream``: a
free here completes at once), CUDA graph / MemPool private pools, ``garbage_collection_threshold``
and ``per_process_memory_fraction``, ``roundup_power2_divisions``, free-memory callbacks.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

__all__ = ["AllocatorOutOfMemoryError", "AllocatorPeaks", "CachingAllocatorModel", "replay"]

MiB = 2**20
K_MIN_BLOCK_SIZE = 512  # every size is rounded up to a multiple of 512 B (round_size)
K_SMALL_SIZE = MiB  # requests <= 1 MiB go to the small pool (get_pool)
K_SMALL_BUFFER = 2 * MiB  # small pool segments / expandable pages
K_MIN_LARGE_ALLOC = 10 * MiB  # (1, 10) MiB requests take a large_segment_size segment
K_ROUND_LARGE = 2 * MiB  # requests >= 10 MiB get a segment of their size rounded to 2 MiB
K_LARGE_BUFFER = 20 * MiB  # AcceleratorAllocatorConfig::large_segment_size() default
_UNLIMITED = 2**64 - 1  # max_split_size() default: std::numeric_limits<size_t>::max()


class AllocatorOutOfMemoryError(MemoryError):
    """The modelled device has no room for a request even after releasing its cache."""


@dataclass(frozen=True)
class AllocatorPeaks:
    """Highest bytes of a replay, as ``torch.cuda`` would report them."""

    allocated: int  # blocks handed out, rounded (max_memory_allocated)
    reserved: int  # segments held (max_memory_reserved)
    requested: int  # bytes asked for (the allocator's requested_bytes; a CPU allocator's count)


@dataclass(eq=False)
class _Segment:
    """An expandable segment: one virtual range mapped in pages (ExpandableSegment)."""

    ptr: int
    page: int


@dataclass(eq=False, slots=True)
class _Block:
    """A range of a segment, free or allocated (Block), linked to its neighbours by address."""

    stream: int
    size: int
    ptr: int
    small: bool
    segment: _Segment | None
    allocated: bool = False
    mapped: bool = True
    requested: int = 0
    prev: _Block | None = None
    next: _Block | None = None

    def splice(self, before: _Block | None, after: _Block | None) -> None:
        if before is not None:
            before.next = self
        if after is not None:
            after.prev = self
        self.prev, self.next = before, after


class _Stat:
    """A c10 ``Stat``: the current value and its peak."""

    def __init__(self) -> None:
        self.current = self.peak = 0

    def add(self, n: int) -> None:
        self.current += n
        self.peak = max(self.peak, self.current)


class _Sorted:
    """A std::set of blocks: by (stream, size, address) (BlockComparatorSize) or by (stream,
    address) (BlockComparatorAddress). A block is never resized while inside one."""

    def __init__(self, by_size: bool) -> None:
        self.by_size = by_size
        self.keys: list[tuple[int, int, int]] = []
        self.blocks: list[_Block] = []

    def key(self, b: _Block) -> tuple[int, int, int]:
        return (b.stream, b.size if self.by_size else 0, b.ptr)

    def add(self, b: _Block) -> None:
        i = bisect.bisect_left(self.keys, self.key(b))
        self.keys.insert(i, self.key(b))
        self.blocks.insert(i, b)

    def remove(self, b: _Block) -> None:
        i = bisect.bisect_left(self.keys, self.key(b))
        assert self.blocks[i] is b
        del self.keys[i], self.blocks[i]


class _Pool:
    def __init__(self, small: bool) -> None:
        self.small = small
        self.blocks = _Sorted(by_size=True)  # free, mapped
        self.unmapped = _Sorted(by_size=False)  # expandable segments' unmapped ranges


class CachingAllocatorModel:
    """The caching allocator's bookkeeping, without memory: sizes, segments, pools, peaks.

    Args:
        expandable: ``expandable_segments:True``: one growing segment per stream and pool,
            mapped in pages of 2 MiB (small pool) / `large_segment_size` (large pool).
        capacity: bytes the device can give (cudaMalloc / cuMemCreate fail past it); ``None``:
            unlimited. Fragmentation of physical memory is not modelled.
        max_split_size: ``max_split_size_mb`` in bytes (``None``: unlimited, the default).
        large_segment_size: ``large_segment_size_mb`` in bytes (20 MiB by default).
    """

    def __init__(
        self,
        expandable: bool = False,
        capacity: int | None = None,
        *,
        max_split_size: int | None = None,
        large_segment_size: int = K_LARGE_BUFFER,
    ) -> None:
        self.expandable = expandable
        self.capacity = capacity
        self.max_split_size = _UNLIMITED if max_split_size is None else max_split_size
        self.max_non_split_rounding = large_segment_size  # its default (AllocatorConfig.cpp)
        self.large_segment_size = large_segment_size
        self._pools = {True: _Pool(small=True), False: _Pool(small=False)}
        self._live: dict[int, _Block] = {}
        self._address = K_SMALL_BUFFER  # next free virtual address
        self._allocated, self._reserved, self._requested = _Stat(), _Stat(), _Stat()

    @property
    def allocated(self) -> int:
        """Bytes in allocated blocks now (``torch.cuda.memory_allocated``)."""
        return self._allocated.current

    @property
    def reserved(self) -> int:
        """Bytes in segments now (``torch.cuda.memory_reserved``)."""
        return self._reserved.current

    @property
    def peak_allocated(self) -> int:
        return self._allocated.peak

    @property
    def peak_reserved(self) -> int:
        return self._reserved.peak

    def peaks(self) -> AllocatorPeaks:
        """The peaks so far: allocated, reserved and requested bytes."""
        return AllocatorPeaks(self._allocated.peak, self._reserved.peak, self._requested.peak)

    # -------------------------------------------------------------------- public calls
    def malloc(self, size: int, stream: int = 0) -> int:
        """Allocate `size` bytes on `stream` (DeviceCachingAllocator::malloc).

        Args:
            size: bytes requested (0 allocates nothing and returns 0, as ``allocate`` does).
            stream: the allocation stream; blocks are reused only on their own stream.

        Returns:
            The block's address, the handle to `free`.
        """
        if size == 0:
            return 0
        rounded = round_size(size)
        pool = self._pools[rounded <= K_SMALL_SIZE]
        alloc_size = self._allocation_size(rounded)
        block = self._get_free_block(pool, stream, rounded)
        # Else a new segment; failing that, free cached segments and retry (malloc's chain).
        if block is None:
            block = self._alloc_block(pool, stream, rounded, alloc_size)
        if block is None and self._release_available_cached_blocks(pool, stream, rounded):
            block = self._alloc_block(pool, stream, rounded, alloc_size)
        if block is None:
            self._release_cached_blocks()
            block = self._alloc_block(pool, stream, rounded, alloc_size)
            if block is None:
                raise AllocatorOutOfMemoryError(
                    f"modelled device out of memory: tried to allocate {alloc_size} B with "
                    f"{self.reserved} B reserved of {self.capacity} B ({self.allocated} B "
                    "allocated); raise the capacity or lower the step's memory"
                )
        return self._alloc_found_block(pool, block, rounded, size)

    def free(self, handle: int) -> None:
        """Return an allocation to the cache (free + free_block; no cross-stream events).

        Args:
            handle: what `malloc` returned (0 is ignored, as a null pointer is).
        """
        if handle == 0:
            return
        block = self._live.pop(handle)
        block.allocated = False
        self._allocated.add(-block.size)
        self._requested.add(-block.requested)
        pool = self._pools[block.small]
        for other in (block.prev, block.next):
            self._try_merge(block, other, pool)
        pool.blocks.add(block)

    def empty_cache(self) -> None:
        """Release every unused cached segment / page (emptyCache -> release_cached_blocks)."""
        self._release_cached_blocks()

    # -------------------------------------------------------------------- the source's rules
    def _allocation_size(self, size: int) -> int:
        """get_allocation_size: 2 MiB for the small pool, large_segment_size below 10 MiB,
        else the size rounded up to 2 MiB."""
        if size <= K_SMALL_SIZE:
            return K_SMALL_BUFFER
        if size < K_MIN_LARGE_ALLOC:
            return self.large_segment_size
        return _ceil(size, K_ROUND_LARGE)

    def _should_split(self, block: _Block, size: int) -> bool:
        """should_split: small pool or expandable: a remainder >= 512 B; large pool: a request
        under max_split_size leaving more than 1 MiB."""
        remaining = block.size - size
        if block.small or self.expandable:
            return remaining >= K_MIN_BLOCK_SIZE
        return size < self.max_split_size and remaining > K_SMALL_SIZE

    def _get_free_block(self, pool: _Pool, stream: int, size: int) -> _Block | None:
        """get_free_block: the smallest cached block of this stream and pool that fits (best
        fit); in expandable segments sizes count what a block can grow into (its size plus an
        unmapped range after it); oversize blocks (>= max_split_size) serve only requests at
        least that large and less than max_non_split_rounding smaller."""
        s = pool.blocks
        i = bisect.bisect_left(s.keys, (stream, size, -1))
        if i == len(s.keys) or s.keys[i][0] != stream:
            return None

        def grows_to(b: _Block) -> int:
            return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)

        if s.blocks[i].segment is not None:
            j = i + 1
            while (
                s.blocks[i].segment is not None
                and j < len(s.keys)
                and s.keys[j][0] == stream
                and grows_to(s.blocks[j]) < grows_to(s.blocks[i])
            ):
                i, j = j, j + 1
        block = s.blocks[i]
        if size < self.max_split_size and block.size >= self.max_split_size:
            return None
        if size >= self.max_split_size and block.size >= size + self.max_non_split_rounding:
            return None
        s.remove(block)
        return block

    def _alloc_found_block(self, pool: _Pool, block: _Block, size: int, requested: int) -> int:
        """alloc_found_block: split off the remainder when should_split says so."""
        if self._should_split(block, size):
            remaining = block
            block = _Block(remaining.stream, size, remaining.ptr, pool.small, remaining.segment)
            block.splice(remaining.prev, remaining)
            remaining.ptr += size
            remaining.size -= size
            pool.blocks.add(remaining)
        block.allocated, block.requested = True, requested
        self._live[block.ptr] = block
        self._allocated.add(block.size)
        self._requested.add(requested)
        return block.ptr

    def _fits(self, nbytes: int) -> bool:
        return self.capacity is None or self._reserved.current + nbytes <= self.capacity

    def _new_range(self, nbytes: int, align: int) -> int:
        ptr = _ceil(self._address, align)
        self._address = ptr + _ceil(nbytes, K_SMALL_BUFFER) + K_SMALL_BUFFER  # never adjacent
        return ptr

    def _alloc_block(self, pool: _Pool, stream: int, size: int, alloc_size: int) -> _Block | None:
        """alloc_block: a new segment of alloc_size (cudaMalloc), or, expandable, map pages."""
        if self.expandable:
            return self._try_allocate_expandable_block(pool, stream, size)
        if not self._fits(alloc_size):
            return None
        self._reserved.add(alloc_size)
        return _Block(stream, alloc_size, self._new_range(alloc_size, 512), pool.small, None)

    def _release_available_cached_blocks(self, pool: _Pool, stream: int, size: int) -> bool:
        """release_available_cached_blocks: with a max_split_size, cudaFree the smallest
        oversize cached block that covers the request, else the largest ones until they do."""
        if self.max_split_size == _UNLIMITED:
            return False
        s, want = pool.blocks, max(size, self.max_split_size)
        i = bisect.bisect_left(s.keys, (stream, want, -1))
        if i < len(s.keys) and s.keys[i][0] == stream and s.blocks[i].segment is None:
            self._release_block(pool, s.blocks[i])
            return True
        if i == 0:
            return False
        released, i = 0, i - 1
        while (
            released < want and s.blocks[i].size >= self.max_split_size and s.keys[i][0] == stream
        ):
            cur, first = s.blocks[i], i == 0
            i = i if first else i - 1
            if cur.segment is None:
                released += cur.size
                self._release_block(pool, cur)
            if first:
                break
        return released >= want

    def _release_cached_blocks(self) -> None:
        """release_cached_blocks -> release_blocks, large pool then small: cudaFree every
        unsplit cached segment; in expandable segments unmap every whole free page and drop
        segments left with nothing mapped."""
        for pool in (self._pools[False], self._pools[True]):
            to_unmap = []
            for block in list(pool.blocks.blocks):
                if block.segment is not None:
                    to_unmap.append(block)
                elif block.prev is None and block.next is None:
                    self._release_block(pool, block)
            for block in to_unmap:
                self._unmap_block(pool, block)
                if block.prev is None and block.next is None and not block.mapped:
                    pool.unmapped.remove(block)  # release_expandable_segment

    def _release_block(self, pool: _Pool, block: _Block) -> None:
        pool.blocks.remove(block)
        self._reserved.add(-block.size)

    # -------------------------------------------------------------------- expandable segments
    def _try_allocate_expandable_block(self, pool: _Pool, stream: int, size: int) -> _Block | None:
        """try_allocate_expandable_block: map pages at the lowest address that can hold the
        request, merging them with the free block before them."""
        c = self._find_expandable_block(pool, stream, size)
        if not c.mapped and not self._map_block(pool, c, min(c.size, size)):
            return None
        while c.size < size:
            nxt = c.next
            assert nxt is not None
            if not self._map_block(pool, nxt, min(size - c.size, nxt.size)):
                return None
            c = nxt
        pool.blocks.remove(c)
        return c

    def _find_expandable_block(self, pool: _Pool, stream: int, size: int) -> _Block:
        """find_expandable_block: the lowest unmapped range of this stream (with the free block
        before it) with room for `size`, else a new segment reserving 9/8 of the device's
        memory in address space, nothing mapped."""

        def room(b: _Block | None) -> bool:
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
        page = K_SMALL_BUFFER if pool.small else self.large_segment_size
        memory = self.capacity if self.capacity is not None else 2**40
        span = _ceil(memory + memory // 8, page)
        seg = _Segment(self._new_range(span, page), page)
        c = _Block(stream, span, seg.ptr, pool.small, seg)
        c.mapped = False
        pool.unmapped.add(c)
        return c

    def _map_block(self, pool: _Pool, b: _Block, size: int) -> bool:
        """map_block: map the pages covering `size` bytes from the start of unmapped `b`
        (ExpandableSegment::map rounds up to whole pages); they merge with free neighbours."""
        seg = b.segment
        assert seg is not None and (b.ptr - seg.ptr) % seg.page == 0
        nbytes = _ceil(b.ptr + size - seg.ptr, seg.page) - (b.ptr - seg.ptr)
        if not self._fits(nbytes):  # cuMemCreate failed: nothing stays mapped
            return False
        pool.unmapped.remove(b)
        b.mapped = True
        if nbytes < b.size:
            rest = _Block(b.stream, b.size - nbytes, b.ptr + nbytes, pool.small, seg)
            rest.mapped = False
            rest.splice(b, b.next)
            pool.unmapped.add(rest)
            b.size = nbytes
        self._try_merge(b, b.prev, pool)
        self._try_merge(b, b.next, pool)
        pool.blocks.add(b)
        self._reserved.add(nbytes)
        return True

    def _unmap_block(self, pool: _Pool, b: _Block) -> None:
        """unmap_block: unmap the whole pages strictly inside free block `b`; the partial pages
        at its ends stay mapped as free blocks."""
        seg = b.segment
        assert seg is not None
        first = _ceil(b.ptr - seg.ptr, seg.page) + seg.ptr
        end = (b.ptr + b.size - seg.ptr) // seg.page * seg.page + seg.ptr
        if first >= end:
            return
        pool.blocks.remove(b)
        if first > b.ptr:
            before = _Block(b.stream, first - b.ptr, b.ptr, pool.small, seg)
            before.splice(b.prev, b)
            pool.blocks.add(before)
        if b.ptr + b.size > end:
            after = _Block(b.stream, b.ptr + b.size - end, end, pool.small, seg)
            after.splice(b, b.next)
            pool.blocks.add(after)
        b.ptr, b.size, b.mapped = first, end - first, False
        self._try_merge(b, b.prev, pool)
        self._try_merge(b, b.next, pool)
        pool.unmapped.add(b)
        self._reserved.add(first - end)

    def _try_merge(self, dst: _Block, src: _Block | None, pool: _Pool) -> None:
        """try_merge_blocks: absorb a free neighbour of the same mapped state."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        (pool.blocks if src.mapped else pool.unmapped).remove(src)
        if dst.prev is src:
            dst.ptr = src.ptr
            dst.splice(src.prev, dst.next)
        else:
            dst.splice(dst.prev, src.next)
        dst.size += src.size


def round_size(size: int) -> int:
    """round_size: at least 512 B, a multiple of 512 B (roundup_power2_divisions off).

    Args:
        size: bytes requested.
    """
    return max(K_MIN_BLOCK_SIZE, _ceil(size, K_MIN_BLOCK_SIZE))


def _ceil(n: int, k: int) -> int:
    return -(-n // k) * k


def replay(
    events: Iterable[tuple[str, Hashable, int, int]],
    expandable: bool = False,
    capacity: int | None = None,
    **options: int,
) -> AllocatorPeaks:
    """Run an allocation sequence through the model and return its peaks.

    Args:
        events: ``(action, id, size, stream)`` in order; action ``"alloc"`` or ``"free"`` (a
            free's size and stream are not read; it frees what the alloc of that id got).
        expandable: model ``expandable_segments:True``.
        capacity: the device's bytes; past them the model raises `AllocatorOutOfMemoryError`.
        **options: `CachingAllocatorModel`'s keyword options (``max_split_size``,
            ``large_segment_size``).
    """
    model = CachingAllocatorModel(expandable, capacity, **options)
    handles: dict[Hashable, int] = {}
    for action, key, size, stream in events:
        if action == "alloc":
            handles[key] = model.malloc(size, stream)
        elif action == "free":
            model.free(handles.pop(key))
        else:
            raise ValueError(f"unknown allocation event {action!r}: use 'alloc' or 'free'")
    return model.peaks()
