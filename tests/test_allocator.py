"""The caching allocator model (memplan.memory.allocator, alloc_rules, alloc_conf): each rule of PyTorch's
CUDACachingAllocator.cpp with a hand-derived case, a mutation test showing each case fails when the rule is
replaced by a naive one, the config parser (with a fuzz), and properties against a slow reference."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.core.errors import MemplanError
from memplan.memory import alloc_rules
from memplan.memory.alloc_conf import SIZE_MAX, AllocatorConfig, parse_alloc_conf
from memplan.memory.alloc_result import format_size
from memplan.memory.allocator import AllocEvent, CachingAllocatorModel, replay, replay_ops

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
BIG = 4 * GIB  # a capacity nothing here reaches


def run(*ops, capacity=BIG, conf="", fraction=None, ids_are_addresses=False):
    """Replay ops written as ("a", id, size[, stream]) / ("f", id) / ("e",)."""
    events = []
    for op in ops:
        if op[0] == "a":
            events.append(AllocEvent("alloc", op[1], op[2], op[3] if len(op) > 3 else 0))
        elif op[0] == "f":
            events.append(AllocEvent("free", op[1]))
        else:
            events.append(AllocEvent("empty_cache", None))
    return replay(events, capacity, parse_alloc_conf(conf, memory_fraction=fraction), ids_are_addresses)


# ------------------------------------------------------------------------------------------------ scenarios
# Each returns a ReplayResult; the hand derivation is in its comment, the expected values in EXPECTED.


def s_round_512():
    # 1,000 B: round_size -> ceil(1000 / 512) * 512 = 1,024 B allocated, 1,000 requested; small pool, 2 MiB segment
    return run(("a", 1, 1000))


def s_power2_divisions():
    # roundup_power2_divisions:4 -> every bucket has 4 divisions. 1,200,000 B lies in [2^20, 2^21): bucket 0;
    # 1,200,000 > 512 * 4, so the step is 2^20 / 4 = 262,144 and 1,200,000 rounds up to 2^20 + 262,144 =
    # 1,310,720 (without divisions: ceil(1,200,000 / 512) * 512 = 1,200,128)
    return run(("a", 1, 1_200_000), conf="roundup_power2_divisions:4")


def s_pools():
    # 1,000 B -> 1,024 B, <= 1 MiB: small pool, a 2 MiB segment (kSmallBuffer). 1,500,000 B -> 1,500,160 B,
    # > 1 MiB: large pool; no large block cached, < 10 MiB -> a 20 MiB segment (kLargeBuffer). Reserved 22 MiB.
    # (Had the 1.5 MB request gone to the small pool's 2 MiB segment, 2 MiB - 1,024 would have held it.)
    return run(("a", 1, 1000), ("a", 2, 1_500_000))


def s_segment_sizes():
    # 1.5e6 B -> 20 MiB (< 10 MiB: kLargeBuffer); 10 MiB + 1 B on another stream (so that it cannot use the
    # first segment's 19.5 MB left) -> rounded 10 MiB + 512, >= 10 MiB: the segment is rounded up to 2 MiB:
    # 12 MiB. Reserved 32 MiB.
    return run(("a", 1, 1_500_000, 0), ("a", 2, 10 * MIB + 1, 1))


def s_small_segment():
    # 1,000 B -> a 2 MiB segment, not 1,024 B: reserved 2 MiB
    return run(("a", 1, 1000))


def s_streams():
    # 1,000 B on stream 0, freed: a cached 2 MiB segment of stream 0. 1,000 B on stream 1 cannot take it:
    # a second 2 MiB segment; reserved 4 MiB.
    return run(("a", 1, 1000, 0), ("f", 1), ("a", 2, 1000, 1))


def s_best_fit():
    # 30 MiB and 40 MiB segments (>= 10 MiB: exact), both freed. 25 MiB takes the best fit, the 30 MiB block
    # (split: 5 MiB > 1 MiB left); 35 MiB then takes the 40 MiB one: reserved stays 70 MiB.
    # (Worst fit: 25 MiB splits the 40 MiB block, 35 MiB fits nothing: a new 36 MiB segment, 106 MiB.)
    return run(("a", 1, 30 * MIB), ("a", 2, 40 * MIB), ("f", 1), ("f", 2), ("a", 3, 25 * MIB), ("a", 4, 35 * MIB))


def s_split_large_remainder():
    # 11 MiB + 1 B -> 11 MiB + 512, segment 12 MiB; the remainder 1 MiB - 512 is not > 1 MiB: no split,
    # the block is handed out whole: allocated 12 MiB
    return run(("a", 1, 11 * MIB + 1))


def s_split_small_remainder():
    # small pool: 1 MiB splits the 2 MiB segment (1 MiB left >= 512); 1 MiB - 512 leaves exactly 512 B,
    # still split; a 512 B request takes that remainder: one segment, reserved 2 MiB, allocated 2 MiB
    return run(("a", 1, MIB), ("a", 2, MIB - 512), ("a", 3, 512))


def s_merge():
    # 5 MiB twice from one 20 MiB segment: [a 5][b 5][free 10]. Free a, free b: b merges with a and the
    # 10 MiB tail into the whole 20 MiB block, which holds 18 MiB (split, 2 MiB left): reserved 20 MiB.
    # (Unmerged, the free pieces are 5, 5 and 10 MiB: 18 MiB needs a new 18 MiB segment, 38 MiB.)
    return run(("a", 1, 5 * MIB), ("a", 2, 5 * MIB), ("f", 1), ("f", 2), ("a", 3, 18 * MIB))


def s_release_and_retry():
    # capacity 100 MiB: 60 MiB cached after its free; 70 MiB fits no block, 60 + 70 > 100: cudaMalloc fails,
    # release_cached_blocks frees the whole 60 MiB segment, the retry (num_alloc_retries 1) gets 70 MiB.
    return run(("a", 1, 60 * MIB), ("f", 1), ("a", 2, 70 * MIB), capacity=100 * MIB)


def s_oversize_not_split():
    # max_split_size_mb:40. 60 MiB cached; 50 MiB >= 40 MiB may take it (60 < 50 + 20), and a request at or
    # above max_split_size is never split: the block goes out whole, allocated 60 MiB at the end.
    return run(("a", 1, 60 * MIB), ("f", 1), ("a", 2, 50 * MIB), conf="max_split_size_mb:40")


def s_oversize_not_for_small():
    # max_split_size_mb:40. 60 MiB cached; 30 MiB < 40 MiB never takes a block >= 40 MiB: a new 30 MiB
    # segment, reserved 90 MiB
    return run(("a", 1, 60 * MIB), ("f", 1), ("a", 2, 30 * MIB), conf="max_split_size_mb:40")


def s_non_split_rounding():
    # max_split_size_mb:40. 80 MiB cached; 50 MiB: 80 >= 50 + 20 (kLargeBuffer): refused, a new 50 MiB
    # segment, reserved 130 MiB
    return run(("a", 1, 80 * MIB), ("f", 1), ("a", 2, 50 * MIB), conf="max_split_size_mb:40")


def s_release_available():
    # max_split_size_mb:40, capacity 150 MiB: 100 MiB cached; 60 MiB refuses it (100 >= 60 + 20); 100 + 60 >
    # 150; release_available_cached_blocks frees the smallest oversize block >= 60 MiB (the 100 MiB one) and
    # cudaMalloc succeeds without the full release: num_alloc_retries 0
    return run(("a", 1, 100 * MIB), ("f", 1), ("a", 2, 60 * MIB), capacity=150 * MIB, conf="max_split_size_mb:40")


def s_gc():
    # capacity 100 MiB, memory fraction 1.0 (allowed 100 MiB), threshold 0.5 (50 MiB). 60 MiB cached (age
    # stamp 1: one get_free_block call on the large pool). 70 MiB: the 2nd call; no block; reserved 60 > 50:
    # the collection frees blocks of age >= the average (1 >= 1): the 60 MiB segment; cudaMalloc then
    # succeeds at once: num_alloc_retries 0 (without the collection: 60 + 70 > 100, full release, 1 retry)
    return run(("a", 1, 60 * MIB), ("f", 1), ("a", 2, 70 * MIB), capacity=100 * MIB,
               conf="garbage_collection_threshold:0.5", fraction=1.0)


def s_expandable_pages():
    # expandable: 1,000 B maps one 2 MiB page of the small pool's segment; 1.5e6 B one 20 MiB page of the
    # large one (split, 20 MiB - 1,500,160 B left free); 30 MiB: the free tail plus the next page (19,471,360 +
    # 20 MiB >= 30 MiB): reserved 2 + 20 + 20 = 42 MiB (default allocator: 2 + 20 + 30 = 52 MiB)
    return run(("a", 1, 1000), ("a", 2, 1_500_000), ("a", 3, 30 * MIB), conf="expandable_segments:True")


def s_expandable_unmap():
    # expandable, capacity 100 MiB: 60 MiB on stream 0 maps 3 pages, freed (cached, mapped). 60 MiB on
    # stream 1: its own segment; mapping 3 pages fails (60 + 60 > 100); release_cached_blocks unmaps stream
    # 0's free pages; the retry maps them for stream 1: fits, num_alloc_retries 1
    return run(("a", 1, 60 * MIB, 0), ("f", 1), ("a", 2, 60 * MIB, 1), capacity=100 * MIB,
               conf="expandable_segments:True")


FRAGMENT = (("a", 1, 50 * MIB), ("f", 1), ("a", 2, 20 * MIB), ("a", 3, 20 * MIB), ("f", 2), ("a", 4, 60 * MIB))


def s_fragmentation_default():
    # capacity 100 MiB: a 50 MiB segment holds [free 20][live 20][free 10] (20 MiB blocks split it: 30 and
    # 10 MiB > 1 MiB left). 60 MiB: 50 + 60 > 100 and the segment is not whole: nothing to release: OOM with
    # 20 MiB allocated and 30 MiB reserved but unallocated
    return run(*FRAGMENT, capacity=100 * MIB)


def s_fragmentation_expandable():
    # the same with expandable segments: 3 pages (60 MiB) for 50 MiB, then [free 20][live 20][free 20];
    # 60 MiB: the 20 MiB free tail + 2 more pages: reserved 100 MiB, fits
    return run(*FRAGMENT, capacity=100 * MIB, conf="expandable_segments:True")


def s_segment_count():
    # 1,000 B: a 2 MiB small segment; 30 MiB: a 30 MiB large one (>= 10 MiB, rounded to 2 MiB); freed and
    # empty_cache: the 30 MiB one is released (whole, free; the small one still holds a block); 40 MiB: a new
    # 40 MiB segment. cudaMalloc'd in order 2, 30, 40 MiB; at most 2 at once (segment.all.peak)
    return run(("a", 1, 1000), ("a", 2, 30 * MIB), ("f", 2), ("e",), ("a", 3, 40 * MIB))


def s_segment_count_expandable():
    # the same with expandable segments: one small and one large segment of reserved address space whose pages
    # are mapped (map_block): nothing is cudaMalloc'd, segment.all.peak stays 0 (PyTorch counts no expandable
    # segment); the model's own count (segments_at_reserved_peak) has both
    return run(("a", 1, 1000), ("a", 2, 30 * MIB), ("f", 2), ("e",), ("a", 3, 40 * MIB),
               conf="expandable_segments:True")


# Two equal free blocks, the real addresses: a 40 MiB segment at 8 GiB (address 2^33) holds a (30 MiB) and x (the
# 10 MiB rest: 10 MiB > 1 MiB, split off); b (30 MiB) gets a new segment at 4 GiB (2^32), below it. Reserved 70
# MiB. a and b freed: two free 30 MiB blocks, a's inside a segment x still holds, b's a whole segment. c (30 MiB)
# takes the one at the lower address (BlockComparatorSize: size, then address): b's. d (32 MiB): nothing cached
# fits, 70 + 32 > 72 MiB: release_cached_blocks finds no whole free segment (a's is split), so d dies. The
# model's own addresses put a new large segment below the earlier ones as the driver did in the H100 recordings
# (CachingAllocatorModel.new_address): the same; placed above (memplan before them), c took a's, b's whole segment
# was released and 40 + 32 = 72 fit (s_upward_addresses).
EQUAL_BLOCKS = (("a", 1 << 33, 40 * MIB), ("f", 1 << 33), ("a", 1 << 33, 30 * MIB),
                ("a", (1 << 33) + 30 * MIB, 10 * MIB), ("a", 1 << 32, 30 * MIB), ("f", 1 << 33), ("f", 1 << 32),
                ("a", 5, 30 * MIB), ("a", 6, 32 * MIB))


def s_device_addresses():
    return run(*EQUAL_BLOCKS, capacity=72 * MIB, ids_are_addresses=True)


def s_model_addresses():
    return run(*EQUAL_BLOCKS, capacity=72 * MIB)


def s_upward_addresses():
    with _segments_upward():
        return run(*EQUAL_BLOCKS, capacity=72 * MIB)


@contextlib.contextmanager
def _segments_upward():
    """The model with every new segment above the last (its placement before the H100 recordings)."""
    def upward(self, nbytes):
        self._low += -(-nbytes // (2 * MIB)) * (2 * MIB)
        return self._low

    saved = CachingAllocatorModel.new_address
    CachingAllocatorModel.new_address = upward
    try:
        yield
    finally:
        CachingAllocatorModel.new_address = saved


EXPECTED = {  # scenario: {ReplayResult field: value}
    s_round_512: dict(allocated_peak_bytes=1024, requested_peak_bytes=1000, reserved_peak_bytes=2 * MIB),
    s_power2_divisions: dict(allocated_peak_bytes=1_310_720),
    s_pools: dict(reserved_peak_bytes=22 * MIB, allocated_peak_bytes=1024 + 1_500_160, segments_at_reserved_peak=2),
    s_segment_sizes: dict(reserved_peak_bytes=32 * MIB, allocated_peak_bytes=1_500_160 + 10 * MIB + 512),
    s_small_segment: dict(reserved_peak_bytes=2 * MIB),
    s_streams: dict(reserved_peak_bytes=4 * MIB),
    s_best_fit: dict(reserved_peak_bytes=70 * MIB, allocated_end_bytes=25 * MIB + 35 * MIB),
    s_split_large_remainder: dict(allocated_peak_bytes=12 * MIB, reserved_peak_bytes=12 * MIB),
    s_split_small_remainder: dict(reserved_peak_bytes=2 * MIB, allocated_peak_bytes=2 * MIB),
    s_merge: dict(reserved_peak_bytes=20 * MIB, inactive_split_peak_bytes=15 * MIB),
    s_release_and_retry: dict(reserved_peak_bytes=70 * MIB, num_alloc_retries=1, num_ooms=0),
    s_oversize_not_split: dict(allocated_end_bytes=60 * MIB),
    s_oversize_not_for_small: dict(reserved_peak_bytes=90 * MIB),
    s_non_split_rounding: dict(reserved_peak_bytes=130 * MIB),
    s_release_available: dict(num_alloc_retries=0, reserved_peak_bytes=100 * MIB, reserved_end_bytes=60 * MIB),
    s_gc: dict(num_alloc_retries=0, reserved_end_bytes=70 * MIB),
    s_expandable_pages: dict(reserved_peak_bytes=42 * MIB),
    s_expandable_unmap: dict(num_alloc_retries=1, num_ooms=0, reserved_end_bytes=60 * MIB),
    s_fragmentation_default: dict(num_ooms=1, events_replayed=5, reserved_end_bytes=50 * MIB),
    s_fragmentation_expandable: dict(num_ooms=0, reserved_peak_bytes=100 * MIB),
    s_segment_count: dict(segments_peak=2, segment_allocs=(2 * MIB, 30 * MIB, 40 * MIB)),
    s_segment_count_expandable: dict(segments_peak=0, segment_allocs=(), segments_at_reserved_peak=2),
    s_device_addresses: dict(num_ooms=1, events_replayed=8, num_alloc_retries=1),
    s_model_addresses: dict(num_ooms=1, events_replayed=8, num_alloc_retries=1),
    s_upward_addresses: dict(num_ooms=0, num_alloc_retries=1, reserved_end_bytes=72 * MIB,
                             segment_allocs=(40 * MIB, 30 * MIB, 32 * MIB)),
}


@pytest.mark.parametrize("scenario", list(EXPECTED), ids=lambda f: f.__name__)
def test_rule_by_hand(scenario):
    result = scenario()
    assert {k: getattr(result, k) for k in EXPECTED[scenario]} == EXPECTED[scenario]


def _worst_fit(pool, size, config):
    if pool.keys and pool.blocks[pool.keys[-1]].size >= size:
        block = pool.blocks[pool.keys[-1]]
        pool.remove(block)
        return block
    return None


def _fit_ignoring_max_split(pool, size, config):
    return _plain_best_fit(pool, size)


def _plain_best_fit(pool, size):
    for key in pool.keys:
        block = pool.blocks[key]
        if block.size >= size:
            pool.remove(block)
            return block
    return None


NAIVE = [  # (rule, naive replacement, the scenario whose outcome it must change)
    ("round_size", lambda size, config: size, s_round_512),
    ("roundup_power2_next_division", lambda size, divisions: -(-size // 512) * 512, s_power2_divisions),
    ("get_pool", lambda size, stream: (stream, True), s_pools),
    ("get_pool", lambda size, stream: (0, size > MIB), s_streams),
    ("get_allocation_size", lambda size: -(-size // (2 * MIB)) * 2 * MIB, s_segment_sizes),
    ("get_allocation_size", lambda size: size, s_small_segment),
    ("get_free_block", _worst_fit, s_best_fit),
    ("get_free_block", _fit_ignoring_max_split, s_oversize_not_for_small),
    ("get_free_block", _fit_ignoring_max_split, s_non_split_rounding),
    ("should_split", lambda block_size, size, large, config: block_size > size, s_split_large_remainder),
    ("should_split", lambda block_size, size, large, config: block_size - size > MIB, s_split_small_remainder),
    ("should_split", lambda block_size, size, large, config: block_size - size > MIB, s_oversize_not_split),
    ("try_merge_blocks", lambda dst, src, pool: 0, s_merge),
    ("release_cached_blocks", lambda state: True, s_release_and_retry),
    ("release_available_cached_blocks", lambda state, pool, size: False, s_release_available),
    ("garbage_collect_cached_blocks", lambda state: None, s_gc),
    ("expandable_page_size", lambda large: 2 * MIB, s_expandable_pages),
    ("find_expandable_block", None, s_expandable_pages),
    ("unmap_block", lambda state, block: None, s_expandable_unmap),
    ("map_block", None, s_expandable_unmap),
    ("try_allocate_expandable_block", None, s_fragmentation_expandable),
    ("count_cuda_segment", lambda state, size: None, s_segment_count),
]


def _new_segment_each_time(state, pool, size):
    """find_expandable_block that never reuses a segment's unmapped space."""
    saved = pool.unmapped_addrs
    pool.unmapped_addrs = []
    try:
        return ORIGINAL["find_expandable_block"](state, pool, size)
    finally:
        pool.unmapped_addrs = saved + [a for a in pool.unmapped_addrs if a not in saved]
        pool.unmapped_addrs.sort()


