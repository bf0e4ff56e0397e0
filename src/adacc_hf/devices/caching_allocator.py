"""A model of PyTorch's CUDA caching allocator, to predict on a CPU the bytes a CUDA run reserves.

CUDA runs out of memory when the allocator's *reserved* bytes (its segments) do not fit, not its
allocated ones; replaying a step's allocation sequence through this model gives both peaks.

Modelled on ``c10/cuda/CUDACachingAllocator.cpp`` of the torch 2.9+ line (the stored snapshot
read has ``AcceleratorAllocatorConfig::large_segment_size``, MemPool registration counters and
``no_split_pools``), its constants checked against torch 2.13's installed header
``c10/core/AllocatorConfig.h`` (``kMinBlockSize`` ... ``kRoundLarge``; ``large_segment_size_``
20 MiB; ``max_non_split_rounding_size_`` defaults to it; ``roundup_power2_divisions`` all 0).
Function names below (and in `allocator_segments`, the blocks, pools and expandable segments
this model acts on) are the source's. Not modelled: streams' cross-use (``recordStream``: a
free here completes at once), CUDA graph / MemPool private pools, ``garbage_collection_threshold``
and ``per_process_memory_fraction``, ``roundup_power2_divisions``, free-memory callbacks.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from .allocator_segments import (
    K_SMALL_BUFFER,
    Block,
    DeviceMemory,
    ExpandableSegments,
    MiB,
    Pool,
    Stat,
    ceil_to,
)

__all__ = ["AllocatorOutOfMemoryError", "AllocatorPeaks", "CachingAllocatorModel", "replay"]

K_MIN_BLOCK_SIZE = 512  # every size is rounded up to a multiple of 512 B (round_size)
K_SMALL_SIZE = MiB  # requests <= 1 MiB go to the small pool (get_pool)
# K_SMALL_BUFFER: 2 MiB, small pool segments / expandable pages (allocator_segments)
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


class CachingAllocatorModel:
    """The caching allocator's bookkeeping, without memory: sizes, segments, pools, peaks.

    The choices are made here (which pool, best fit, split, what to release); the memory they
    act on lives in `allocator_segments`: the pools' blocks, `DeviceMemory` (the reserved bytes
    against the capacity) and, with `expandable`, `ExpandableSegments`.

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
        self.max_split_size = _UNLIMITED if max_split_size is None else max_split_size
        self.max_non_split_rounding = large_segment_size  # its default (AllocatorConfig.cpp)
        self.large_segment_size = large_segment_size
        self._memory = DeviceMemory(capacity)
        self._segments = (
            ExpandableSegments(self._memory, large_segment_size) if expandable else None
        )
        self._pools = {True: Pool(small=True), False: Pool(small=False)}
        self._live: dict[int, Block] = {}
        self._allocated, self._requested = Stat(), Stat()

    @property
    def capacity(self) -> int | None:
        """The device's bytes (``None``: unlimited)."""
        return self._memory.capacity

    @property
    def allocated(self) -> int:
        """Bytes in allocated blocks now (``torch.cuda.memory_allocated``)."""
        return self._allocated.current

    @property
    def reserved(self) -> int:
        """Bytes in segments now (``torch.cuda.memory_reserved``)."""
        return self._memory.reserved.current

    @property
    def peak_allocated(self) -> int:
        return self._allocated.peak

    @property
    def peak_reserved(self) -> int:
        return self._memory.reserved.peak

    def peaks(self) -> AllocatorPeaks:
        """The peaks so far: allocated, reserved and requested bytes."""
        return AllocatorPeaks(self._allocated.peak, self.peak_reserved, self._requested.peak)

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
            pool.merge(block, other)
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
        return ceil_to(size, K_ROUND_LARGE)

    def _should_split(self, block: Block, size: int) -> bool:
        """should_split: small pool or expandable: a remainder >= 512 B; large pool: a request
        under max_split_size leaving more than 1 MiB."""
        remaining = block.size - size
        if block.small or self.expandable:
            return remaining >= K_MIN_BLOCK_SIZE
        return size < self.max_split_size and remaining > K_SMALL_SIZE

    def _get_free_block(self, pool: Pool, stream: int, size: int) -> Block | None:
        """get_free_block: the smallest cached block of this stream and pool that fits (best
        fit); in expandable segments sizes count what a block can grow into (its size plus an
        unmapped range after it); oversize blocks (>= max_split_size) serve only requests at
        least that large and less than max_non_split_rounding smaller."""
        s = pool.blocks
        i = bisect.bisect_left(s.keys, (stream, size, -1))
        if i == len(s.keys) or s.keys[i][0] != stream:
            return None

        def grows_to(b: Block) -> int:
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

    def _alloc_found_block(self, pool: Pool, block: Block, size: int, requested: int) -> int:
        """alloc_found_block: split off the remainder when should_split says so."""
        if self._should_split(block, size):
            remaining = block
            block = Block(remaining.stream, size, remaining.ptr, pool.small, remaining.segment)
            block.splice(remaining.prev, remaining)
            remaining.ptr += size
            remaining.size -= size
            pool.blocks.add(remaining)
        block.allocated, block.requested = True, requested
        self._live[block.ptr] = block
        self._allocated.add(block.size)
        self._requested.add(requested)
        return block.ptr

    def _alloc_block(self, pool: Pool, stream: int, size: int, alloc_size: int) -> Block | None:
        """alloc_block: a new segment of alloc_size (cudaMalloc), or, expandable, map pages."""
        if self._segments is not None:
            return self._segments.allocate(pool, stream, size)
        if not self._memory.fits(alloc_size):
            return None
        self._memory.reserved.add(alloc_size)
        return Block(stream, alloc_size, self._memory.new_range(alloc_size, 512), pool.small, None)

    def _release_available_cached_blocks(self, pool: Pool, stream: int, size: int) -> bool:
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
            for block in list(pool.blocks.blocks):
                if block.segment is None and block.prev is None and block.next is None:
                    self._release_block(pool, block)
            if self._segments is not None:
                self._segments.release(pool)

    def _release_block(self, pool: Pool, block: Block) -> None:
        pool.blocks.remove(block)
        self._memory.reserved.add(-block.size)


def round_size(size: int) -> int:
    """round_size: at least 512 B, a multiple of 512 B (roundup_power2_divisions off).

    Args:
        size: bytes requested.
    """
    return max(K_MIN_BLOCK_SIZE, ceil_to(size, K_MIN_BLOCK_SIZE))


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
