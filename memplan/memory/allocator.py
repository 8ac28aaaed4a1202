"""The replay of a run through a model of PyTorch's CUDA caching allocator on one device: `replay(events,
capacity_bytes, config)` walks an ordered stream of allocations and frees and returns a `ReplayResult`
(memplan.memory.alloc_result: the reserved peak, the allocated peak as torch.cuda.max_memory_allocated, inactive
split bytes, segments, retries, the first out-of-memory and what its message would say). `CachingAllocatorModel`
holds the allocator's state (segments, blocks, free lists, statistics) and runs `DeviceCachingAllocator::malloc` /
`free` / `emptyCache` of c10/cuda/CUDACachingAllocator.cpp (PyTorch 2.9-2.11) step by step, calling the rules of
memplan.memory.alloc_rules through that module; the settings are memplan.memory.alloc_conf's.

Addresses order the cached blocks of one size (PyTorch's BlockComparatorSize: size, then address), so which of
two equal free blocks a request takes depends on where the driver put their segments. The model places each new
large-pool segment below the earlier ones and each small-pool one above, as the H100 recordings show
(`new_address`); a CUDA recording knows the real places (its tensor ids are the blocks' addresses, and a block cut
from a new segment starts at the segment's base), and `replay(..., ids_are_addresses=True)` uses them.

The device: `capacity_bytes` is the memory the allocator may hold (cudaMalloc or mapping a page fails past it):
the card's total memory less the CUDA context, NCCL and all else outside PyTorch's allocator.
"""

from __future__ import annotations

import operator
from bisect import bisect_left, insort
from typing import Any, Iterable, NamedTuple, Optional, Sequence

from memplan.core.errors import MemplanError
from memplan.memory import alloc_rules as rules
from memplan.memory.alloc_conf import AllocatorConfig
from memplan.memory.alloc_result import OutOfMemory, ReplayResult
from memplan.memory.alloc_rules import Block, Pool

_ADDRESS_LIMIT = 1 << 56
_ALIGN = 2 << 20
_MISSING = object()


class AllocEvent(NamedTuple):
    """One event of the stream: op "alloc" (size_bytes as requested, unrounded), "free" (size ignored) or
    "empty_cache" (torch.cuda.empty_cache(); id and size ignored), on CUDA stream `stream`. A plain 4-tuple
    (op, tensor_id, size_bytes, stream) works as well and is what a long stream should use."""

    op: str
    tensor_id: Any
    size_bytes: int = 0
    stream: int = 0


