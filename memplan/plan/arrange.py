"""What a user reads of a search (`arrange`): the plans that fit, ordered by step time or by device memory,
with the variants of a plan folded into one row (`FOLDING_RULE`, also in `memplan search --help`), decided
on every plan's numbers (`SearchResult.evaluated`, the same as `evaluate` gives); the plans shown are
evaluated on their own, as the search's top list is.
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np

from memplan.core.errors import MemplanError
from memplan.plan.fit import within_budget
from memplan.plan.search import Listed, SearchResult

# --- the listing: order and fold ----------------------------------------------------------------
SORTS = ("time", "memory")


FOLDING_RULE = """\
Folding: a row is a plan (t, p, d, b, m, SP, recompute) shown with the
best-ranked of its ZeRO variants that fit. Folded into the row are
  +n ZeRO  the same plan with another ZeRO stage or shard group (ZeRO 1 =
           the distributed optimizer, 2/8 = sharded over groups of 8)
           that fits and ranks lower (and is not folded as below);
  +n rec   plans that differ from one of the row's plans only in the
           recompute choice (none, selective, full on k layers) and are
           no faster and need no less device memory, both exactly as
           estimated: nothing to gain from them (only with step times).
Every other difference makes a row of its own."""


def arrange(result: SearchResult, sort: str = "time", fold: bool = True, top: int = 10) -> SearchResult:
    """Order the plans that fit (`sort` "time": by step time, then device memory, then plan number,
    the search's own ranking; "memory": by device memory, then step time, then plan number), fold
    their variants into rows (`FOLDING_RULE`) unless `fold` is False, and keep the first `top` rows:
    `result.listing`, with `result.top` its plans. Without step times both orders are by memory.
    Reads every plan's numbers (`result.evaluated`) unless the search's own top list is asked for."""
    if sort not in SORTS:
        raise MemplanError(f"sort must be one of {', '.join(SORTS)} (got {sort!r})")
    start = time.perf_counter()
    result.sort, result.folded = sort if result.gpu is not None else "memory", fold
    if not fold and (sort == "time" or result.gpu is None) and len(result.top) >= min(top, result.feasible):
        result.top = result.top[:max(top, 0)]
        result.listing = [Listed(i) for i in result.top]
        return result
    e = result.evaluated
    device = np.asarray(e.device_bytes)
    idx = np.flatnonzero(within_budget(e, result.budget_bytes, result.host_budget_bytes))
    dev = device[idx]
    step = None if e.step_time_s is None else np.asarray(e.step_time_s)[idx]
    by_time = None if step is None else np.lexsort((idx, dev, step))
    if step is None:
        order = np.lexsort((idx, dev))
    else:
        order = by_time if sort == "time" else np.lexsort((idx, step, dev))
    if not fold:
        listing = [Listed(int(idx[j])) for j in order[:max(top, 0)]]
    else:
        listing, result.distinct_fit = _fold(result, idx, dev, by_time, order, top)
    result.listing = listing
    result.top = [x.plan for x in listing]
    missing = [i for i in result.top if i not in result.exact]
    if missing:  # the rows' numbers, as `evaluate` gives them, in one call
        result.exact.update(result.evaluate_plans(missing))
    result.seconds += time.perf_counter() - start
    return result


def _fold(result: SearchResult, idx: np.ndarray, dev: np.ndarray, by_time: Optional[np.ndarray],
          order: np.ndarray, top: int) -> tuple[list[Listed], int]:
    """The first `top` rows of `FOLDING_RULE` over the plans `idx` that fit (device memory `dev`;
    positions in idx in the order of (time, memory, number) `by_time`, None without step times, and
    in the listing's `order`), and how many rows there are."""
    n = len(idx)
    if not n:
        return [], 0
    row, sib = _variant_keys(result, idx)
    dominator = np.arange(n)  # per plan: itself, or the kept plan it is folded into as a recompute variant
    if by_time is not None:
        # Recompute siblings (the same plan and ZeRO variant) in the order of (time, memory, number):
        # a plan is dominated when an earlier sibling needs no more memory, and folds into the earliest
        # of the least memory before it (which no earlier sibling dominates). r ranks by (memory,
        # position in o); a running minimum of r per set finds it: subtracting set x n makes every
        # earlier set's values larger.
        o = by_time[np.argsort(sib[by_time], kind="stable")]
        s_o = sib[o]
        seg = np.cumsum(np.concatenate(([0], s_o[1:] != s_o[:-1])))
        by_memory = o[np.argsort(dev[o], kind="stable")]
        r = np.empty(n, dtype=np.int64)
        r[by_memory] = np.arange(n)
        least = np.minimum.accumulate(r[o] - seg * n) + seg * n
        dominator[o] = by_memory[least]
    kept = dominator == np.arange(n)
    family = row[dominator]
    ranked_kept = order[kept[order]]
    _, first = np.unique(row[ranked_kept], return_index=True)  # (return_index: no numpy.ma import)
    shown = ranked_kept[np.sort(first)][:max(top, 0)]  # each row's best kept plan, in listing order
    by_family = order[np.argsort(family[order], kind="stable")]  # each family together, in listing order
    sorted_family = family[by_family]
    lo = np.searchsorted(sorted_family, row[shown], side="left")
    hi = np.searchsorted(sorted_family, row[shown], side="right")
    listing = []
    for j, a, b in zip(shown, lo, hi):
        members = by_family[a:b]
        listing.append(Listed(int(idx[j]),
                              tuple(int(idx[i]) for i in members if kept[i] and i != j),
                              tuple(int(idx[i]) for i in members if not kept[i])))
    return listing, len(first)


def _variant_keys(result: SearchResult, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per plan: a number shared by its ZeRO variants (the plan without its ZeRO variant: its row of
    the space) and one shared by its recompute siblings (the plan without its recompute choice: in
    the space, consecutive plan numbers, keyed by the first)."""
    if result.space is not None:
        space = result.space
        row, _ = space.locate(idx)
        g = np.searchsorted(space.group_offset, idx, side="right") - 1
        return row, idx - (idx - space.group_offset[g]) % space.group_r[g]
    x = result.evaluated.plans.take(idx)
    shape = [np.asarray(v) for v in (x.t, x.p, x.d, x.m, x.b, x.sp, x.cp, x.ep, x.expert_tp, x.first_layers,
                                     x.last_layers) if v is not None]
    if result.compiled is not None:  # torchtitan: compiled and eager plans are rows of their own
        shape.append(np.asarray(result.compiled)[idx].astype(np.int64))
    if result.float8 is not None:  # torchtitan --float8 any: each recipe's plans too
        shape.append(np.unique(np.asarray(result.float8)[idx], return_inverse=True)[1].astype(np.int64))
    if result.memory_budget is not None:  # torchtitan: each memory budget's plans too
        shape.append(np.round(np.nan_to_num(np.asarray(result.memory_budget)[idx], nan=-1.0) * 10).astype(np.int64))
    if getattr(x.schedule, "ndim", 0):  # torchtitan: each pipeline schedule's plans rows of their own
        shape.append((np.asarray(x.schedule) == "GPipe").astype(np.int64))
    return (_group_ids(shape + [np.asarray(x.recompute), np.asarray(x.recomputed_layers)]),
            _group_ids(shape + [np.asarray(x.zero), np.asarray(x.shard)]))


def _group_ids(columns: list[np.ndarray]) -> np.ndarray:
    """Per element, a number shared by exactly the elements equal in every column."""
    n = len(columns[0])
    order = np.lexsort(columns[::-1])
    new = np.zeros(n, dtype=bool)
    new[:1] = True
    for c in columns:
        c = c[order]
        new[1:] |= c[1:] != c[:-1]
    ids = np.empty(n, dtype=np.int64)
    ids[order] = np.cumsum(new) - 1
    return ids
