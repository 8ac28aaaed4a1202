"""Does the caching allocator's state repeat over a stage's steady state? (issue 20 item 4: a replay could jump over
the repeats, exactly, if it did.) For each plan the 530B / 2,240-GPU search replays (its listing): the share of the
stream's events in the steady state's (forward, backward) pairs (`AllocationStream.periods`), and how many pairs end
in a state with the counters they started with (reserved, allocated, requested, their peaks, inactive split bytes,
segments), the same free lists, free blocks of the same sizes, and how far the free blocks moved (bytes of address:
the state repeats up to a translation where they all move by one offset). Each stream is replayed through the rules
(`CachingAllocatorModel.malloc` / `free`), slower than replay_ops.

    PYTHONPATH=. python benchmarks/replay_period.py
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

import memplan.plan.stage_verdict as verdict_module
from memplan import search
from memplan.memory.allocator import CachingAllocatorModel
from memplan.memory.alloc_rules import KEY_SHIFT


def listed_streams() -> list:
    """(stream, ops, capacity) of each plan the search replays."""
    out, replay_run = [], verdict_module.replay_run

    def capture(stream, capacity, settings, try_expandable=True, ops=None):
        out.append((stream, stream.ops() if ops is None else ops, capacity))
        return replay_run(stream, capacity, settings, try_expandable, ops=ops)

    verdict_module.replay_run = capture
    try:
        search("gpt3-530b", gpus=2240, mem="80GB")
    finally:
        verdict_module.replay_run = replay_run
    return out


def state(model: CachingAllocatorModel) -> tuple:
    counters = (model.reserved, model.reserved_peak, model.allocated, model.allocated_peak, model.requested,
                model.requested_peak, model.inactive_split, model.inactive_split_peak, model.segments)
    low = (1 << KEY_SHIFT) - 1
    free = {key: [(k >> KEY_SHIFT, k & low) for k in pool.keys] for key, pool in model.pools.items()}
    return counters, free


def offsets(a: dict, b: dict) -> Optional[Counter]:
    """How far each free block moved from a to b (the blocks of a pool paired in (size, address) order); None when
    the pools or the free blocks' sizes differ."""
    if a.keys() != b.keys():
        return None
    out: Counter = Counter()
    for key in a:
        x, y = a[key], b[key]
        if [size for size, _ in x] != [size for size, _ in y]:
            return None
        out.update(q - p for (_, p), (_, q) in zip(x, y) if q != p)
    return out


def measure(ops: list[int], capacity: int, pairs: tuple) -> Counter:
    """At each pair's start and end, the allocator's state; a pair's end state against its start's."""
    marks = {x for pair in pairs for x in pair}
    model, blocks, states, seen = CachingAllocatorModel(capacity), [], {}, Counter()
    for position, op in enumerate(ops + [0]):
        if position in marks:
            states[position] = state(model)
        if position == len(ops):
            break
        if op < 0:
            if blocks[~op] is not None:
                model.free(blocks[~op])
        else:
            blocks.append(model.malloc(op) if op else None)
            if op and blocks[-1] is None:
                seen["out of memory"] += 1
                break
    for start, end in pairs:
        if start in states and end in states:
            before, after = states[start], states[end]
            seen["pairs"] += 1
            seen["counters equal"] += after[0] == before[0]
            seen["free lists equal"] += after[1] == before[1]
            moves = offsets(before[1], after[1])
            if moves is not None:
                seen["free blocks of the same sizes"] += 1
                seen.update({("moved by", k): n for k, n in moves.items()})
    return seen


def main() -> None:
    for stream, ops, capacity in listed_streams():
        pairs = stream.periods
        seen = measure(ops, capacity, pairs)
        steady = sum(end - start for start, end in pairs) / len(ops)
        moves = sorted(((n, k[1]) for k, n in seen.items() if isinstance(k, tuple)), reverse=True)[:3]
        print(f"stage {stream.stage}, {len(ops):,} events, {len(pairs)} steady pairs in its 2 steps ({steady:.0%} of "
              f"the events); pairs whose end state has the start's counters {seen['counters equal']}, free lists "
              f"{seen['free lists equal']}, free blocks of the same sizes {seen['free blocks of the same sizes']}; "
              "the moves most seen (blocks x bytes): " + ", ".join(f"{n} x {k:+,d}" for n, k in moves)
              + " (ran out of memory)" * bool(seen["out of memory"]))


if __name__ == "__main__":
    main()
