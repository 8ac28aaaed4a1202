"""Pipeline schedules: how many micro-batches (and model chunks) a stage holds at its peak.

1F1B (PipeDream-flush, Megatron-LM's default): stage i runs p - i - 1 warm-up forwards, so it
holds min(p - i, M) micro-batches of its L/p layers; the first stage holds p, i.e. L layers'
worth (K22 section 4.2.3, Eq. 5). Interleaved with m chunks per rank (Megatron-LM
`get_forward_backward_func` warm-up count): rank i runs 2(p - i - 1) + (m - 1)p warm-up chunk
forwards and holds one more, each of L/(pm) layers; on the first rank that is
L(1 + (p - 1)/(pm)) layers (K22 section 4.2.3). With fewer micro-batches than warm-up steps,
only those exist (Megatron-LM caps the warm-up at the total).

Uneven stages (Megatron-LM --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers,
megatron/core/transformer/transformer_block.py get_num_layers_to_build): the first and the last
stage hold the layers given, the p - 2 middle stages split the rest evenly, and each stage's m
chunks split its layers evenly. `--account-for-embedding-in-pipeline-split` and
`--account-for-loss-in-pipeline-split` count the embedding / the loss as one layer of the first /
last stage: without interleaving that is the same layout, first = (L + e + l)/p - e (e, l = 1
when accounted), the others (L + e + l)/p (same function there).

torchtitan 0.3.0 (``--impl torchtitan --pp P``, torch.distributed.pipelining): its single-stage schedules
``1F1B`` (torch's Schedule1F1B: rank i runs min(M, p - i) warm-up forwards before its first backward, the same
p - i in flight as Megatron-LM's 1F1B) and ``GPipe`` (ScheduleGPipe: every forward, then every backward: M in
flight on every stage); its stage split `titan_stage_layers`. Its multi-stage ``Interleaved1F1B`` (torch's
ScheduleInterleaved1F1B, `schedule`): torchtitan makes m = 2 stages per rank unless
pipeline_parallel_layers_per_stage says otherwise (`titan_stages_per_rank`), splits the layers over the p m virtual
stages with the same split (so a rank's chunks differ by a layer: Llama 3 8B, p = 2: 8, 9, 8, 7), rank r runs
stages r, r + p, ...; torch's warm-up is Megatron-LM's with p replaced by its micro-batches per round
M // max(1, M // p) (`chunks_in_flight`'s ``group``): the same count when p divides M, more when it does not.
The other multi-stage schedules, the placement of a rank's chunks and its peak: memplan/memory/pipeline_multi.py.

All functions take scalars or numpy arrays (`titan_stage_layers`: scalars).
"""

from __future__ import annotations

from typing import Any

from memplan.core.arith import minimum

# torch 2.13's schedule names (torch.distributed.pipelining.schedules get_schedule_class), torchtitan's
# pipeline_parallel_schedule: the single-stage ones (PipelineScheduleSingle) here, the multi-stage ones in
# memplan/memory/pipeline_multi.py
TORCH_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                   "DualPipeV")
SINGLE_SCHEDULES = ("1F1B", "GPipe")


def chunks_in_flight(stage: Any, p: Any, m: Any, microbatches: Any, group: Any = None, hop: Any = 2) -> Any:
    """(micro-batch, model chunk) activation sets stage `stage` holds at its peak: Megatron-LM's warm-up forwards
    + 1; `group` the micro-batches that run one chunk before the next (Megatron-LM: p; torch's
    ScheduleInterleaved1F1B: `torch_round`), `hop` the warm-up forwards added per stage from the last (torch's
    _get_warmup_ops multiply_factor: 2, its InterleavedZeroBubble 1)."""
    group = p if group is None else group
    one_f_one_b = p - stage
    interleaved = hop * (p - stage - 1) + (m - 1) * group + 1
    warmup_plus_one = (m == 1) * one_f_one_b + (m != 1) * interleaved
    return minimum(warmup_plus_one, microbatches * m)


