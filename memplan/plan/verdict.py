"""The caching allocator's verdict on a search's listing: every listed plan is replayed (memory/reserved.py) as
`estimate` replays it, and a plan whose run dies in the replay is taken out of the listing, so every plan listed
is one `estimate` says fits. The count of plans that fit stays the vectorised bound's (allocated peak + the
margin + runtime within the budget): plans not listed are not replayed, and the search says so."""

from __future__ import annotations

from typing import Optional

from memplan.memory.reserved import allocator_label
from memplan.memory.stream import not_streamed
from memplan.memory.term_bytes import PlanValues
from memplan.plan.estimate import device_bytes
from memplan.plan.search import SearchResult


def replay_listing(result: SearchResult, allocator: str = "default", alloc_conf: Optional[str] = None) -> SearchResult:
    """Replay the listed plans of an arranged search; drop those whose run dies, and say what was replayed."""
    listing = result.listed()
    if not listing:
        return result
    kept, replayed = [], 0
    for row in listing:
        config = result.config(row.plan)
        if not_streamed(config.training, PlanValues.from_config(config)):
            kept.append(row)
            continue
        replayed += 1
        if device_bytes(config, result.impl, "cuda", result.gpu, result.margin, result.budget_bytes, allocator,
                        alloc_conf) <= result.budget_bytes:
            kept.append(row)
    dropped = len(listing) - len(kept)
    result.listing, result.top = kept, [row.plan for row in kept]
    conf = allocator_label(allocator, alloc_conf)
    result.notes.append(
        f"{replayed} of the {len(listing)} listed plans replayed through PyTorch's caching allocator ({conf}; derived, "
        "not measured)" + (f": {dropped} died in the replay and are left out" if dropped else
                           (": each completes" if replayed else ""))
        + ("; the others (interleaved stages, cp, ZeRO-3, offload) have no allocation stream yet"
           if replayed < len(listing) else "")
        + "; the count of plans that fit is the bound allocated peak + margin + runtime, not replayed")
    return result