class CachingAllocatorModel:
    """The allocator of one device: `malloc(size, stream)` returns the Block a tensor gets (None: out of
    memory), `free(block)` caches it again, `empty_cache()` returns the cached whole segments. Its fields
    are the rules' view of it (memplan.memory.alloc_rules)."""

    def __init__(self, capacity_bytes: int, config: Optional[AllocatorConfig] = None):
        config = AllocatorConfig() if config is None else config
        if not isinstance(capacity_bytes, int) or isinstance(capacity_bytes, bool) or capacity_bytes < 0:
            raise MemplanError(f"capacity_bytes must be a non-negative integer, got {capacity_bytes!r}")
        if config.backend != "native":
            raise MemplanError(f"backend:{config.backend} hands memory to the driver's pool, which memplan does "
                               f"not model; replay the native allocator")
        self.config = config
        self.capacity = capacity_bytes
        self.fraction_set = config.memory_fraction is not None
        # allowed_memory_maximum = fraction * the device's total memory; here of the capacity replayed
        self.allowed_bytes = int(config.memory_fraction * capacity_bytes) if self.fraction_set else capacity_bytes
        self.gc_enabled = self.fraction_set and config.garbage_collection_threshold > 0
        self.reserved = self.allocated = self.requested = 0
        self.reserved_peak = self.allocated_peak = self.requested_peak = 0
        self.inactive_split = self.inactive_split_peak = 0
        self.segments = 0
        self.cuda_segments = self.cuda_segments_peak = 0  # segment.all: cudaMalloc'd segments only
        self.segment_allocs: list[int] = []  # the sizes cudaMalloc'd, in order
        self.segment_address: Optional[int] = None  # where the driver puts the next segment (None: above the last)
        self.segment_bases: set[int] = set()  # the device addresses of the live segments placed there
        self.num_alloc_retries = self.num_ooms = 0
        self.gc_calls = [0, 0]  # BlockPool::get_free_blocks_call_count of the small and the large pool
        self.pools: dict[tuple[int, bool], Pool] = {}
        self.peak_moved = False
        self.last_failure = (0, 0)  # (rounded size, segment size) of the last request that found no memory
        self._low, self._high = _ALIGN, _ADDRESS_LIMIT  # new_address: the small pool's up, the large pool's down
        self._sizes: dict[tuple[int, int], tuple[int, Pool, int]] = {}

    def grow(self, nbytes: int) -> None:
        """reserved_bytes grows (a segment cudaMalloc'ed or pages mapped)."""
        self.reserved += nbytes
        if self.reserved > self.reserved_peak:
            self.reserved_peak = self.reserved
            self.peak_moved = True

    def new_address(self, nbytes: int) -> int:
        """A new segment's address (never reused; it orders equal-size free blocks, lowest first): as in the H100
        recordings, a large-pool segment below the earlier ones, a 2 MiB small-pool one above (tests/test_alloc_fixtures_cuda.py)."""
        n = -(-nbytes // _ALIGN) * _ALIGN
        if nbytes <= rules.SMALL_BUFFER_BYTES:
            self._low += n
            return self._low - n
        self._high -= n
        if self._high < self._low:
            raise MemplanError("the replay ran out of model addresses (2^56 bytes of segments); split the stream")
        return self._high

    def pool(self, key: tuple[int, bool]) -> Pool:
        pool = self.pools.get(key)
        if pool is None:
            pool = self.pools[key] = Pool(key[0], key[1], self)
        return pool

    def alloc_block(self, pool: Pool, size: int, alloc_size: int, is_retry: bool) -> Optional[Block]:
        """`alloc_block`: a new segment of alloc_size (or, with expandable segments, pages mapped for size);
        None when the memory fraction or the device refuses. A retry counts in num_alloc_retries."""
        if is_retry:
            self.num_alloc_retries += 1
        if self.fraction_set and self.reserved + alloc_size > self.allowed_bytes:
            return None
        if self.config.expandable_segments:
            return rules.try_allocate_expandable_block(self, pool, size)
        if self.reserved + alloc_size > self.capacity:
            return None
        address = self.segment_address
        if address is None:
            address = self.new_address(alloc_size)
        elif address in self.segment_bases:
            raise MemplanError(f"a segment is cudaMalloc'd at address {address}, where a live one starts: the replay "
                               f"has left the recording it replays")
        else:
            self.segment_bases.add(address)
        block = Block(address, alloc_size, pool)
        self.segments += 1
        rules.count_cuda_segment(self, alloc_size)
        self.grow(alloc_size)
        return block

    def malloc(self, orig_size: int, stream: int = 0) -> Optional[Block]:
        """`DeviceCachingAllocator::malloc`: round, pick the pool, take the best cached block, else (after a
        garbage collection when enabled) a new segment, else release the oversize cached blocks and retry,
        else release every cached whole segment and retry once; then split the block when the rule says so."""
        cached = self._sizes.get((orig_size, stream))
        if cached is None:
            size = rules.round_size(orig_size, self.config)
            cached = (size, self.pool(rules.get_pool(size, stream)), rules.get_allocation_size(size))
            self._sizes[(orig_size, stream)] = cached
        size, pool, alloc_size = cached
        config = self.config
        if self.gc_enabled:
            self.gc_calls[pool.large] += 1
        block = rules.get_free_block(pool, size, config)
        if block is None:
            if self.gc_enabled:
                rules.garbage_collect_cached_blocks(self)
            block = self.alloc_block(pool, size, alloc_size, False)
            if block is None and rules.release_available_cached_blocks(self, pool, size):
                block = self.alloc_block(pool, size, alloc_size, False)
            if block is None and rules.release_cached_blocks(self):
                block = self.alloc_block(pool, size, alloc_size, True)
            if block is None:
                self.num_ooms += 1
                self.last_failure = (size, alloc_size)
                return None
        # alloc_found_block
        already_split = block.prev is not None or block.next is not None
        if rules.should_split(block.size, size, pool.large, config):
            rest = block
            block = Block(rest.addr, size, pool, rest.seg)
            block.prev = rest.prev
            if rest.prev is not None:
                rest.prev.next = block
            block.next = rest
            rest.prev = block
            rest.addr += size
            rest.size -= size
            pool.add(rest)
            if rest.seg is None:
                self.inactive_split += -size if already_split else rest.size
                if self.inactive_split > self.inactive_split_peak:
                    self.inactive_split_peak = self.inactive_split
        elif already_split and block.seg is None:
            self.inactive_split -= block.size
        block.allocated = True
        block.requested = orig_size
        self.allocated += block.size
        self.requested += orig_size
        if self.allocated > self.allocated_peak:
            self.allocated_peak = self.allocated
        if self.requested > self.requested_peak:
            self.requested_peak = self.requested
        return block

    def free(self, block: Block) -> None:
        """`DeviceCachingAllocator::free` / `free_block`: merge with free neighbours (try_merge_blocks) and cache."""
        if not block.allocated:
            raise MemplanError("a block was freed twice")
        block.allocated = False
        self.allocated -= block.size
        self.requested -= block.requested
        pool = block.pool
        net, prev, nxt = 0, block.prev, block.next
        if prev is not None and not prev.allocated:  # try_merge_blocks merges no other neighbour
            net -= rules.try_merge_blocks(block, prev, pool)
        if nxt is not None and not nxt.allocated:
            net -= rules.try_merge_blocks(block, nxt, pool)
        pool.add(block)
        if block.seg is None:
            if block.prev is not None or block.next is not None:
                net += block.size
            self.inactive_split += net
            if self.inactive_split > self.inactive_split_peak:
                self.inactive_split_peak = self.inactive_split

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache(): `emptyCache` -> release_cached_blocks."""
        rules.release_cached_blocks(self)


def _event_error(index: int, event: Any, why: str) -> MemplanError:
    return MemplanError(f"allocation event {index} {event!r}: {why}")


def replay(events: Iterable, capacity_bytes: int, config: Optional[AllocatorConfig] = None,
           ids_are_addresses: bool = False) -> ReplayResult:
    """Replay an ordered stream of AllocEvent / (op, tensor_id, size_bytes, stream) tuples through the caching
    allocator of a device whose allocator may hold `capacity_bytes`; stop at the first out-of-memory, as the
    training script would. A tensor id is live from its "alloc" to its "free"; a 0-byte tensor takes no
    memory (PyTorch never calls malloc for it). `ids_are_addresses`: the ids are the blocks' device addresses (a
    CUDA recording's trace), and a segment cudaMalloc'd for an allocation starts at its id (module docstring)."""
    state = CachingAllocatorModel(capacity_bytes, config)
    place = ids_are_addresses and not state.config.expandable_segments
    live: dict[Any, Optional[Block]] = {}
    malloc, free = state.malloc, state.free
    oom = None
    at_peak = (0, 0)
    replayed = 0
    for index, event in enumerate(events):
        try:
            op, tensor_id, size, stream = event
        except (TypeError, ValueError):
            raise _event_error(index, event, "expected (op, tensor_id, size_bytes, stream)") from None
        if op == "alloc":
            if tensor_id in live:
                raise _event_error(index, event, "this tensor id is already live (allocated and not freed)")
            if type(size) is not int:
                try:
                    size = operator.index(size)
                except TypeError:
                    raise _event_error(index, event, "the size must be an integer number of bytes") from None
            if size <= 0:
                if size < 0:
                    raise _event_error(index, event, "a negative size")
                live[tensor_id] = None
            else:
                if place:
                    state.segment_address = _device_address(index, event, tensor_id)
                block = malloc(size, stream)
                state.segment_address = None
                if block is None:
                    rounded, segment = state.last_failure
                    oom = OutOfMemory(index, tensor_id, stream, size, rounded, segment, state.allocated,
                                      state.reserved, capacity_bytes)
                    break
                live[tensor_id] = block
                if state.peak_moved:
                    state.peak_moved = False
                    at_peak = (state.inactive_split, state.segments)
        elif op == "free":
            block = live.pop(tensor_id, _MISSING)
            if block is _MISSING:
                raise _event_error(index, event, "frees a tensor id that is not live")
            if block is not None:
                free(block)
        elif op == "empty_cache":
            state.empty_cache()
        else:
            raise _event_error(index, event, f"unknown op {op!r} (alloc, free or empty_cache)")
        replayed = index + 1
    return _result(state, at_peak, replayed, oom)


def _device_address(index: int, event: Any, tensor_id: Any) -> int:
    if type(tensor_id) is not int or not 0 <= tensor_id < _ADDRESS_LIMIT:
        raise _event_error(index, event, "with ids_are_addresses the id must be a device address below 2^56")
    return tensor_id


def _result(state: CachingAllocatorModel, at_peak: tuple[int, int], replayed: int,
            oom: Optional[OutOfMemory]) -> ReplayResult:
    return ReplayResult(
        reserved_peak_bytes=state.reserved_peak, allocated_peak_bytes=state.allocated_peak,
        requested_peak_bytes=state.requested_peak, inactive_split_bytes_at_reserved_peak=at_peak[0],
        inactive_split_peak_bytes=state.inactive_split_peak, segments_at_reserved_peak=at_peak[1],
        num_alloc_retries=state.num_alloc_retries, num_ooms=state.num_ooms, events_replayed=replayed,
        reserved_end_bytes=state.reserved, allocated_end_bytes=state.allocated, oom=oom,
        segments_peak=state.cuda_segments_peak, segment_allocs=tuple(state.segment_allocs))


def replay_ops(ops: Sequence[int], capacity_bytes: int, config: Optional[AllocatorConfig] = None,
               stream: int = 0) -> ReplayResult:
    """`replay` of a stream already known to be well formed, in its compact form (what memplan's own allocation
    streams replay: no per-event checks, no tuples): `ops` a sequence of ints, n >= 0 allocating n bytes (the
    k-th allocation is tensor k, counting from 0), ~k (negative) freeing tensor k; every event on `stream`. The
    same state, rules and result as `replay` of the events ("alloc", k, n, stream) / ("free", k, 0, stream); under
    PyTorch's default settings the hot path written out (`_replay_plain`)."""
    state = CachingAllocatorModel(capacity_bytes, config)
    if _plain(state.config):
        return _replay_plain(state, ops, stream)
    blocks: list[Optional[Block]] = []
    keep, malloc, free = blocks.append, state.malloc, state.free
    oom = None
    at_peak = (0, 0)
    replayed = len(ops)
    for index, op in enumerate(ops):
        if op < 0:
            block = blocks[~op]
            if block is not None:
                free(block)
        elif op:
            block = malloc(op, stream)
            if block is None:
                rounded, segment = state.last_failure
                oom = OutOfMemory(index, len(blocks), stream, op, rounded, segment, state.allocated, state.reserved,
                                  capacity_bytes)
                replayed = index
                break
            keep(block)
            if state.peak_moved:
                state.peak_moved = False
                at_peak = (state.inactive_split, state.segments)
        else:
            keep(None)
    return _result(state, at_peak, replayed, oom)


def _plain(config: AllocatorConfig) -> bool:
    """PyTorch's defaults as far as a cached block's reuse goes (any roundup_power2_divisions): no expandable
    segments, no max_split_size, no memory fraction (so no garbage collection)."""
    return not (config.expandable_segments or config.max_split_size_set or config.memory_fraction is not None)


def _replay_plain(state: CachingAllocatorModel, ops: Sequence[int], stream: int) -> ReplayResult:
    """`replay_ops` under `_plain` settings, the loop of memplan's own streams, with the hot path written out: an
    allocation a cached block serves (`get_free_block`'s best fit, which under these settings takes the first block
    of the free list >= size; `should_split`: a remainder of >= 512 B in the small pool, > 1 MiB in the large one),
    one a new segment serves (`CachingAllocatorModel.alloc_block`, then split as a cached block) and a free
    (`try_merge_blocks` with the previous neighbour, then the next, then cached). Everything else, the release and
    retry before an out-of-memory, is `CachingAllocatorModel.malloc` itself. A neighbour merged away is kept and
    reused as the next split's new block (fewer objects made; a freed tensor's id is never used again in a well
    formed stream). The same state and result as the rules' replay: tests/test_allocator.py replays random streams
    both ways (`replay`, which calls the rules, against this)."""
    blocks: list[Optional[Block]] = []
    keep, malloc, alloc_block = blocks.append, state.malloc, state.alloc_block
    config = state.config
    sizes: dict[int, tuple] = {}  # requested -> rounded, pool, least remainder split off, its key, segment size
    shift, small = rules.KEY_SHIFT, rules.SMALL_SIZE_BYTES
    spare: list[Block] = []  # blocks merged away, reused by the next splits
    reuse, spared = spare.pop, spare.append
    oom = None
    at_peak = (0, 0)
    replayed = len(ops)
    allocated = requested = allocated_peak = requested_peak = 0
    inactive, inactive_peak = 0, 0
    for op in ops:  # no event index kept: an out-of-memory finds its event's (`_alloc_position`)
        if op < 0:
            block = blocks[~op]
            if block is None:
                continue
            # DeviceCachingAllocator::free / free_block
            block.allocated = False
            size = block.size
            allocated -= size
            requested -= block.requested
            pool = block.pool
            net = 0
            prev, nxt = block.prev, block.next
            if prev is not None and not prev.allocated:  # try_merge_blocks(block, prev)
                key = prev.size << shift | prev.addr
                keys = pool.keys
                del keys[bisect_left(keys, key)]
                del pool.blocks[key]
                spared(prev)
                block.addr = prev.addr
                size += prev.size
                net -= prev.size
                prev = block.prev = prev.prev
                if prev is not None:
                    prev.next = block
            if nxt is not None and not nxt.allocated:  # try_merge_blocks(block, next)
                key = nxt.size << shift | nxt.addr
                keys = pool.keys
                del keys[bisect_left(keys, key)]
                del pool.blocks[key]
                spared(nxt)
                size += nxt.size
                net -= nxt.size
                nxt = block.next = nxt.next
                if nxt is not None:
                    nxt.prev = block
            block.size = size
            key = size << shift | block.addr
            insort(pool.keys, key)
            pool.blocks[key] = block
            if prev is not None or nxt is not None:
                net += size
            if net:
                inactive += net
                if inactive > inactive_peak:
                    inactive_peak = inactive
            continue
        if not op:
            keep(None)
            continue
        entry = sizes.get(op)
        if entry is None:
            size = rules.round_size(op, config)
            pool = state.pool(rules.get_pool(size, stream))
            entry = sizes[op] = (size, pool, small + 1 if pool.large else rules.MIN_BLOCK_BYTES, size << shift,
                                 rules.get_allocation_size(size))
        size, pool, least, low, segment = entry
        keys = pool.keys
        i = bisect_left(keys, low)
        grew = i == len(keys)
        if not grew:
            block = pool.blocks.pop(keys.pop(i))
        else:  # no cached block: a new segment, or the release and retry, or out of memory
            block = alloc_block(pool, size, segment, False)
            if block is None:
                state.allocated, state.requested = allocated, requested
                state.allocated_peak, state.requested_peak = allocated_peak, requested_peak
                state.inactive_split, state.inactive_split_peak = inactive, inactive_peak
                block = malloc(op, stream)
                allocated, requested = state.allocated, state.requested
                allocated_peak, requested_peak = state.allocated_peak, state.requested_peak
                inactive, inactive_peak = state.inactive_split, state.inactive_split_peak
                if block is None:
                    rounded, segment = state.last_failure
                    index = _alloc_position(ops, len(blocks))
                    oom = OutOfMemory(index, len(blocks), stream, op, rounded, segment, allocated, state.reserved,
                                      state.capacity)
                    replayed = index
                    break
                keep(block)
                if state.peak_moved:
                    state.peak_moved = False
                    at_peak = (inactive, state.segments)
                continue
        # alloc_found_block
        rest_size = block.size - size
        if rest_size >= least:  # split: the request's part is a new block, the rest stays cached
            rest = block
            block = reuse() if spare else Block(0, 0, pool)
            block.addr, block.size, block.pool, block.next = rest.addr, size, pool, rest
            prev = block.prev = rest.prev
            if prev is not None:
                prev.next = block
                inactive -= size  # already split
            elif rest.next is not None:
                inactive -= size
            else:
                inactive += rest_size
                if inactive > inactive_peak:
                    inactive_peak = inactive
            rest.prev = block
            rest.addr += size
            rest.size = rest_size
            key = rest_size << shift | rest.addr
            insort(keys, key)
            pool.blocks[key] = rest
        elif block.prev is not None or block.next is not None:
            inactive -= block.size
        block.allocated = True
        block.requested = op
        allocated += block.size
        requested += op
        if allocated > allocated_peak:
            allocated_peak = allocated
        if requested > requested_peak:
            requested_peak = requested
        keep(block)
        if grew and state.peak_moved:
            state.peak_moved = False
            at_peak = (inactive, state.segments)
    state.allocated, state.requested = allocated, requested
    state.allocated_peak, state.requested_peak = allocated_peak, requested_peak
    state.inactive_split, state.inactive_split_peak = inactive, inactive_peak
    return _result(state, at_peak, replayed, oom)


def _alloc_position(ops: Sequence[int], k: int) -> int:
    """The position in `ops` (replay_ops' compact form) of allocation k (the k-th op >= 0, counting from 0)."""
    left = k
    for index, op in enumerate(ops):
        if op >= 0:
            if not left:
                return index
            left -= 1
    raise MemplanError(f"the stream has no allocation {k}")