def schedule_in_flight(stage: Any, p: Any, m: Any, microbatches: Any, schedule: str = "1F1B") -> tuple[Any, Any]:
    """(chunks_in_flight, microbatches_in_flight) under ``schedule``: GPipe (torch's ScheduleGPipe runs all M
    forwards before the first backward) holds every micro-batch on every stage; the 1F1B family the counts above."""
    if schedule == "GPipe":
        return microbatches * m, microbatches
    return chunks_in_flight(stage, p, m, microbatches), microbatches_in_flight(stage, p, microbatches, m)


def torch_round(p: int, microbatches: int) -> int:
    """torch's ScheduleInterleaved1F1B micro-batches per round: M // max(1, M // p); it refuses an M that the
    rounds do not divide (p = 4: M = 9)."""
    rounds = max(1, microbatches // p)
    if microbatches % rounds:
        raise ValueError(f"torch's Interleaved1F1B needs the {microbatches} micro-batches to be a multiple of its "
                         f"{rounds} rounds (max(1, M // p), p = {p})")
    return microbatches // rounds


def titan_stages_per_rank(p: int, num_layers: int, layers_per_stage: Any = None, input_weight: int = 1,
                          output_weight: int = 1) -> int:
    """torchtitan 0.3.0's virtual stages per rank for a multi-stage schedule (pipeline_parallel.py
    _get_pipeline_metadata): 2 by default, else ceil((L + iw + ow) / pipeline_parallel_layers_per_stage) / p,
    which p must divide and which must be at least 2."""
    if layers_per_stage is None:
        return 2
    stages = -(-(num_layers + input_weight + output_weight) // layers_per_stage)
    if stages % p or stages // p < 2:
        raise ValueError(f"torchtitan: {num_layers} layers at {layers_per_stage} a stage make {stages} virtual "
                         f"stages: a multi-stage schedule needs a multiple of p = {p}, at least 2 a rank")
    return stages // p


def titan_stage_layers(p: int, num_layers: int, input_weight: int = 1, output_weight: int = 1) -> tuple[int, ...]:
    """Decoder layers on each of the p stages of torchtitan 0.3.0's split for single-stage schedules
    (distributed/pipeline_parallel.py _generate_llm_fqn_per_model_part; pipeline_parallel_first_stage_less_layers =
    input_weight, ..._last_stage_less_layers = output_weight, both 1 by default): the embedding counts as
    input_weight layers of the first stage, norm + output as output_weight of the last; the L + iw + ow "effective
    layers" are dealt out evenly, the first (L + iw + ow) mod p stages one more. Llama 3 8B (L = 32), p = 2:
    17 effective each, so 16 + 16; p = 4: 9, 9, 8, 8 effective, so 8, 9, 8, 7 layers."""
    effective = num_layers + input_weight + output_weight
    per, extra = divmod(effective, p)
    if p < 1 or per == 0 or input_weight > per or output_weight > per:
        raise ValueError(f"torchtitan cannot split {num_layers} layers (+{input_weight} +{output_weight}) into {p} "
                         "pipeline stages (pipeline_parallel.py: empty stages, or the embedding / output weight "
                         "above the layers per stage)")
    if p == 1:
        return (num_layers,)
    sizes = [per + (i < extra) - input_weight * (i == 0) - output_weight * (i == p - 1) for i in range(p)]
    left, out = num_layers, []
    for n in sizes:  # torchtitan hands layers out in order while any are left
        out.append(min(n, left))
        left -= out[-1]
    return tuple(out)


def titan_split(p: int, num_layers: int, dense: int = 0) -> tuple[Any, Any]:
    """torchtitan's split (`titan_stage_layers`) as memplan models it: (first, last) stage layers where they differ
    from the middle stages', (None, None) where every stage holds L / p. ValueError where torchtitan cannot split the
    layers, a stage holds none, the middle stages differ in size (not modelled: llama3-8b at p = 4, 8, 9, 8, 7) or
    an MoE model's ``dense`` first layers (DeepSeek-V3's n_dense_layers: layers.0 .. dense - 1, dealt out first) do
    not all fit in the first stage (memplan counts them there: memplan/memory/term_bytes.py kind_share): the one rule
    `estimate --impl torchtitan --pp` and `search --impl torchtitan` apply."""
    split = titan_stage_layers(p, num_layers)
    if len(set(split[1:-1])) > 1 or min(split) < 1:
        raise ValueError(f"torchtitan splits the {num_layers} layers over {p} stages as {', '.join(map(str, split))}: "
                         + ("middle stages of different sizes are" if min(split) else "a stage without layers is")
                         + " not modelled yet")
    if dense > split[0]:
        raise ValueError(f"torchtitan's first of {p} stages holds {split[0]} layers, fewer than the {dense} dense first "
                         "layers: dense layers beyond the first stage are not modelled yet")
    return (None, None) if len(set(split)) == 1 else (split[0], split[-1])


def titan_schedule_runs(p: Any, microbatches: Any, schedule: str) -> Any:
    """Whether torch 2.13 runs the single-stage `schedule` with M micro-batches over p stages: Schedule1F1B refuses
    M < p ("Number of microbatches (M) must be greater than or equal to the number of stages",
    torch/distributed/pipelining/schedules.py), ScheduleGPipe takes any M (scalars or arrays)."""
    return (microbatches >= p) | (schedule == "GPipe")


def microbatches_in_flight(stage: Any, p: Any, microbatches: Any, m: Any = 1) -> Any:
    """Micro-batches whose embedding (first stage) or output layer (last stage) activations are
    alive at the stage's peak: p - stage under 1F1B (K22 section 4.3: the sbhp of the first stage).
    Interleaved (m > 1, `schedule`): the first stage's chunk 0 holds the embedding, and at a backward of
    chunk 0 in the steady state the chunk-0 forwards of 2p micro-batches are alive (the warm-up ran them for
    micro-batches 0..2p - 2, the steady state's forward before that backward the last); the last stage's
    chunk m - 1 runs each forward right before its backward (one)."""
    return minimum((p - stage) * (1 + (m != 1) * (stage == 0)), microbatches)


def replayed_microbatches(stage: int, p: int, m: int, microbatches: int, kind: str = "1F1B") -> int:
    """The fewest micro-batches whose schedule (`schedule`) reaches the stage's peak as the whole step does (the
    steady state repeats): 1F1B the in-flight ones + 2; interleaved 2p (a chunk-0 backward of the steady state,
    with 2p micro-batches' chunk 0 alive: `microbatches_in_flight`); GPipe all of them (its peak grows with M)."""
    if kind == "GPipe":
        return microbatches
    if m > 1:
        return min(microbatches, 2 * p)
    return min(microbatches, int(chunks_in_flight(stage, p, 1, microbatches)) + 2)


def schedule(stage: int, p: int, m: int, microbatches: int, kind: str = "1F1B") -> list[tuple[str, int, int]]:
    """The order of ("F" or "B", micro-batch, model chunk) steps of one step on pipeline rank `stage` (scalars):
    Megatron-LM's 1F1B and interleaved 1F1B (megatron-core 0.16 schedules.py get_schedule_table with
    microbatch_group_size_per_vp_stage = p, its default; get_model_chunk_id: a backward runs the table's chunk
    reversed). `chunks_in_flight` - 1 warm-up forwards, (forward, backward) pairs, cool-down backwards. GPipe
    (torch's ScheduleGPipe, one chunk): every forward, then every backward in the same order. ``Interleaved1F1B``
    (torch 2.13's ScheduleInterleaved1F1B, schedules.py _get_1f1b_rank_ops without zero bubble): the same table and
    pairs with groups of `torch_round` micro-batches instead of p (its step k's forward runs chunk (k // round) mod
    m, its backward chunk m - 1 - ((k - warm-up) // round) mod m): Megatron-LM's order where p divides M."""
    if kind == "GPipe":
        return [("F", mb, 0) for mb in range(microbatches)] + [("B", mb, 0) for mb in range(microbatches)]
    zero = kind == "InterleavedZeroBubble"
    group = torch_round(p, microbatches) if kind in ("Interleaved1F1B", "InterleavedZeroBubble") else p
    table = [(mb, c) for lo in range(0, microbatches, group) for c in range(m)
             for mb in range(lo, microbatches if lo + group >= microbatches else lo + group)]
    total, k = len(table), int(chunks_in_flight(stage, p, m, microbatches, group, 1 if zero else 2))
    fwd = [("F", mb, c) for mb, c in table]
    bwd = [("I" if zero else "B", mb, m - 1 - c) for mb, c in table]
    if not zero:
        return fwd[:k - 1] + [x for r in range(total - k + 1) for x in (fwd[k - 1 + r], bwd[r])] + bwd[total - k + 1:]
    # InterleavedZeroBubble (ZB1P, _get_1f1b_rank_ops with enable_zero_bubble): each backward split into I (input
    # gradients) and W (weight gradients); the W of the n-th I runs right after the (n + rank)-th I, the rest at the end
    out, w = fwd[:k - 1], 0
    for r in range(total):
        out += ([fwd[k - 1 + r]] if r <= total - k else []) + [bwd[r]]
        if r >= stage:
            out.append(("W",) + bwd[w][1:])
            w += 1
    return out + [("W",) + x[1:] for x in bwd[w:]]


def stage_layers(stage: Any, p: Any, num_layers: Any, first: Any = None, last: Any = None) -> Any:
    """Transformer layers on pipeline stage `stage`: L/p when the split is even (`first` and `last`
    None), else `first` on stage 0, `last` on stage p - 1 and (L - first - last)/(p - 2) on each
    middle stage (Megatron-LM get_num_layers_to_build). With p = 1 the one stage is the first
    (first = L)."""
    if first is None and last is None:
        return num_layers // p
    if first is None or last is None:
        raise ValueError("stage_layers: give both the first and the last stage's layers, or neither")
    is_first, is_last = 1 * (stage == 0), 1 * (stage == p - 1)
    gaps = p - 2
    middle = (num_layers - first - last) // (gaps + (1 - gaps) * (gaps < 1))  # no middle stage when p <= 2
    return is_first * first + (1 - is_first) * (is_last * last + (1 - is_last) * middle)


def interleaving_factor(p: int, m: int) -> float:
    """K22's first-stage factor 1 + (p - 1)/(p m) (1 when m = 1: no interleaving)."""
    return 1.0 if m == 1 else 1 + (p - 1) / (p * m)


def walked_pair(order: list[tuple[str, int, int]], is_first: Any, is_last: Any, m: int) -> set[int]:
    """Positions in `order` (`schedule`) of the (forward, backward) pair the step timeline walks: the last of the
    steady state (a backward right after a forward, every in-flight chunk alive) whose backward is of the chunk with
    the embedding (first stage, with the most embedding activations alive) or the loss (last stage)."""
    alive: set = set()
    first_chunks = 0  # the chunks of model chunk 0 in `alive`
    best = (-1, 0)
    for i, (what, mb, c) in enumerate(order):
        if what == "F":
            first_chunks += (mb, c) not in alive and c == 0
            alive.add((mb, c))
            continue
        if i and order[i - 1][0] == "F" and (not is_first or c == 0) and (not is_last or c == m - 1):
            best = max(best, (first_chunks, i))
        first_chunks -= (mb, c) in alive and c == 0
        alive.discard((mb, c))
    return {best[1] - 1, best[1]}