def _cuda_malloc_like(state, pool, size):
    """try_allocate_expandable_block as a plain new segment of the rounded size (no pages, no growth)."""
    alloc_size = alloc_rules.get_allocation_size(size)
    if state.reserved + alloc_size > state.capacity:
        return None
    state.segments += 1
    state.grow(alloc_size)
    return alloc_rules.Block(state.new_address(alloc_size), alloc_size, pool)


ORIGINAL = {name: getattr(alloc_rules, name) for name, _, _ in NAIVE}
def _map_ignoring_the_device(state, block, size):
    """map_block that never runs out of physical pages."""
    capacity, state.capacity = state.capacity, 1 << 60
    try:
        return ORIGINAL["map_block"](state, block, size)
    finally:
        state.capacity = capacity


REPLACEMENTS = {"find_expandable_block": _new_segment_each_time, "try_allocate_expandable_block": _cuda_malloc_like,
                "map_block": _map_ignoring_the_device}


def _outcome(result):
    return (result.reserved_peak_bytes, result.allocated_peak_bytes, result.requested_peak_bytes,
            result.allocated_end_bytes, result.reserved_end_bytes, result.num_alloc_retries, result.fits,
            result.segments_peak, result.segment_allocs)


@pytest.mark.parametrize("rule, naive, scenario", NAIVE, ids=[f"{r}-{s.__name__}" for r, _, s in NAIVE])
def test_a_naive_rule_changes_the_outcome(monkeypatch, rule, naive, scenario):
    right = _outcome(scenario())
    monkeypatch.setattr(alloc_rules, rule, naive or REPLACEMENTS[rule])
    assert _outcome(scenario()) != right


