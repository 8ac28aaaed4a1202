"""torch 2.13's multi-stage pipeline schedules as torchtitan 0.3.0 runs them (``--impl torchtitan --pp P
--pipeline-schedule Interleaved1F1B|LoopedBFS|InterleavedZeroBubble|ZBVZeroBubble|DualPipeV``): the virtual stages a
rank holds and their layers, the order of its steps, whether torch runs a schedule with M micro-batches, and what a
rank holds at its peak.

Placement (torchtitan distributed/pipeline_parallel.py ``_get_pp_rank_to_stage_indices_mapping``): p m virtual stages
split by `titan_stage_layers` (m = 2 unless pipeline_parallel_layers_per_stage says otherwise:
`titan_stages_per_rank`); rank r holds stages r, r + p, ... ("loop"), or for ZBVZeroBubble and DualPipeV (m = 2)
stages r and 2p - 1 - r ("v": rank 0 holds the embedding and the output).

Order (`rank_order`): torch's ``_calculate_single_rank_operations`` of each class, rewritten without torch (the core
imports none; tests/test_titan_multistage.py builds torch's own ``pipeline_order`` on CPU and compares):
Interleaved1F1B and InterleavedZeroBubble in memplan/memory/pipeline.py `schedule`; LoopedBFS every forward of chunk
0, then of chunk 1, ..., then the backwards chunk by chunk in reverse, micro-batches in reverse; ZBVZeroBubble and
DualPipeV their warm-up / stable / cool-down phases (DualPipeV's overlapped forward + backward runs the forward
first: torch's runtime runs the sub-actions in order). Steps: ("F", micro-batch, local chunk), "B" a whole backward,
"I" / "W" a split one (input gradients, then weight gradients).

What a (micro-batch, chunk) holds (`peak_state`), derived from torch's stage.py / _backward.py and measured over gloo
(validation/titan_pp.py): the forward's saved tensors until its B or W (``stage_backward_input`` runs the input
gradients with retain_graph and keeps the nodes below the weights); what lies above the chunk's last weight (the loss:
``stage_output.detach_()`` after I) until its B or I; from I to W the gradients flowing into the nodes where the input
and weight paths meet (``param_groups``' grads; stage 0 runs no I: its W is the whole backward).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import numpy as np

from memplan.memory.pipeline import schedule, titan_schedule_runs, titan_stage_layers, torch_round

MULTI_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")  # their I / W split (no compile: see options)


def is_multi(kind: Any) -> bool:
    """A multi-stage schedule (a scalar name)."""
    return str(kind) in MULTI_SCHEDULES


def one(x: Any) -> int:
    """The one value of a scalar or of an array whose elements are all equal (a search part's p and m)."""
    values = np.unique(np.asarray(x))
    if values.size != 1:
        raise ValueError(f"a multi-stage schedule is evaluated for one p and m at a time, got {values.tolist()}")
    return int(values[0])


def rank_stages(rank: int, p: int, m: int, kind: str) -> tuple[int, ...]:
    """The virtual stages rank `rank` holds, local chunk 0 first (module docstring)."""
    if kind in V_SCHEDULES:
        return (rank, 2 * p - 1 - rank)
    return tuple(rank + c * p for c in range(m))


def stage_ends(stage: Any, p: Any, kind: Any) -> tuple[Any, Any]:
    """(holds the embedding, holds the output) for pipeline rank `stage`: the first and the last rank, or rank 0 for
    both under the V schedules."""
    return stage == 0, (stage == 0) if str(kind) in V_SCHEDULES else (stage == p - 1)


def rank_chunks(rank: int, p: int, m: int, num_layers: int, kind: str) -> tuple[int, ...]:
    """Decoder layers of each of the rank's chunks (torchtitan's split of the p m virtual stages)."""
    split = titan_stage_layers(p * m, num_layers)
    return tuple(split[s] for s in rank_stages(rank, p, m, kind))


def chunk_dense(rank: int, p: int, m: int, num_layers: int, dense: int, kind: str) -> tuple[int, ...]:
    """Dense first layers (DeepSeek-V3's n_dense_layers, layers.0 .. dense - 1) in each of the rank's chunks:
    torchtitan deals the layers out in order (_generate_llm_fqn_per_model_part), so virtual stage s holds layers
    start_s .. start_s + n_s - 1 and min(n_s, max(0, dense - start_s)) of them are dense; the rest are MoE layers.
    DeepSeek-V3 671B (61 layers, 3 dense) at p = 8, 2 stages a rank: 16 stages of 63 effective layers, stage 0 the
    embedding and 3 layers, so rank 0's chunk 0 holds all 3; at p = 16, stage 0 holds 1 and stage 1 (rank 1) 2."""
    split = titan_stage_layers(p * m, num_layers)
    starts = np.concatenate([[0], np.cumsum(split)[:-1]])
    return tuple(int(min(split[s], max(0, dense - starts[s]))) for s in rank_stages(rank, p, m, kind))


# the multi-stage schedules' rank orders are walked op by op (`rank_states`): bounded time and memory
MAX_MICROBATCHES = 8192


def multi_refusal(p: int, m: int, microbatches: Optional[int], kind: str, compiled: bool = False,
                  moe: bool = False) -> str:
    """Why torch 2.13 does not run `kind` with m stages a rank and M micro-batches (None: any), or memplan does not
    model it ("" when both do): the V schedules take exactly 2 stages a rank (ScheduleZBVZeroBubble,
    ScheduleDualPipeV), DualPipeV at least 2p micro-batches, Interleaved1F1B and InterleavedZeroBubble M a multiple of
    max(1, M // p) (`torch_round`); a split backward through compiled blocks, or through an MoE block (``moe``, Qwen3
    MoE and DeepSeek-V3 alike: the I -> W gradients are the dense Llama block's, memplan/inventory/titan.py
    split_backward_grads), is not modelled. DeepSeek-V3's dense first layers are counted chunk by chunk
    (`chunk_dense`)."""
    if microbatches is not None and microbatches > MAX_MICROBATCHES:
        return (f"memplan walks {kind}'s order micro-batch by micro-batch: modelled up to {MAX_MICROBATCHES:,} "
                f"micro-batches, not {microbatches:,} (raise --micro-batch or --seq-len, lower --global-batch)")
    if kind in V_SCHEDULES and m != 2:
        return f"torch's {kind} takes exactly 2 stages per rank, not {m}"
    if moe and kind in SPLIT_BACKWARD:
        return (f"--pipeline-schedule {kind} with an MoE model is not modelled: the gradients its split backward "
                "holds from I to W are measured for the dense block only (the MoE: 1F1B, GPipe, Interleaved1F1B, "
                "LoopedBFS)")
    if compiled and kind in SPLIT_BACKWARD:
        return (f"--compile with --pipeline-schedule {kind} is not modelled: its split backward (I, then W) runs "
                "through the compiled blocks' one backward node, not traced yet")
    if microbatches is None:
        return ""
    if kind == "DualPipeV" and microbatches < 2 * p:
        return f"torch's DualPipeV needs at least as many micro-batches as stages: {microbatches} for {2 * p}"
    if kind in ("Interleaved1F1B", "InterleavedZeroBubble"):
        try:
            torch_round(p, microbatches)
        except ValueError as e:
            return str(e)
    return ""


def schedule_refusal(p: int, m: int, microbatches: int, kind: str) -> str:
    """Why torch does not run torchtitan's pipeline schedule `kind` with M micro-batches ("" when it does; the
    single-stage ones: memplan/memory/pipeline.py titan_schedule_runs), as one line for the user."""
    if is_multi(kind):
        why = multi_refusal(p, m, microbatches, kind)
        return f"{why}; change --global-batch or --micro-batch, or plan another --pipeline-schedule" if why else ""
    if titan_schedule_runs(p, microbatches, kind):
        return ""
    return (f"torch's Schedule1F1B needs as many micro-batches as stages: {microbatches} for pp {p}; raise "
            "--global-batch, lower --micro-batch or plan --pipeline-schedule GPipe")


def multi_runs(p: Any, m: int, microbatches: Any, kind: str) -> Any:
    """`multi_refusal` as a mask over arrays of p and M (search)."""
    p, micro = np.broadcast_arrays(np.asarray(p), np.asarray(microbatches))
    ok = [not multi_refusal(int(a), m, int(b), kind) for a, b in zip(p.ravel(), micro.ravel())]
    return np.array(ok, dtype=bool).reshape(p.shape)


def _looped_bfs(m: int, microbatches: int) -> list[tuple[str, int, int]]:
    """ScheduleLoopedBFS: every forward of chunk 0, of chunk 1, ...; the backwards from the last chunk, in reverse."""
    return ([("F", mb, c) for c in range(m) for mb in range(microbatches)]
            + [("B", mb, c) for c in reversed(range(m)) for mb in reversed(range(microbatches))])


def _zbv(rank: int, p: int, microbatches: int) -> list[tuple[str, int, int]]:
    """ScheduleZBVZeroBubble._calculate_single_rank_operations (chunk 0 = stage r, chunk 1 = stage 2p - 1 - r); its
    actions past the last micro-batch (it plans max(2p - 1, M)) dropped, as torch does."""
    n = max(2 * p - 1, microbatches)
    out, f, b = [], [0, 0], [0, 0]

    def act(kind: str, c: int, mb: int) -> None:
        out.append((kind, mb, c))

    def fwd(c: int) -> None:
        act("F", c, f[c])
        f[c] += 1
    for _ in range(2 * (p - rank) - 1):
        fwd(0)
    for _ in range(rank):
        fwd(1)
        fwd(0)
    for _ in range(p - rank):
        fwd(1)
        act("I", 1, b[1])
        act("W", 1, b[1])
        b[1] += 1
    while f[1] < f[0] or f[0] < n:
        if f[0] < n:
            fwd(0)
        act("I", 0, b[0])
        act("W", 0, b[0])
        b[0] += 1
        fwd(1)
        act("I", 1, b[1])
        act("W", 1, b[1])
        b[1] += 1
    w = list(b)
    for _ in range(rank):
        act("I", 0, b[0])
        b[0] += 1
        act("I", 1, b[1])
        b[1] += 1
    for _ in range(p - rank):
        act("I", 0, b[0])
        b[0] += 1
        act("W", 0, w[0])
        w[0] += 1
    out += [("W", mb, 1) for mb in range(w[1], b[1])] + [("W", mb, 0) for mb in range(w[0], b[0])]
    return [x for x in out if x[1] < microbatches]


def _dualpipev(rank: int, p: int, microbatches: int) -> list[tuple[str, int, int]]:
    """ScheduleDualPipeV._calculate_single_rank_operations (chunk 0 = stage r, chunk 1 = stage 2p - 1 - r): an
    overlapped forward + backward as the forward then the whole backward; a W queued by each I, run oldest first."""
    out: list = []
    count: dict = {}
    queue: list = []

    def act(c: int, kind: str) -> None:
        key = (c, "F" if kind == "F" else "I")
        mb = count.get(key, 0)
        out.append((kind, mb, c))
        count[key] = mb + 1
        if kind == "I":
            queue.append((c, mb))

    def weight() -> None:
        if queue:
            c, mb = queue.pop(0)
            out.append(("W", mb, c))
    for _ in range(2 * (p - rank - 1)):
        act(0, "F")
    for _ in range(rank + 1):
        act(0, "F")
        act(1, "F")
    for _ in range(p - rank - 1):
        act(1, "I")
        weight()
        act(1, "F")
    for i in range(microbatches - 2 * p + rank + 1):
        act(0, "F")
        act(1, "B")  # the first on the last rank is not overlapped: the same order
        act(1, "F")
        act(0, "B")
    for _ in range(p - rank - 1):
        act(1, "B")
        act(1, "F")
        act(0, "B")
    split = False
    for i in range(rank + 1):
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        act(1, "I" if split else "B")
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        act(0, "I" if split else "B")
    for _ in range(p - rank - 1):
        weight()
        act(0, "I" if split else "B")
    for _ in range(rank + 1):
        weight()
    return out


def rank_order(rank: int, p: int, m: int, microbatches: int, kind: str) -> list[tuple[str, int, int]]:
    """The (kind, micro-batch, local chunk) steps of one training step on pipeline rank `rank` (module docstring)."""
    if kind in ("Interleaved1F1B", "InterleavedZeroBubble"):
        return schedule(rank, p, m, microbatches, kind)
    if kind == "LoopedBFS":
        return _looped_bfs(m, microbatches)
    if kind == "ZBVZeroBubble":
        return _zbv(rank, p, microbatches)
    if kind == "DualPipeV":
        return _dualpipev(rank, p, microbatches)
    raise ValueError(f"not a multi-stage schedule: {kind}")


def _counts(order: list[tuple[str, int, int]], chunks: int, first_chunk_i: Optional[int] = None) -> tuple:
    """(held, before I) counts per chunk after each step (steps x chunks arrays): a forward adds one to both; B
    takes one from both, I from the second (not on `first_chunk_i`: stage 0 runs no I, its W does), W from the
    first."""
    kinds = np.array([k for k, _, _ in order])
    chunk = np.array([c for _, _, c in order], dtype=np.int64)
    steps = np.arange(len(order))
    first = chunk == (-1 if first_chunk_i is None else first_chunk_i)
    dh = np.zeros((len(order), chunks), dtype=np.int64)
    dk = np.zeros((len(order), chunks), dtype=np.int64)
    dh[steps, chunk] = (kinds == "F") * 1 - np.isin(kinds, ("B", "W"))
    dk[steps, chunk] = (kinds == "F") * 1 - ((kinds == "B") | ((kinds == "I") & ~first) | ((kinds == "W") & first))
    return np.cumsum(dh, axis=0), np.cumsum(dk, axis=0)


def peak_state(order: list[tuple[str, int, int]], weight: Any, once: Any = None, early: Any = None,
               early_once: Any = None, between: Any = None, first_chunk_i: Optional[int] = None) -> tuple:
    """The step of `order` where sum over chunks of weight x held + once x (held > 0) + early x (before I) +
    early_once x (before I > 0) + between x (between I and W) is the most (the first such), for per-chunk weights that
    are scalars or equally shaped arrays (one value per plan): (that total, held counts, before-I counts), the counts
    one array per chunk. `first_chunk_i`: the chunk of stage 0, whose I does nothing (its W the whole backward)."""
    chunks = max(c for _, _, c in order) + 1
    return _peak(*_distinct(*_counts(order, chunks, first_chunk_i)), weight, once, early, early_once, between)


@functools.lru_cache(maxsize=256)
def rank_states(rank: int, p: int, m: int, microbatches: int, kind: str) -> tuple:
    """The distinct (held, before-I) count vectors of the rank's order, in the order they first occur (`peak_state`'s
    candidates: the step with the most bytes is one of them), cached: a search evaluates each rank of many plans."""
    stages = rank_stages(rank, p, m, kind)
    return _distinct(*_counts(rank_order(rank, p, m, microbatches, kind), m, stages.index(0) if 0 in stages else None))


def rank_peak(rank: int, p: int, m: int, microbatches: int, kind: str, weight: Any, early: Any,
              between: Any) -> tuple:
    """`peak_state` of the rank's order (`rank_order`), from the cached `rank_states` of `steady_microbatches`."""
    return _peak(*rank_states(rank, p, m, steady_microbatches(p, m, microbatches, kind), kind), weight, None, early,
                 None, between)


def steady_microbatches(p: int, m: int, microbatches: int, kind: str) -> int:
    """The fewest micro-batches whose order has the same distinct (held, before-I) states on every rank as M's (so
    the same peak): the steady state repeats. With 2 stages a rank: ZBVZeroBubble and DualPipeV min(M, 2p);
    Interleaved1F1B and InterleavedZeroBubble min(M, 2 x its round, `torch_round`); checked exhaustively for
    p <= 8, M <= 160 while writing it (tests/test_titan_multistage.py checks p <= 4, M <= 40). LoopedBFS's peak grows
    with M (every forward of a chunk first), and other m: M itself."""
    if m != 2 or kind == "LoopedBFS":
        return microbatches
    if kind in V_SCHEDULES:
        return min(microbatches, 2 * p)
    return min(microbatches, 2 * torch_round(p, microbatches))


def _distinct(held: Any, pre: Any) -> tuple:
    """The distinct rows of (held, pre), first occurrences in order (the argmax keeps the first step of a tie)."""
    rows = np.concatenate([held, pre], axis=1)
    base = int(rows.max()) + 1 if rows.size else 1  # counts are >= 0: one integer per row where it fits in 63 bits
    if base ** rows.shape[1] < 2 ** 62:
        _, first = np.unique(rows @ (base ** np.arange(rows.shape[1], dtype=np.int64)), return_index=True)
    else:
        _, first = np.unique(rows, axis=0, return_index=True)
    keep = np.sort(first)
    return held[keep], pre[keep]


def _peak(held: Any, pre: Any, weight: Any, once: Any, early: Any, early_once: Any, between: Any) -> tuple:
    chunks = held.shape[1]
    zero = [0] * chunks
    parts = [(held, weight), (held > 0, once or zero), (pre, early or zero), (pre > 0, early_once or zero),
             (held - pre, between or zero)]
    shape = np.broadcast_shapes(*(np.shape(w[c]) for _, w in parts for c in range(chunks)))
    total = np.zeros((len(held),) + shape, dtype=np.int64)
    for n, w in parts:
        for c in range(chunks):
            total += np.multiply.outer(n[:, c], np.broadcast_to(np.asarray(w[c], dtype=np.int64), shape))
    at = np.argmax(total, axis=0)  # the first step of the most bytes (per plan)
    best = np.take_along_axis(total, np.expand_dims(at, 0), 0)[0] if np.ndim(at) else total[at]
    return best, [held[at, c] for c in range(chunks)], [pre[at, c] for c in range(chunks)]


def peak_sets(order: list[tuple[str, int, int]], weight: Any, once: Any = None, early: Any = None,
              early_once: Any = None) -> tuple[Any, tuple[int, ...]]:
    """`peak_state` of scalar weights: (the most bytes, the held count of each chunk then)."""
    best, held, _ = peak_state(order, weight, once, early, early_once)
    return best, tuple(int(n) for n in held)


def multi_note(kind: str, p: int, m: int, num_layers: int, dense: int = 0) -> list[str]:
    """What `estimate` says of a multi-stage schedule: the placement, each rank's chunks (`dense`: an MoE model's dense
    first layers, where they fall: `chunk_dense`), what is measured / derived."""
    split = ", ".join(" + ".join(map(str, rank_chunks(r, p, m, num_layers, kind))) for r in range(p))
    split += " layers"
    if dense:
        where = [(r, c, n) for r in range(p) for c, n in enumerate(chunk_dense(r, p, m, num_layers, dense, kind)) if n]
        split += (f" (the {dense} dense first layers: " + ", ".join(f"{n} in rank {r}'s chunk {c}" for r, c, n in where)
                  + "; the rest MoE layers: each chunk's own counted)")
    out = [f"torchtitan pipeline_parallel_schedule {kind}: {p * m} virtual stages split by torchtitan "
           f"(_generate_llm_fqn_per_model_part), {m} a rank, " + ("in a V (rank r: stages r and 2p - 1 - r)"
                                                                 if kind in V_SCHEDULES else "rank r: stages r, r + p, ...")
           + f"; the ranks' chunks hold {split}; each rank's peak is the step of torch's own order "
           "(_calculate_single_rank_operations, rewritten; tests compare it with torch's) where its saved bytes are the "
           "most (memplan/memory/pipeline_multi.py). Measured over gloo on a tiny model (validation/titan_pp.py); the "
           "step's transients as one chunk of the rank's largest; the received inputs and kept outputs not counted"]
    if kind in SPLIT_BACKWARD:
        out.append(f"{kind} splits each backward into I (input gradients) and W (weight gradients): the forward's "
                   "saved tensors and the gradients torch's stage_backward_input keeps for W (rows 'I->W') stay "
                   "until W; the loss's until I (derived from torch 2.13's _backward.py, measured on CPU)")
    return out


def bubble_share(kind: Any) -> float:
    """The schedule's pipeline bubble as a share of the 1F1B family's (p - 1)/(m M) of a stage's busy time (derived,
    uncalibrated): 1 for 1F1B, GPipe, Interleaved1F1B and LoopedBFS (whose bubble is the interleaved one; Lamy-Poirier
    2023); 1/3 for the split-backward schedules: Qi et al. 2024 (zero bubble) count ZB-H1's bubble as
    (p - 1)(T_F + T_B - 2 T_W) against 1F1B's (p - 1)(T_F + T_B), i.e. (p - 1) T_F against 3 (p - 1) T_F with
    T_F = T_I = T_W; ZBVZeroBubble and DualPipeV are charged the same (their own counts are lower: not modelled)."""
    return 1 / 3 if str(kind) in SPLIT_BACKWARD else 1.0
