"""`search`: every plan a user could launch for a model on N GPUs, evaluated as numpy arrays
by the same functions `estimate` uses, filtered by a memory budget and ranked by step time.

The space (each plan distinct and launchable with Megatron-LM):
  t  divides a and the key/value heads, at most the GPUs of a node (or `max_tp`);
  p  divides L; d = N / (t p) must be whole and divide the global batch;
  b  divides the global batch / d (M = global batch / (b d) micro-batches per step);
  m  interleaved chunks per rank, dividing L / p (m > 1 needs p > 1 and M divisible by p,
     Megatron-LM's interleaved-schedule requirement);
  SP on / off when t > 1;
  recompute none, selective, or full on N = 1 .. L/(pm) layers per chunk (block method);
  ZeRO 0 .. 3 (1 = Megatron-LM distributed optimizer) when d > 1 (with d = 1 they equal 0), each
     sharded over k ranks for every divisor k > 1 of d (k < d: HSDP, d/k replicas of each shard).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional

import numpy as np

from memplan.errors import MemplanError
from memplan.memory import PlanValues, stage_memory
from memplan.specs import Config, GpuSpec, ModelSpec, ParallelSpec, Recompute, TrainingSpec, check_gpus
from memplan.terms import HF_IMPLS, inventory_for
from memplan.timeline import device_memory, step_events

def divisors(n: int) -> list[int]:
    return [i for i in range(1, n + 1) if n % i == 0]


@dataclass(frozen=True)
class Fixed:
    """Dimensions the user pinned (None = search it)."""

    tp: Optional[int] = None
    pp: Optional[int] = None
    dp: Optional[int] = None
    vpp: Optional[int] = None
    sp: Optional[bool] = None
    recompute: Optional[Recompute] = None
    recompute_num_layers: Optional[int] = None
    micro_batch: Optional[int] = None
    zero: Optional[int] = None
    zero_shard: Optional[int] = None


def _pick(values: list[int], fixed: Optional[int]) -> list[int]:
    return [v for v in values if fixed is None or v == fixed]


def enumerate_plans(model: ModelSpec, gpus: int, global_batch: int, fixed: Fixed = Fixed(),
                    max_tp: int = 8, impl: str = "megatron") -> PlanValues:
    """All valid plans as int64 arrays (one element per plan). transformers (`hf-*`) runs a model
    whole on each data-parallel rank: t = p = 1 and no selective recompute."""
    check_gpus(gpus)
    a, g, L, s = model.num_attention_heads, model.g, model.num_layers, model.seq_length
    if fixed.tp is not None and fixed.pp is not None and gpus % (fixed.tp * fixed.pp):
        raise MemplanError(f"GPU count {gpus} is not divisible by t*p = {fixed.tp}*{fixed.pp} = {fixed.tp * fixed.pp}")
    blocks: list[np.ndarray] = []
    hf = impl in HF_IMPLS
    for t in _pick([t for t in divisors(a) if g % t == 0 and t <= max_tp and (t == 1 or not hf)], fixed.tp):
        for p in _pick([p for p in divisors(L) if p == 1 or not hf], fixed.pp):
            if gpus % (t * p):
                continue
            d = gpus // (t * p)
            if (fixed.dp is not None and d != fixed.dp) or global_batch % d:
                continue
            sps = [0] if t == 1 else [x for x in (0, 1) if x == 0 or s % t == 0]
            if fixed.sp is not None:
                sps = [x for x in sps if x == int(fixed.sp)]
            zeros = [(z, k) for z in _pick([0, 1, 2, 3] if d > 1 else [0], fixed.zero)
                     for k in ([d] if z == 0 else [k for k in divisors(d) if k > 1])
                     if fixed.zero_shard is None or (z > 0 and k == fixed.zero_shard)]
            for b in _pick(divisors(global_batch // d), fixed.micro_batch):
                M = global_batch // (d * b)
                for m in _pick(divisors(L // p) if p > 1 else [1], fixed.vpp):
                    if m > 1 and M % p:
                        continue
                    n = L // (p * m)
                    recompute = [(Recompute.NONE, n)] + ([] if hf else [(Recompute.SELECTIVE, n)]) + [
                        (Recompute.FULL, k) for k in range(1, n + 1)
                    ]
                    if fixed.recompute is not None:
                        recompute = [r for r in recompute if r[0] == fixed.recompute]
                    if fixed.recompute_num_layers is not None:
                        recompute = [r for r in recompute if r[0] == Recompute.FULL and r[1] == fixed.recompute_num_layers]
                    if not (sps and zeros and recompute):
                        continue
                    inner = np.array(
                        [(sp, z, k, int(r), n_rec) for sp in sps for z, k in zeros for r, n_rec in recompute],
                        dtype=np.int64
                    )
                    head = np.array([t, p, d, m, b, M], dtype=np.int64)
                    blocks.append(np.hstack([np.broadcast_to(head, (len(inner), 6)), inner]))
    if not blocks:
        raise MemplanError(
            f"no plan of {model.name} divides {gpus} GPUs with global batch {global_batch}"
            + (" and the pinned dimensions" if any(v is not None for v in fixed.__dict__.values()) else "")
            + f" (t must divide a={a}, at most {max_tp}; p must divide L={L}; d = GPUs/(t p) must divide the batch)"
        )
    cols = np.vstack(blocks).T
    t, p, d, m, b, M, sp, zero, shard, rec, k = cols
    return PlanValues(t=t, p=p, d=d, m=m, sp=sp, zero=zero, shard=shard, b=b, recompute=rec,
                      recomputed_layers=k, microbatches=M)


@dataclass(frozen=True)
class Evaluated:
    plans: PlanValues
    device_bytes: np.ndarray  # what the most loaded GPU needs: peak + fragmentation margin + runtime
    peak_bytes: np.ndarray  # allocated peak of a step on the most loaded GPU (max of first and last stage)
    first_stage_peak_bytes: np.ndarray
    last_stage_peak_bytes: np.ndarray
    retained_bytes: np.ndarray  # states + saved activations at the first backward (most loaded stage)
    step_time_s: Optional[np.ndarray]
    mfu: Optional[np.ndarray]
    tokens_per_s: Optional[np.ndarray]


def evaluate(model: ModelSpec, training: TrainingSpec, plans: PlanValues, gpu: Optional[GpuSpec],
             global_batch: int, impl: str = "megatron", margin: Optional[float] = None,
             with_time: bool = True) -> Evaluated:
    """Memory (and step time, when a GPU is known) of every plan, vectorised, with the functions
    `estimate` uses: the step peak at the timeline's critical moments (memplan/timeline.py; a test
    checks them against the walk over every layer) and what the device adds.

    Only the first and the last stage can be the most loaded: every middle stage holds no more
    activations than the first (fewer micro-batches in flight) and the same layers' states
    without the embedding; a test checks this against `estimate`'s all-stage maximum.
    """
    inventory = inventory_for(model, impl)
    peaks, retained = [], []
    for stage in (0, plans.p - 1):
        mem = stage_memory(model, inventory.terms, training, plans, stage, granularity=inventory.granularity)
        peaks.append(step_events(model, inventory, training, plans, mem, stage, critical=True).peak_bytes)
        retained.append(mem.total)
    peak = np.maximum(*peaks)
    device = device_memory(peak, plans, inventory, gpu, margin).total
    step = mfu = tps = None
    if gpu is not None and with_time:
        from memplan.perf import step_time

        perf = step_time(model, training, gpu, plans, global_batch, breakdown=False)
        step, mfu, tps = perf.step_time_s, perf.mfu, perf.tokens_per_s
    return Evaluated(plans, device, peak, peaks[0], peaks[1], np.maximum(*retained), step, mfu, tps)


def plan_config(model: ModelSpec, training: TrainingSpec, plans: PlanValues, i: int, global_batch: int) -> Config:
    """One candidate as a Config, for `estimate`, reports and launch flags."""
    x = plans.take(i)
    n = int(model.num_layers // (x.p * x.m))
    rec = Recompute(int(x.recompute))
    return Config(
        model=model,
        parallel=ParallelSpec(tp=int(x.t), pp=int(x.p), dp=int(x.d), vpp=int(x.m), sp=bool(x.sp), zero=int(x.zero),
                              zero_shard=int(x.shard) if x.shard < x.d else None),
        training=training.model_copy(update=dict(
            micro_batch=int(x.b), global_batch=global_batch, recompute=rec,
            recompute_num_layers=(int(x.recomputed_layers) if rec == Recompute.FULL and x.recomputed_layers < n else None),
        )),
    )


@dataclass
class SearchResult:
    model: ModelSpec
    gpus: int
    global_batch: int
    budget_bytes: int
    gpu: Optional[GpuSpec]
    candidates: int
    feasible: int
    seconds: float
    top: list[int]  # indices of the best feasible plans, fastest first
    nearest_miss: Optional[int]  # the least memory of all plans, when none fits
    fastest_miss: Optional[int]  # the fastest plan over the budget (if faster than the best fit)
    evaluated: Evaluated
    training: TrainingSpec
    impl: str = "megatron"
    notes: list[str] = field(default_factory=list)
    max_seq_len: Optional[int] = None  # search --max-seq: the longest s some plan fits with

    def config(self, i: int) -> Config:
        return plan_config(self.model, self.training, self.evaluated.plans, i, self.global_batch)

    def row(self, i: int) -> dict[str, Any]:
        e = self.evaluated
        out = {
            **self.config(i).plan_summary(),
            "memory": {"device_bytes": int(e.device_bytes[i]), "peak_bytes": int(e.peak_bytes[i]),
                       "first_stage_peak_bytes": int(e.first_stage_peak_bytes[i]),
                       "last_stage_peak_bytes": int(e.last_stage_peak_bytes[i]),
                       "retained_bytes": int(e.retained_bytes[i])},
        }
        if e.step_time_s is not None:
            out.update(step_time_s=float(e.step_time_s[i]), mfu=float(e.mfu[i]),
                       tokens_per_s=float(e.tokens_per_s[i]))
        return out


def search(model: ModelSpec, training: TrainingSpec, gpus: int, global_batch: int, budget_bytes: int,
           gpu: Optional[GpuSpec] = None, fixed: Fixed = Fixed(), max_tp: Optional[int] = None, top: int = 10,
           chunk: int = 1 << 18, progress: Optional[Callable[[int, int], None]] = None,
           impl: str = "megatron", margin: Optional[float] = None) -> SearchResult:
    """Enumerate, evaluate (in chunks, reporting progress), filter by the budget, rank by step time
    (by memory when no GPU is known)."""
    start = time.perf_counter()
    plans = enumerate_plans(model, gpus, global_batch, fixed, _tp_limit(max_tp, gpu), impl)
    check_int64(model, training, int(plans.b.max()), impl)
    n = len(plans.t)
    parts = []
    for lo in range(0, n, chunk):
        parts.append(evaluate(model, training, plans.take(slice(lo, lo + chunk)), gpu, global_batch, impl, margin))
        if progress is not None:
            progress(min(lo + chunk, n), n)
    evaluated = parts[0] if len(parts) == 1 else _concat(plans, parts)
    fits = _fits(evaluated, budget_bytes)
    key = evaluated.step_time_s if evaluated.step_time_s is not None else evaluated.device_bytes
    order = np.lexsort((evaluated.device_bytes, key))
    ranked = order[fits[order]]
    best = [int(i) for i in ranked[:top]]
    nearest = None if best else int(np.argmin(evaluated.device_bytes))
    fastest_miss = None
    over = order[~fits[order]]
    if len(over) and (not best or key[over[0]] < key[best[0]]):
        fastest_miss = int(over[0])
    return SearchResult(model, gpus, global_batch, budget_bytes, gpu, n, int(fits.sum()),
                        time.perf_counter() - start, best, nearest, fastest_miss, evaluated, training, impl)


def _tp_limit(max_tp: Optional[int], gpu: Optional[GpuSpec]) -> int:
    """The largest t searched: --max-tp, else the GPUs of a node."""
    return max_tp if max_tp is not None else (gpu.gpus_per_node if gpu is not None else 8)


def _fits(evaluated: Evaluated, budget_bytes: int) -> np.ndarray:
    """The plans whose device memory is within the budget (never a non-positive figure)."""
    return (evaluated.device_bytes <= budget_bytes) & (evaluated.device_bytes > 0)


INT64_SAFE = 1 << 53  # bytes per GPU the vectorised int64 arithmetic holds with room for its products


def check_int64(model: ModelSpec, training: TrainingSpec, max_micro_batch: int, impl: str) -> None:
    """Refuse a space whose memory the planner's int64 arrays cannot hold (they would wrap around
    to negative bytes that "fit"). Every candidate needs at most twice what one GPU holding the
    whole model with the largest micro-batch needs (pipelines keep at most L layers' worth in
    flight, 1 + (p - 1)/(pm) < 2 with interleaving): that bound is computed in Python integers."""
    from memplan.estimate import device_bytes

    one_gpu = Config(model=model, training=training.model_copy(update=dict(
        micro_batch=max_micro_batch, global_batch=max_micro_batch, recompute=Recompute.NONE,
        recompute_num_layers=None)))
    need = 2 * device_bytes(one_gpu, impl)
    if need > INT64_SAFE:
        raise MemplanError(f"{model.name} at s={model.seq_length:,}, v={model.vocab_size:,}: up to {need:.2e} bytes per "
                           f"GPU, beyond what the search's 64-bit arithmetic holds ({INT64_SAFE:.1e}); use estimate "
                           "for one plan, or smaller sizes")


def search_max_seq(model: ModelSpec, training: TrainingSpec, gpus: int, global_batch: int, budget_bytes: int,
                   step: int = 128, **kwargs: Any) -> SearchResult:
    """The longest sequence (a multiple of `step`) that some plan fits with, and `search` at that
    length: the plans that fit there, fastest first. Memory grows with s for every plan, so the
    question "does any plan fit?" is monotone in s and a bisection answers it."""
    from memplan.limits import SEQ_LIMIT, largest

    gpu, fixed, impl, margin = (kwargs.get("gpu"), kwargs.get("fixed", Fixed()), kwargs.get("impl", "megatron"),
                                kwargs.get("margin"))
    chunk = kwargs.get("chunk", 1 << 18)

    def any_fits(s: int) -> bool:
        at_s = model.model_copy(update={"seq_length": s})
        try:
            plans = enumerate_plans(at_s, gpus, global_batch, fixed, _tp_limit(kwargs.get("max_tp"), gpu), impl)
            # sizes beyond the int64 arithmetic fit no budget (and must not wrap around into one)
            check_int64(at_s, training, int(plans.b.max()), impl)
        except MemplanError:
            return False
        for lo in range(0, len(plans.t), chunk):
            e = evaluate(at_s, training, plans.take(slice(lo, lo + chunk)), gpu, global_batch, impl, margin,
                         with_time=False)
            if np.any(_fits(e, budget_bytes)):
                return True
        return False

    longest = largest(any_fits, step, SEQ_LIMIT)
    if longest is None:
        raise MemplanError(f"no plan of {model.name} fits in {budget_bytes:,} bytes per GPU even at s = {step}")
    result = search(model.model_copy(update={"seq_length": longest}), training, gpus, global_batch, budget_bytes,
                    **kwargs)
    result.notes.append(f"the longest sequence any plan fits with: s = {longest:,} tokens (searched in multiples "
                        f"of {step}, global batch {global_batch} sequences); the plans below fit at that length")
    result.max_seq_len = longest
    return result


def _concat(plans: PlanValues, parts: list[Evaluated]) -> Evaluated:
    def cat(name: str) -> Any:
        values = [getattr(p, name) for p in parts]
        return None if values[0] is None else np.concatenate(values)

    return Evaluated(plans, *(cat(f.name) for f in fields(Evaluated) if f.name != "plans"))


def fixed_from(parallel: dict[str, Any], training: dict[str, Any]) -> Fixed:
    """The pinned dimensions from option values (None = search it)."""
    rec = training.get("recompute")
    return Fixed(
        tp=parallel.get("tp"), pp=parallel.get("pp"), dp=parallel.get("dp"), vpp=parallel.get("vpp"),
        sp=parallel.get("sp"), zero=parallel.get("zero"), zero_shard=parallel.get("zero_shard"),
        micro_batch=training.get("micro_batch"),
        recompute=Recompute.parse(rec) if rec is not None else None,
        recompute_num_layers=training.get("recompute_num_layers"),
    )


def search_presets(requests: list[tuple[ModelSpec, TrainingSpec, int]], gpus: int, budget_bytes: int,
                   **kwargs: Any) -> list[SearchResult]:
    """`search` for several models (the "what can I train on this machine?" question); a model
    that no plan can divide is skipped with no result."""
    results = []
    for model, training, global_batch in requests:
        try:
            results.append(search(model, training, gpus, global_batch, budget_bytes, **kwargs))
        except MemplanError:
            continue
    if not results:
        raise MemplanError(f"no preset has a plan that divides {gpus} GPUs")
    return results