def test_every_rule_has_a_mutation():
    rules = {"round_size", "roundup_power2_next_division", "get_pool", "get_allocation_size", "get_free_block",
             "should_split", "try_merge_blocks", "release_cached_blocks", "release_available_cached_blocks",
             "garbage_collect_cached_blocks", "expandable_page_size", "find_expandable_block", "unmap_block", "map_block",
             "try_allocate_expandable_block", "count_cuda_segment"}
    assert rules == {r for r, _, _ in NAIVE}


# ------------------------------------------------------------------------------------------------ details


def test_the_out_of_memory_says_what_pytorch_would():
    # s_fragmentation_default: the 60 MiB request (event 5) asks for a 60 MiB segment; after the release
    # 20 MiB are allocated and the 50 MiB segment stays: 30 MiB reserved but unallocated
    result = s_fragmentation_default()
    oom = result.oom
    assert (oom.event_index, oom.tensor_id, oom.requested_bytes, oom.tried_to_allocate_bytes) == (5, 4, 60 * MIB,
                                                                                                60 * MIB)
    assert (oom.allocated_bytes, oom.reserved_bytes, oom.reserved_unallocated_bytes) == (20 * MIB, 50 * MIB,
                                                                                         30 * MIB)
    assert "Tried to allocate 60.00 MiB" in oom.message
    assert "20.00 MiB is allocated by PyTorch, and 30.00 MiB is reserved by PyTorch but unallocated" in oom.message
    assert result.num_alloc_retries == 1 and not result.fits


