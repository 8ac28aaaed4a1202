"""The caching allocator's rules, each a function citing the PyTorch function it follows, and the pieces they
move: blocks (`Block`), the free and unmapped lists of one (stream, pool) (`Pool`) and the pages of an expandable
segment (`ExpandableSegment`). The state they change and the replay that calls them are
memplan.memory.allocator's; the settings memplan.memory.alloc_conf's.

Followed: PyTorch 2.9-2.11, c10/cuda/CUDACachingAllocator.cpp (`round_size`, `get_pool`, `get_allocation_size`,
`get_free_block`, `should_split`, `alloc_block`'s segment count, `try_merge_blocks`,
`release_available_cached_blocks`, `release_cached_blocks` / `release_blocks` / `release_block`,
`garbage_collect_cached_blocks`, and for expandable segments `find_expandable_block`,
`try_allocate_expandable_block`, `map_block`, `unmap_block`, `ExpandableSegment::map` / `unmap`),
which newer versions move into c10/core/CachingDeviceAllocator.h (`get_round_size`,
`get_allocation_size`) with the same logic. Our own code, none of PyTorch's.

The rules reach the allocator's state (`state`, a memplan.memory.allocator.CachingAllocatorModel) through its
public fields: config, capacity, allowed_bytes, reserved, segments, cuda_segments, cuda_segments_peak,
segment_allocs, segment_bases, pools, gc_calls, grow(), new_address().
Every rule calls the others through this module's globals, and the allocator calls them through the module, so
a test can replace one rule and see the outcome change.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Any, Optional

from memplan.memory.alloc_conf import LARGE_BUFFER_BYTES, AllocatorConfig, divisions_for

MIN_BLOCK_BYTES = 512  # kMinBlockSize: every size is rounded to a multiple of it
SMALL_SIZE_BYTES = 1 << 20  # kSmallSize: the largest request of the small pool
SMALL_BUFFER_BYTES = 2 << 20  # kSmallBuffer: a small-pool segment; an expandable small page
MIN_LARGE_ALLOC_BYTES = 10 << 20  # kMinLargeAlloc: requests below it get a kLargeBuffer segment
ROUND_LARGE_BYTES = 2 << 20  # kRoundLarge: larger requests' segments are rounded to it
# LARGE_BUFFER_BYTES (alloc_conf): kLargeBuffer, 20 MiB: that segment; an expandable large page
KEY_SHIFT = 56  # a free block's sort key: size << 56 | address (addresses stay below 2^56)


class Block:
    """A piece of a segment: allocated, free (in its pool's free list) or, in an expandable segment,
    unmapped address space (in the pool's unmapped list)."""

    __slots__ = ("addr", "size", "pool", "allocated", "prev", "next", "seg", "mapped", "requested", "gc_base")

    def __init__(self, addr: int, size: int, pool: "Pool", seg: Optional["ExpandableSegment"] = None,
                 mapped: bool = True):
        self.addr, self.size, self.pool, self.seg, self.mapped = addr, size, pool, seg, mapped
        self.allocated = False
        self.prev: Optional[Block] = None
        self.next: Optional[Block] = None
        self.requested = 0
        self.gc_base = 0


class Pool:
    """The free blocks of one (stream, small or large) pool, sorted by (size, address) as PyTorch's
    BlockComparatorSize orders a BlockPool within a stream, and its unmapped blocks by address."""

    __slots__ = ("stream", "large", "keys", "blocks", "unmapped_addrs", "unmapped", "owner")

    def __init__(self, stream: int, large: bool, owner: Any):
        self.stream, self.large, self.owner = stream, large, owner
        self.keys: list[int] = []
        self.blocks: dict[int, Block] = {}
        self.unmapped_addrs: list[int] = []
        self.unmapped: dict[int, Block] = {}

    def add(self, block: Block) -> None:
        """BlockPool::insert_into_blocks (stamps the block's garbage-collection age)."""
        key = block.size << KEY_SHIFT | block.addr
        insort(self.keys, key)
        self.blocks[key] = block
        block.gc_base = self.owner.gc_calls[self.large]

    def remove(self, block: Block) -> None:
        key = block.size << KEY_SHIFT | block.addr
        del self.keys[bisect_left(self.keys, key)]
        del self.blocks[key]

    def add_unmapped(self, block: Block) -> None:
        insort(self.unmapped_addrs, block.addr)
        self.unmapped[block.addr] = block

    def remove_unmapped(self, block: Block) -> None:
        del self.unmapped_addrs[bisect_left(self.unmapped_addrs, block.addr)]
        del self.unmapped[block.addr]


class ExpandableSegment:
    """One reserved virtual range of `pages` pages of `page` bytes (2 MiB small pool, 20 MiB large), of which
    `mapped` says which are backed by physical memory (ExpandableSegment's handles_)."""

    __slots__ = ("base", "page", "mapped")

    def __init__(self, base: int, page: int, pages: int):
        self.base, self.page, self.mapped = base, page, bytearray(pages)


# ---------------------------------------------------------------------------------------------- the rules


def roundup_power2_next_division(size: int, divisions: int) -> int:
    """`roundup_power2_next_division`: the next of `divisions` equal steps between the powers of two around
    `size` (1200 B, 4 divisions: steps of 256 from 1024, so 1280); a power of two stays."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    low = size & ~(step - 1)
    return size if low == size else low + step


def round_size(size: int, config: AllocatorConfig) -> int:
    """`round_size` (CachingDeviceAllocator.h `get_round_size`): below 512 B -> 512; with more than one
    roundup_power2_divisions for the size's bucket and size > 512 * divisions -> the next division step;
    else the next multiple of 512."""
    if size < MIN_BLOCK_BYTES:
        return MIN_BLOCK_BYTES
    divisions = divisions_for(size, config)
    if divisions > 1 and size > MIN_BLOCK_BYTES * divisions:
        return roundup_power2_next_division(size, divisions)
    return -(-size // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES


def get_pool(size: int, stream: int) -> tuple[int, bool]:
    """`get_pool`: the (stream, large) pool of a rounded size: small up to 1 MiB (kSmallSize), else large.
    The stream is part of the pool because BlockComparatorSize orders by stream first and `get_free_block`
    takes only a block of the request's stream: streams never share a cached block."""
    return stream, size > SMALL_SIZE_BYTES


def get_allocation_size(size: int) -> int:
    """`get_allocation_size`: the segment cudaMalloc'ed for a request no cached block fits: up to 1 MiB ->
    2 MiB (kSmallBuffer); below 10 MiB (kMinLargeAlloc) -> 20 MiB (kLargeBuffer); else the request rounded up
    to 2 MiB (kRoundLarge)."""
    if size <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if size < MIN_LARGE_ALLOC_BYTES:
        return LARGE_BUFFER_BYTES
    return -(-size // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES


def _expandable_size(block: Block) -> int:
    nxt = block.next
    return block.size + (nxt.size if nxt is not None and not nxt.mapped else 0)


def get_free_block(pool: Pool, size: int, config: AllocatorConfig) -> Optional[Block]:
    """`get_free_block`: best fit, the smallest free block of the pool (same stream) >= size, lowest address
    first; in an expandable segment a block counts as its size plus the unmapped space after it, and a later
    block that expands to less is preferred. With max_split_size: a request below it never takes a block at
    or above it, a request at or above it only a block < request + max_non_split_rounding (20 MiB). Takes the
    block out of the free list."""
    keys = pool.keys
    i = bisect_left(keys, size << KEY_SHIFT)
    if i == len(keys):
        return None
    block = pool.blocks[keys[i]]
    if block.seg is not None:
        while i + 1 < len(keys):
            following = pool.blocks[keys[i + 1]]
            if _expandable_size(following) >= _expandable_size(block):
                break
            i, block = i + 1, following
    limit = config.max_split_size_bytes
    if size < limit <= block.size:
        return None
    if size >= limit and block.size >= size + config.max_non_split_rounding_bytes:
        return None
    del keys[i]
    del pool.blocks[block.size << KEY_SHIFT | block.addr]
    return block


def should_split(block_size: int, size: int, large: bool, config: AllocatorConfig) -> bool:
    """`should_split`: the small pool, or any pool with expandable segments, splits off a remainder of at
    least 512 B; the large pool only when the request is below max_split_size and the remainder is more than
    1 MiB (kSmallSize), so up to 1 MiB of a large block can be handed out unused."""
    remaining = block_size - size
    if not large or config.expandable_segments:
        return remaining >= MIN_BLOCK_BYTES
    return size < config.max_split_size_bytes and remaining > SMALL_SIZE_BYTES


def try_merge_blocks(dst: Block, src: Optional[Block], pool: Pool) -> int:
    """`try_merge_blocks`: a neighbour that is free and mapped alike joins `dst` (out of its free or unmapped
    list); returns the bytes it brought, 0 when it cannot merge."""
    if src is None or src.allocated or src.mapped != dst.mapped:
        return 0
    if src.mapped:
        pool.remove(src)
    else:
        pool.remove_unmapped(src)
    if dst.prev is src:
        dst.addr = src.addr
        dst.prev = src.prev
        if dst.prev is not None:
            dst.prev.next = dst
    else:
        dst.next = src.next
        if dst.next is not None:
            dst.next.prev = dst
    dst.size += src.size
    return src.size


def count_cuda_segment(state: Any, size: int) -> None:
    """`alloc_block`'s `stats.segment` increase and its SEGMENT_ALLOC trace entry, which only a cudaMalloc'd
    segment makes: an expandable segment is reserved address space (`find_expandable_block`) whose pages
    `map_block` maps with a SEGMENT_MAP entry and a reserved_bytes increase, never a segment; so segment.all.peak
    is 0 under expandable_segments (measured on an H100, torch 2.11: tests/test_alloc_fixtures_cuda.py)."""
    state.segment_allocs.append(size)
    state.cuda_segments += 1
    if state.cuda_segments > state.cuda_segments_peak:
        state.cuda_segments_peak = state.cuda_segments


def release_block(state: Any, block: Block) -> None:
    """`release_block`: cudaFree of a whole free segment (`stats.segment` decreases)."""
    block.pool.remove(block)
    state.reserved -= block.size
    state.segments -= 1
    state.cuda_segments -= 1
    state.segment_bases.discard(block.addr)


def release_available_cached_blocks(state: Any, pool: Pool, size: int) -> bool:
    """`release_available_cached_blocks`, only with max_split_size set: cudaFree the smallest cached oversize
    block (>= max(size, max_split_size)) of the stream, else the largest oversize ones until they add up to
    that; True when enough was freed. Expandable blocks are skipped (2.9+)."""
    limit = state.config.max_split_size_bytes
    if not state.config.max_split_size_set:
        return False
    target = max(size, limit)
    keys = pool.keys
    i = bisect_left(keys, target << KEY_SHIFT)
    if i < len(keys) and pool.blocks[keys[i]].seg is None:
        block = pool.blocks[keys[i]]
        if block.prev is not None or block.next is not None:
            return False  # PyTorch assumes an oversize free block is a whole segment
        release_block(state, block)
        return True
    released = 0
    for key in reversed(keys[:i]):
        block = pool.blocks[key]
        if released >= target or block.size < limit:
            break
        if block.seg is None and block.prev is None and block.next is None:
            release_block(state, block)
            released += block.size
    return released >= target


def unmap_block(state: Any, block: Block) -> None:
    """`unmap_block` with `ExpandableSegment::unmap`: the whole pages inside a free expandable block go back
    to the driver; the partial pages at its ends stay as free mapped blocks."""
    seg = block.seg
    page = seg.page
    begin = -(-(block.addr - seg.base) // page)
    end = (block.addr + block.size - seg.base) // page
    if begin >= end:
        return
    pool = block.pool
    pool.remove(block)
    start, length = seg.base + begin * page, (end - begin) * page
    if start > block.addr:
        before = Block(block.addr, start - block.addr, pool, seg)
        before.prev, before.next = block.prev, block
        if block.prev is not None:
            block.prev.next = before
        block.prev = before
        pool.add(before)
    after_size = block.addr + block.size - start - length
    if after_size > 0:
        after = Block(start + length, after_size, pool, seg)
        after.prev, after.next = block, block.next
        if block.next is not None:
            block.next.prev = after
        block.next = after
        pool.add(after)
    block.addr, block.size, block.mapped = start, length, False
    try_merge_blocks(block, block.prev, pool)
    try_merge_blocks(block, block.next, pool)
    pool.add_unmapped(block)
    seg.mapped[begin:end] = bytes(end - begin)
    state.reserved -= length


def release_cached_blocks(state: Any) -> bool:
    """`release_cached_blocks` / `release_blocks` (also torch.cuda.empty_cache): after synchronising, cudaFree
    every free block that is a whole segment, large pools then small; in expandable segments unmap every free
    whole page and drop a segment left with nothing mapped."""
    for large in (True, False):
        for pool in [p for p in state.pools.values() if p.large == large]:
            to_unmap = []
            for block in list(pool.blocks.values()):
                if block.seg is not None:
                    to_unmap.append(block)
                elif block.prev is None and block.next is None:
                    release_block(state, block)
            for block in to_unmap:
                unmap_block(state, block)
                if block.prev is None and block.next is None and not block.mapped:
                    pool.remove_unmapped(block)
                    state.segments -= 1
    return True


def garbage_collect_cached_blocks(state: Any) -> None:
    """`garbage_collect_cached_blocks` (only when a memory fraction is set and garbage_collection_threshold > 0,
    before a new segment is asked for): while reserved > threshold * allowed memory, cudaFree the large pool's
    whole-segment free blocks whose age (get_free_block calls since they were cached) is at least the average,
    in pool order, repeating with a new average until enough is freed or nothing is."""
    threshold = int(state.config.garbage_collection_threshold * state.allowed_bytes)
    if state.reserved <= threshold:
        return
    target = state.reserved - threshold
    now = state.gc_calls[True]
    pools = sorted((p for p in state.pools.values() if p.large), key=lambda p: p.stream)
    candidates = [p.blocks[k] for p in pools for k in p.keys]
    candidates = [b for b in candidates if b.prev is None and b.next is None and b.seg is None]
    total_age, count, reclaimed = sum(now - b.gc_base for b in candidates), len(candidates), 0
    freed = True
    while reclaimed < target and freed and count > 0:
        average, freed, kept = total_age / count, False, []
        for block in candidates:
            if now - block.gc_base >= average:
                freed, reclaimed = True, reclaimed + block.size
                total_age, count = total_age - (now - block.gc_base), count - 1
                release_block(state, block)
            else:
                kept.append(block)
        candidates = kept


def expandable_page_size(large: bool) -> int:
    """The page an expandable segment maps at a time (its segment_size_, chosen in `find_expandable_block`):
    2 MiB (kSmallBuffer) for the small pool, 20 MiB (kLargeBuffer) for the large one."""
    return LARGE_BUFFER_BYTES if large else SMALL_BUFFER_BYTES


def find_expandable_block(state: Any, pool: Pool, size: int) -> Block:
    """`find_expandable_block`: the lowest-address unmapped range of the pool's segment (with the free block
    just before it) that has `size` bytes of free or unmapped space; else a new segment reserving address
    space for 9/8 of the capacity, in 2 MiB (small) or 20 MiB (large) pages."""
    for addr in pool.unmapped_addrs:
        start = pool.unmapped[addr]
        if start.prev is not None and not start.prev.allocated:
            start = start.prev
        room, block = 0, start
        while room < size and block is not None and not block.allocated:
            room, block = room + block.size, block.next
        if room >= size:
            return start
    page = expandable_page_size(pool.large)
    pages = -(-(state.capacity + state.capacity // 8) // page)
    seg = ExpandableSegment(state.new_address(pages * page), page, pages)
    block = Block(seg.base, pages * page, pool, seg, mapped=False)
    pool.add_unmapped(block)
    state.segments += 1
    return block


def map_block(state: Any, block: Block, size: int) -> bool:
    """`map_block` with `ExpandableSegment::map`: back the pages covering the first `size` bytes of an unmapped
    block with physical memory (all or none: False when the device has not that many pages left), merge them
    with the free neighbours and cache them as a free block."""
    seg = block.seg
    page = seg.page
    begin = (block.addr - seg.base) // page
    end = -(-(block.addr + size - seg.base) // page)
    length = (end - begin) * page
    if length == 0 or state.reserved + length > state.capacity:
        return False
    seg.mapped[begin:end] = b"\x01" * (end - begin)
    pool = block.pool
    pool.remove_unmapped(block)
    block.mapped = True
    if length < block.size:
        rest = Block(block.addr + length, block.size - length, pool, seg, mapped=False)
        rest.prev, rest.next = block, block.next
        if block.next is not None:
            block.next.prev = rest
        block.next = rest
        pool.add_unmapped(rest)
        block.size = length
    try_merge_blocks(block, block.prev, pool)
    try_merge_blocks(block, block.next, pool)
    pool.add(block)
    state.grow(length)
    return True


def try_allocate_expandable_block(state: Any, pool: Pool, size: int) -> Optional[Block]:
    """`try_allocate_expandable_block`: map just enough pages after the free space found by
    find_expandable_block to hold `size`; None when a map fails (pages mapped before stay, free)."""
    block = find_expandable_block(state, pool, size)
    if not block.mapped and not map_block(state, block, min(block.size, size)):
        return None
    while block.size < size:
        nxt = block.next
        if not map_block(state, nxt, min(size - block.size, nxt.size)):
            return None
        block = nxt
    pool.remove(block)
    return block
