"""memplan's side of the comparisons of its allocation stream with the traced order of the real code and with CUDA
recordings (validation/layer_match.py measures the recordings and the trace; validation/ never imports memplan, so
what reads memplan's stream lives here): a decoder layer's allocations in memplan's derived stream, by piece; for
torchtitan, its last step as a stream of its own and the order of two streams' allocations aligned
(tests/test_titan_alloc.py against validation/titan_alloc.py's recordings).
"""

from __future__ import annotations

from collections import Counter
from difflib import SequenceMatcher

from memplan.inventory.step_order import PIECES
from memplan.memory.stream_events import Alloc, AllocationStream


def memplan_pieces(stream: AllocationStream, layer: int) -> dict[str, list[int]]:
    """memplan's stream's (memplan/memory/stream.py ``AllocationStream``) allocations of decoder layer ``layer``
    (0-based) in its last step, by piece."""
    start = dict(stream.phases)[f"step {max(int(n.split()[-1]) for n, _ in stream.phases if n.startswith('step '))}"]
    events = stream.events[start:]
    tags = (f"layer {layer + 1},", f"layer {layer + 1})")
    out: dict[str, list[int]] = {p: [] for p in PIECES}
    backward = False
    for e in events:
        if type(e) is not Alloc:
            continue
        backward = backward or "backward" in e.name
        if not any(t in e.name for t in tags):
            continue
        out["rerun" if "recomputed" in e.name else "backward" if backward else "forward"].append(e.size)
    return out


# -- torchtitan: memplan's step against a recording of the real step (validation/titan_alloc.py) ------------------------
def last_step(stream: AllocationStream) -> tuple[list[tuple[str, int, int, int]], list[str]]:
    """memplan's stream's last step as a stream of its own, as validation/titan_alloc.py records the real one: an
    allocation of each tensor alive at the step's start (in the order made), then the step's events to the end
    (the optimizer step included); with each event's name (a free: its tensor's)."""
    last = max(int(n.split()[-1]) for n, _ in stream.phases if n.startswith("step "))
    start = dict(stream.phases)[f"step {last}"]
    made: dict[int, Alloc] = {}
    for e in stream.events[:start]:
        if type(e) is Alloc:
            made[e.id] = e
        else:
            made.pop(e.id, None)
    events = [("alloc", a.id, a.size, 0) for a in made.values() if a.size]
    names = [a.name for a in made.values() if a.size]
    for e in stream.events[start:]:
        if type(e) is Alloc:
            made[e.id] = e
            if e.size:
                events.append(("alloc", e.id, e.size, 0))
                names.append(e.name)
        elif made[e.id].size:
            events.append(("free", e.id, 0, 0))
            names.append(made[e.id].name)
    return events, names


def kept(events: list, labels: list[str], inside) -> list[int]:
    """The sizes, in order, of the allocations made at events whose label satisfies `inside` and alive after the last
    such event (a layer's forward: what it keeps)."""
    at = [k for k, w in enumerate(labels) if inside(w)]
    if not at:
        return []
    sizes: dict[int, int] = {}
    for k in range(at[0], at[-1] + 1):
        op, i, n, _ = events[k]
        if op == "alloc" and inside(labels[k]):
            sizes[i] = n
        elif op == "free":
            sizes.pop(i, None)
    return list(sizes.values())


def alignment(ours: list[int], real: list[int]) -> tuple[int, Counter, Counter]:
    """The two allocation-size sequences aligned (difflib's longest matching blocks, in order): how many allocations
    match, and the sizes only memplan's / only the recording's make (Counters)."""
    blocks = SequenceMatcher(None, ours, real, autojunk=False).get_matching_blocks()
    matched = sum(b.size for b in blocks)
    mine, theirs = Counter(ours), Counter(real)
    for b in blocks:
        for n in ours[b.a:b.a + b.size]:
            mine[n] -= 1
            theirs[n] -= 1
    return matched, +mine, +theirs