def test_device_addresses_must_be_addresses():
    with pytest.raises(MemplanError, match="device address"):
        run(("a", "t", 30 * MIB), ids_are_addresses=True)
    with pytest.raises(MemplanError, match="left the recording"):  # the 30 MiB segment is cached, still at 2^32
        run(("a", 1 << 32, 30 * MIB), ("f", 1 << 32), ("a", 1 << 32, 40 * MIB), ids_are_addresses=True)


def test_tried_to_allocate_is_the_segment_size():
    # capacity 10 MiB: 1.5e6 B needs a 20 MiB segment; PyTorch's message names the 20 MiB, not the request
    oom = run(("a", 1, 1_500_000), capacity=10 * MIB).oom
    assert oom.tried_to_allocate_bytes == 20 * MIB and oom.rounded_bytes == 1_500_160


def test_inactive_split_at_the_reserved_peak():
    # s_merge: after a (5 MiB of a 20 MiB segment) the reserved peak of 20 MiB is set with 15 MiB free inside
    # the split segment; b leaves 10 MiB; freeing a makes it 15 MiB again; freeing b merges all: 0
    result = s_merge()
    assert result.inactive_split_bytes_at_reserved_peak == 15 * MIB
    assert result.segments_at_reserved_peak == 1


def test_expandable_fragmentation_is_bounded_by_pages():
    # after FRAGMENT's first 5 events and empty_cache: default keeps the whole 50 MiB segment (one live
    # 20 MiB block in it); expandable unmaps the free pages and keeps only the one 20 MiB page under the live block
    ops = FRAGMENT[:5] + (("e",),)
    assert run(*ops).reserved_end_bytes == 50 * MIB
    assert run(*ops, conf="expandable_segments:True").reserved_end_bytes == 20 * MIB


