"""memplan's side of the comparisons of its allocation stream with the traced order of the real code and with CUDA
recordings (validation/layer_match.py measures the recordings and the trace; validation/ never imports memplan, so
what reads memplan's stream lives here): a decoder layer's allocations in memplan's derived stream, by piece.
"""

from __future__ import annotations

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