def test_memory_fraction_caps_the_reserved_memory():
    # fraction 0.5 of 100 MiB: 50 MiB allowed; a 60 MiB segment is refused although the device has room
    assert not run(("a", 1, 60 * MIB), capacity=100 * MIB, fraction=0.5).fits
    assert run(("a", 1, 60 * MIB), capacity=100 * MIB).fits


def test_garbage_collection_needs_a_memory_fraction():
    # s_gc without the fraction: the threshold does nothing, the full release and its retry happen
    result = run(("a", 1, 60 * MIB), ("f", 1), ("a", 2, 70 * MIB), capacity=100 * MIB,
                 conf="garbage_collection_threshold:0.5")
    assert result.num_alloc_retries == 1


def test_roundup_list_form_buckets_follow_the_code():
    # [256:1,512:2,1024:4,>:8]: bucket i holds sizes in [2^(20+i), 2^(21+i)); 256 -> bucket 8 (and every
    # bucket below, the first entry), 512 -> 9, 1024 -> 10, '>' -> 11..15
    config = parse_alloc_conf("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
    assert config.roundup_power2_divisions == (1,) * 9 + (2, 4) + (8,) * 5
    # 600 MiB + 1 B: bucket 9 ([512 MiB, 1 GiB)): 2 divisions, step 256 MiB -> 768 MiB. (PyTorch's docs say 4
    # divisions for 512 MB - 1 GB, which would give 640 MiB; the parser gives bucket 9 the value of "512".)
    assert alloc_rules.round_size(600 * MIB + 1, config) == 768 * MIB
    # 300 MiB + 1 B: bucket 8, 1 division: plain 512-byte rounding
    assert alloc_rules.round_size(300 * MIB + 1, config) == 300 * MIB + 512


def test_roundup_power2_next_division_examples():
    # PyTorch's comment: 1200 with 4 divisions -> 1280 (steps 1024, 1280, 1536, 1792)
    assert alloc_rules.roundup_power2_next_division(1200, 4) == 1280
    assert alloc_rules.roundup_power2_next_division(2048, 4) == 2048
    # but round_size uses divisions only when size > 512 * divisions: 1200 <= 2048 -> 1536
    assert alloc_rules.round_size(1200, parse_alloc_conf("roundup_power2_divisions:4")) == 1536


def test_format_size():
    assert [format_size(n) for n in (1024, 1025, MIB, MIB + 1, GIB + 1)] == [
        "1024 bytes", "1.00 KiB", "1024.00 KiB", "1.00 MiB", "1.00 GiB"]


@pytest.mark.parametrize("events, why", [
    ([("alloc", 1, 10, 0), ("alloc", 1, 10, 0)], "already live"),
    ([("free", 1, 0, 0)], "not live"),
    ([("grow", 1, 0, 0)], "unknown op"),
    ([("alloc", 1, -5, 0)], "negative"),
    ([("alloc", 1, 1.5, 0)], "integer"),
    ([("alloc", 1)], "expected"),
])
def test_bad_events_raise_memplan_error(events, why):
    with pytest.raises(MemplanError, match=why):
        replay(events, BIG)


def test_zero_bytes_take_no_memory():
    assert run(("a", 1, 0), ("f", 1)).reserved_peak_bytes == 0


def test_cuda_malloc_async_is_refused():
    with pytest.raises(MemplanError, match="cudaMallocAsync"):
        replay([], BIG, parse_alloc_conf("backend:cudaMallocAsync"))


# ------------------------------------------------------------------------------------------------ config


def test_parse_the_example():
    config = parse_alloc_conf("max_split_size_mb:512,roundup_power2_divisions:4,expandable_segments:True,"
                              "garbage_collection_threshold:0.8")
    assert config == AllocatorConfig(max_split_size_bytes=512 * MIB, roundup_power2_divisions=(4,) * 16,
                                     expandable_segments=True, garbage_collection_threshold=0.8)


def test_parse_defaults_and_extras():
    assert parse_alloc_conf("") == AllocatorConfig()
    assert parse_alloc_conf("") .max_split_size_bytes == SIZE_MAX
    config = parse_alloc_conf(" max_non_split_rounding_mb : 40 , backend:native, pinned_num_register_threads:8,",
                              memory_fraction=0.9)
    assert (config.max_non_split_rounding_bytes, config.memory_fraction) == (40 * MIB, 0.9)
    # the last of a repeated key wins, as in PyTorch
    assert parse_alloc_conf("expandable_segments:True,expandable_segments:False").expandable_segments is False


@pytest.mark.parametrize("text, named", [
    ("max_split_size_mb:10", "max_split_size_mb 10 is too small"),
    ("max_non_split_rounding_mb:4", "max_non_split_rounding_mb 4 is too small"),
    ("max_split_size_mb:abc", "'abc'"),
    ("max_split_size_mb", "after max_split_size_mb"),
    ("max_split_size_mb:", "a value for max_split_size_mb"),
    ("foo:1", "unrecognized key 'foo'"),
    ("expandable_segments:yes", "'yes'"),
    ("garbage_collection_threshold:1.5", "'1.5'"),
    ("garbage_collection_threshold:nan", "'nan'"),
    ("roundup_power2_divisions:3", "3 is not a power of 2"),
    ("roundup_power2_divisions:[256:3]", "256:3"),
    ("roundup_power2_divisions:[300:2]", "'300'"),
    ("roundup_power2_divisions:[256:1", "not closed"),
    ("backend:other", "'other'"),
    ("max_split_size_mb:512 expandable_segments:True", "'512expandable_segments'"),
])
def test_bad_config_names_key_and_value(text, named):
    with pytest.raises(MemplanError) as err:
        parse_alloc_conf(text)
    assert named in str(err.value) and "\n" not in str(err.value)


TOKENS = st.sampled_from(["max_split_size_mb", "max_non_split_rounding_mb", "roundup_power2_divisions",
                          "expandable_segments", "garbage_collection_threshold", "backend", "True", "False",
                          ":", ",", "[", "]", ">", " ", "0", "1", "2", "20", "256", "512", "0.5", "1e400",
                          "9" * 30, "native", "-1", "x"])


@settings(max_examples=400, deadline=200)
@given(st.one_of(st.lists(TOKENS, max_size=20).map("".join), st.text(max_size=60)))
def test_parse_fuzz_raises_only_memplan_error(text):
    try:
        config = parse_alloc_conf(text)
    except MemplanError as err:
        assert "\n" not in str(err)
    else:
        assert isinstance(config, AllocatorConfig)


# ------------------------------------------------------------------------------------------------ properties


class Reference:
    """A slow, separate model of the default allocator (optionally with max_split_size): each segment a list
    of [offset, size, live] pieces, best fit by scanning every free piece, written from allocator.md's rules."""

    def __init__(self, capacity, max_split=SIZE_MAX):
        self.capacity, self.max_split = capacity, max_split
        self.segments = []  # [creation index, stream, large, pieces]
        self.created = itertools.count()
        self.reserved = self.allocated = self.requested = 0
        self.peaks = [0, 0, 0, 0]  # reserved, allocated, requested, inactive split
        self.retries = 0

    def inactive_split(self):
        return sum(p[1] for s in self.segments if len(s[3]) > 1 for p in s[3] if not p[2])

    def note(self):
        now = (self.reserved, self.allocated, self.requested, self.inactive_split())
        self.peaks = [max(a, b) for a, b in zip(self.peaks, now)]

    def new_segment(self, nbytes, stream, large):
        if self.reserved + nbytes > self.capacity:
            return None
        segment = [next(self.created), stream, large, [[0, nbytes, False]]]
        self.segments.append(segment)
        self.reserved += nbytes
        return segment, segment[3][0]

    def release(self, segment):
        self.segments.remove(segment)
        self.reserved -= segment[3][0][1]

    def release_oversize(self, stream, large, size):
        if self.max_split == SIZE_MAX:
            return False
        target = max(size, self.max_split)
        free = sorted((p[1], s[0], p[0], s) for s in self.segments if (s[1], s[2]) == (stream, large)
                      for p in s[3] if not p[2])
        above = [f for f in free if f[0] >= target]
        if above:
            if len(above[0][3][3]) > 1:
                return False
            self.release(above[0][3])
            return True
        released = 0
        for nbytes, _, _, segment in reversed(free):
            if released >= target or nbytes < self.max_split:
                break
            if len(segment[3]) == 1:
                self.release(segment)
                released += nbytes
        return released >= target

    def malloc(self, n, stream):
        size = 512 if n < 512 else -(-n // 512) * 512
        large = size > MIB
        segment_bytes = 2 * MIB if not large else 20 * MIB if size < 10 * MIB else -(-size // (2 * MIB)) * 2 * MIB
        free = sorted((p[1], s[0], p[0], s, p) for s in self.segments if (s[1], s[2]) == (stream, large)
                      for p in s[3] if not p[2] and p[1] >= size)
        found = None
        if free:
            nbytes = free[0][0]
            if not (size < self.max_split <= nbytes) and not (size >= self.max_split and nbytes >= size + 20 * MIB):
                found = free[0][3], free[0][4]
        if found is None:
            found = self.new_segment(segment_bytes, stream, large)
            if found is None and self.release_oversize(stream, large, size):
                found = self.new_segment(segment_bytes, stream, large)
            if found is None:
                for segment in [s for s in self.segments if len(s[3]) == 1 and not s[3][0][2]]:
                    self.release(segment)
                self.retries += 1
                found = self.new_segment(segment_bytes, stream, large)
            if found is None:
                return None
        segment, piece = found
        rest = piece[1] - size
        if (not large and rest >= 512) or (large and size < self.max_split and rest > MIB):
            segment[3].insert(segment[3].index(piece) + 1, [piece[0] + size, rest, False])
            piece[1] = size
        piece[2] = True
        self.allocated += piece[1]
        self.requested += n
        self.note()
        return segment, piece, n

    def free(self, handle):
        segment, piece, n = handle
        piece[2] = False
        self.allocated -= piece[1]
        self.requested -= n
        pieces = segment[3]
        merged = [pieces[0]]
        for p in pieces[1:]:
            if not p[2] and not merged[-1][2]:
                merged[-1][1] += p[1]
            else:
                merged.append(p)
        segment[3] = merged
        self.note()


SIZES = st.one_of(st.integers(1, 4 * KIB), st.integers(1, 2 * MIB), st.integers(1, 48 * MIB),
                  st.integers(1, 30).map(lambda k: k * MIB), st.integers(1, 30).map(lambda k: k * MIB + 1))
OPS = st.lists(st.tuples(st.sampled_from("aaaff"), SIZES, st.integers(0, 1), st.integers(0, 10 ** 6)),
               min_size=1, max_size=60)


def _events(ops):
    live, events, ids = [], [], itertools.count()
    for op, size, stream, pick in ops:
        if op == "a":
            tid = next(ids)
            live.append(tid)
            events.append(("alloc", tid, size, stream))
        elif live:
            events.append(("free", live.pop(pick % len(live)), 0, 0))
    return events


@settings(max_examples=300, deadline=None)
@given(OPS, st.integers(8, 200).map(lambda m: m * MIB), st.sampled_from([SIZE_MAX, 20 * MIB, 32 * MIB]))
def test_replay_equals_the_slow_reference(ops, capacity, max_split):
    events = _events(ops)
    result = replay(events, capacity, AllocatorConfig(max_split_size_bytes=max_split))
    ref, live, replayed = Reference(capacity, max_split), {}, len(events)
    for index, (op, tid, size, stream) in enumerate(events):
        if op == "alloc":
            handle = ref.malloc(size, stream)
            if handle is None:
                replayed = index
                break
            live[tid] = handle
        else:
            ref.free(live.pop(tid))
    assert (result.reserved_peak_bytes, result.allocated_peak_bytes, result.requested_peak_bytes,
            result.inactive_split_peak_bytes, result.num_alloc_retries, result.events_replayed, result.fits) == (
        *ref.peaks, ref.retries, replayed, replayed == len(events))


CONFIGS = st.sampled_from(["", "max_split_size_mb:32", "expandable_segments:True", "roundup_power2_divisions:4",
                           "roundup_power2_divisions:[1:2,4:8,>:4]", "garbage_collection_threshold:0.6",
                           "expandable_segments:True,max_split_size_mb:20"])


def _segments(state, live_blocks):
    """Every segment's blocks, walked from the blocks the state knows (free, unmapped, live)."""
    known = list(live_blocks)
    for pool in state.pools.values():
        known += list(pool.blocks.values()) + list(pool.unmapped.values())
    heads = {}
    for block in known:
        while block.prev is not None:
            block = block.prev
        heads[id(block)] = block
    out = []
    for head in heads.values():
        chain, block = [], head
        while block is not None:
            chain.append(block)
            assert block.next is None or block.next.addr == block.addr + block.size
            block = block.next
        out.append(chain)
    return out


@settings(max_examples=200, deadline=None)
@given(OPS, st.integers(8, 200).map(lambda m: m * MIB), CONFIGS, st.sampled_from([None, 0.7, 1.0]))
def test_invariants_at_every_step(ops, capacity, conf, fraction):
    state = CachingAllocatorModel(capacity, parse_alloc_conf(conf, memory_fraction=fraction))
    live = {}
    for op, tid, size, stream in _events(ops):
        if op == "alloc":
            block = state.malloc(size, stream)
            if block is None:
                break
            live[tid] = block
        else:
            state.free(live.pop(tid))
        segments = _segments(state, live.values())
        mapped = sum(b.size for chain in segments for b in chain if b.mapped)
        assert state.allocated == sum(b.size for b in live.values()) <= state.reserved == mapped <= capacity
        assert state.inactive_split == sum(b.size for chain in segments if len(chain) > 1 for b in chain
                                           if not b.allocated and b.seg is None)
        assert all(b.allocated == (b in live.values()) for chain in segments for b in chain)
    for block in live.values():
        state.free(block)
    state.empty_cache()
    assert (state.reserved, state.allocated, state.inactive_split) == (0, 0, 0)
    # what stays is address space: an expandable segment whose map failed before anything was mapped is never
    # in the free list, so release_blocks leaves it (as PyTorch does); it holds no memory
    assert state.segments == sum(1 for pool in state.pools.values() for b in pool.unmapped.values()
                                 if b.prev is None and b.next is None)


def _compact(events):
    """The events as replay_ops takes them (tensor ids renumbered in allocation order: n bytes, ~k frees k)."""
    number, ops = {}, []
    for op, tid, size, _stream in events:
        if op == "alloc":
            number[tid] = len(number)
            ops.append(size)
        else:
            ops.append(~number[tid])
    return number, ops


@settings(max_examples=120, deadline=None)
@given(OPS, st.integers(8, 200).map(lambda m: m * MIB), CONFIGS, st.sampled_from([0, 1]))
def test_replay_ops_is_replay(ops, capacity, conf, stream):
    # the compact replay memplan's own streams take: the same state, rules and result as the checked replay (zero-byte
    # tensors included; every event on one stream), the out-of-memory naming the allocation by its number
    events = [(op, tid, size * (tid % 7 != 3), stream) for op, tid, size, _ in _events(ops)]
    number, compact = _compact(events)
    config = parse_alloc_conf(conf)
    want = replay(events, capacity, config)
    if want.oom is not None:
        want = dataclasses.replace(want, oom=dataclasses.replace(want.oom, tensor_id=number[want.oom.tensor_id]))
    assert replay_ops(compact, capacity, config, stream) == want


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("aaff"), st.one_of(SIZES, st.integers(1, 64).map(lambda k: k * 512 * KIB)),
                          st.integers(0, 1), st.integers(0, 10 ** 6)), min_size=1, max_size=200),
       st.integers(8, 120).map(lambda m: m * MIB), st.sampled_from(["", "roundup_power2_divisions:4"]))
def test_the_written_out_replay_is_the_rules(ops, capacity, conf):
    # replay_ops under PyTorch's defaults runs its own loop (allocator._replay_plain: best fit, split, merge written
    # out): on longer streams than above, near the capacity (new segments, the release and retry, out of memory; sizes in 512 KiB steps, so that a
    # remainder is exactly 1 MiB, kept whole) it ends in the state the rules' replay ends in, with the same result
    events = [(op, tid, size, 0) for op, tid, size, _ in _events(ops)]
    _, compact = _compact(events)
    config = parse_alloc_conf(conf)
    want = replay(events, capacity, config)
    got = replay_ops(compact, capacity, config)
    assert (got.oom is None) == (want.oom is None)
    assert dataclasses.replace(got, oom=None) == dataclasses.replace(want, oom=None)
    if want.oom is not None:
        assert dataclasses.replace(got.oom, tensor_id=0) == dataclasses.replace(want.oom, tensor_id=0)


@pytest.mark.parametrize("ops", [
    [20 * MIB, ~0, 19 * MIB],  # a large block 1 MiB over the request: handed out whole (should_split: > 1 MiB)
    [20 * MIB, ~0, 19 * MIB - 512],  # 1 MiB + 512 B over: split
    [MIB, ~0, 2 * MIB - 512, 512],  # a small segment's last 512 B split off and taken
    [30 * MIB, 30 * MIB, ~0, 12 * MIB, ~1, ~2, 60 * MIB],  # merges with both neighbours, then one block of 60 MiB
])
def test_the_written_out_replay_at_the_split_edges(ops):
    # the edges of should_split and a merge on both sides, which random sizes rarely hit: the written-out replay
    # (allocator._replay_plain) against the rules' replay of the same events
    number, events = itertools.count(), []
    for op in ops:
        events.append(("alloc", next(number), op, 0) if op >= 0 else ("free", ~op, 0, 0))
    assert replay_ops(ops, 200 * MIB) == replay(events, 200 * MIB)
