"""The largest sequence length / micro-batch a plan fits with (`estimate --max-seq`, `--max-micro-batch`), on the
fit verdict `estimate` gives (the flat margin and the caching allocator's replay), in two steps (`largest_replayed`):
the allocated peak + margin + runtime grows with s and b (a property test checks it), so a search on its bytes
(`largest_under`: interpolation kept at a bisection's pace; tests/test_limits_search.py) finds the longest length
the bound allows exactly to one step; the replay needs at least that much, but its verdict is not
monotone (a longer sequence can pack its blocks into the segments better, as in PyTorch's allocator), so from there
the answer is the first length, going down in doubling strides and then bisecting, at which the replay completes and
one step longer it does not: a length that fits, the next step not fitting (tests/test_verdict_agreement.py), with
six lengths spread over the 12.5 % below it fitting too (`settled`: a shorter length that dies moves the answer below
it). `--max-seq` navigates on the most loaded stage's replay and checks every stage at the answer (`every_stage_fits`).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

from memplan.core.errors import MemplanError
from memplan.core.spec_base import build
from memplan.core.specs import Config, GpuSpec
from memplan.memory.reserved import Replay
from memplan.memory.stream_lengths import StreamLengths
from memplan.plan.estimate import device_bytes

SEQ_LIMIT = 1 << 24  # 16M tokens: beyond any context trained today (and far below int64 overflow)
MICRO_BATCH_LIMIT = 1 << 16


def largest(fits: Callable[[int], bool], step: int, limit: int) -> Optional[int]:
    """The largest multiple of `step` up to `limit` for which `fits` holds (monotone: true up to some
    point, false after), or None when even `step` does not fit."""
    if not fits(step):
        return None
    lo = 1  # fits(lo * step)
    hi = 2
    while hi * step <= limit and fits(hi * step):
        lo, hi = hi, hi * 2
    hi = min(hi, limit // step + 1)  # fits(hi * step) is false or beyond the limit
    return _bisect(fits, lo, hi, step)


def _bisect(fits: Callable[[int], bool], lo: int, hi: int, step: int) -> int:
    """Between lo (fits at lo * step) and hi (does not at hi * step), a multiple of `step` that fits, one step
    longer not."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid * step):
            lo = mid
        else:
            hi = mid
    return lo * step


def largest_under(need: Callable[[int], int], budget: int, step: int, limit: int) -> Optional[int]:
    """`largest` for `fits(x) = need(x) <= budget` with `need` non-decreasing: the same answer (the largest multiple
    of `step` up to `limit` that fits is one number, whatever the order of the probes), found in fewer probes by
    reading the values: the next probe is where the line through two probes reaches the budget (extrapolated from
    the two longest that fit until one does not, then interpolated inside the bracket; doubling while the values
    do not grow). Each round inside the bracket probes the line's point (and one step longer when that fits: the
    usual case, the answer found) and then the middle of what is left, so the bracket at least halves per round as
    in a bisection. The bound is near affine in s and b, so the line lands within a step or two of the answer."""
    top_k = limit // step
    values: dict[int, int] = {}

    def at(k: int) -> int:
        if k not in values:
            values[k] = need(k * step)
        return values[k]

    if at(1) > budget:
        return None
    lo, hi = 1, None  # fits at lo * step; not at hi * step (None: not found yet)
    prev = None  # the probe that fits before lo, for the extrapolation
    while hi is None:
        if lo >= top_k:  # (as `largest`: `step` itself is answered even above the limit)
            return lo * step
        if prev is None or values[lo] <= values[prev]:
            guess = 2 * lo
        else:
            slope = (values[lo] - values[prev]) / (lo - prev)
            guess = lo + int((budget - values[lo]) / slope) + 1  # one past where the line reaches the budget
            guess = max(guess, lo + 1)
        guess = min(guess, top_k)
        if at(guess) <= budget:
            prev, lo = lo, guess
        else:
            hi = guess
    while hi - lo > 1:
        span = values[hi] - values[lo]
        guess = lo + int((budget - values[lo]) * (hi - lo) / span) if span > 0 else (lo + hi) // 2
        guess = min(max(guess, lo + 1), hi - 1)
        if at(guess) <= budget:
            lo = guess
            if hi - lo > 1 and at(lo + 1) > budget:  # the usual case: the guess was the answer
                hi = lo + 1
        else:
            hi = guess
        if hi - lo > 1:
            mid = (lo + hi) // 2  # keep the bisection's pace when the line misleads
            if at(mid) <= budget:
                lo = mid
            else:
                hi = mid
    return lo * step


def largest_replayed(bound_need: Callable[[int], int], budget: int, fits: Callable[[int], bool], step: int,
                     limit: int) -> Optional[int]:
    """A multiple of `step` up to `limit` for which `fits` holds and (below the limit) fits one step longer does not,
    where `fits` implies the bound `bound_need(x) <= budget` (non-decreasing, `largest_under`); None when `fits`
    holds at none below the bound's answer (tried down to `step`). Exact when `fits` is monotone too."""
    top = largest_under(bound_need, budget, step, limit)
    if top is None:
        return None
    return settled(fits, top if fits(top) else fits_below(fits, top, step), step)


WINDOW, STRIDES = 6, 48  # `settled` checks 6 lengths below an answer, 1/48 of it apart: the 12.5 % below it


def settled(fits: Callable[[int], bool], found: Optional[int], step: int) -> Optional[int]:
    """`found` (a multiple of `step` at which `fits` holds, or None), or a shorter one, such that `fits` also holds at
    WINDOW lengths below it, each 1/STRIDES of it shorter (in steps) than the last: the replay's verdict is not
    monotone (llama3-8b, hf-sdpa, one H100, foreach AdamW, full recompute: the run replays through at 12,288 to
    13,056 tokens and dies at 12,032), so a length that fits with one step longer not is no answer when a
    shorter length dies; where one in the window dies, the answer is sought below it (`fits_below`) and checked
    again. Not a proof that every shorter length fits: the lengths the window skips are not replayed."""
    while found is not None:
        k = found // step
        gap = max(k // STRIDES, 1)
        dies = next((x for x in range(k - gap, max(k - WINDOW * gap, 1) - 1, -gap) if not fits(x * step)), None)
        if dies is None:
            return found
        found = fits_below(fits, dies * step, step)
    return None


def fits_below(fits: Callable[[int], bool], top: int, step: int) -> Optional[int]:
    """Below `top` (a multiple of `step` at which `fits` fails), the first multiple of `step` at which `fits` holds,
    one step longer not, found in strides doubling down from `top` and then a bisection; None when it holds at none
    down to `step`."""
    hi = top // step  # does not fit (in steps)
    gap = max(hi // 128, 1)  # the first stride below: ~0.8 % (the replay's excess over the bound is of that order)
    while True:
        lo = max(hi - gap, 1)
        if fits(lo * step):
            break
        if lo == 1:
            return None
        hi, gap = lo, gap * 2
    return _bisect(fits, lo, hi, step)


def _with(config: Config, model: Optional[dict] = None, training: Optional[dict] = None) -> Config:
    data = config.model_dump()
    data["model"].update(model or {})
    data["training"].update(training or {})
    return build(Config, data)


def seq_step(config: Config) -> int:
    """The sequence lengths the plan accepts are the multiples of this (the rules of memplan/core/specs.py): t under
    sequence parallelism, 2 cp with context parallelism (its load-balanced layout), t cp with both (each
    context-parallel rank's s/cp split over t), and the loss chunks."""
    par = config.parallel
    rules = [config.training.loss_chunks, par.tp if par.sp else 1]
    if par.cp > 1:
        rules += [2 * par.cp, par.tp * par.cp if par.sp else 1]
    return math.lcm(*rules)


def cap_of(key: str, value: Optional[int], config: Config) -> Optional[int]:
    """memplan's cap on a limit (`max_seq_len`: SEQ_LIMIT, `max_micro_batch`: MICRO_BATCH_LIMIT) when `value` is the
    largest step below it, so that it is the cap and not a fit limit (the plan fits there, longer is not tried);
    else None."""
    if value is None:
        return None
    cap, step = (SEQ_LIMIT, seq_step(config)) if key == "max_seq_len" else (MICRO_BATCH_LIMIT, 1)
    return cap if value + step > cap else None


def max_seq_len(config: Config, budget_bytes: int, impl: str = "megatron", device: str = "cuda",
                gpu: Optional[GpuSpec] = None, fragmentation_margin: Optional[float] = None,
                replay: Replay = Replay()) -> Optional[int]:
    """The longest sequence this plan fits in `budget_bytes` with (a multiple of `seq_step`: `largest_replayed`), all
    else equal; None when none does; at most SEQ_LIMIT (`cap_of` tells when it is the cap)."""
    lengths = StreamLengths(config.training.micro_batch)  # the plan's stream made twice, evaluated at other lengths

    def needs(s: int, replayed: bool, every_stage: bool = True) -> int:
        return device_bytes(_with(config, model=dict(seq_length=s)), impl, device, gpu, fragmentation_margin,
                            budget_bytes if replayed else None, replay, lengths, every_stage)

    step = seq_step(config)
    found = largest_replayed(lambda s: needs(s, False), budget_bytes,
                             lambda s: needs(s, True, every_stage=False) <= budget_bytes, step, SEQ_LIMIT)
    return every_stage_fits(lambda s: needs(s, True) <= budget_bytes, found, step)


def every_stage_fits(fits: Callable[[int], bool], found: Optional[int], step: int) -> Optional[int]:
    """`found`, the longest length by the most loaded stage's replay (`largest_replayed`: the window settled on it,
    one step longer dying), when every stage's run completes there too (`fits`: the verdict, plan/stage_verdict.py);
    else the first length below it at which they do, one step longer not (`fits_below` on the verdict). One step
    longer than `found` the most loaded stage's run dies, so the verdict does not fit there either: the answer is a
    length that fits, one step longer not, with the replays of the other stages at one or a few lengths instead of
    at every length the search tries (a pipeline of 35 stages replays 35 runs per length)."""
    if found is None or fits(found):
        return found
    return fits_below(fits, found, step)


def max_micro_batch(config: Config, budget_bytes: int, impl: str = "megatron", device: str = "cuda",
                    gpu: Optional[GpuSpec] = None, fragmentation_margin: Optional[float] = None,
                    replay: Replay = Replay()) -> Optional[int]:
    """The largest micro-batch this plan fits with, the micro-batches per step unchanged (so the
    global batch grows with b); None when none does."""
    M, d = config.num_microbatches, config.parallel.dp

    def needs(b: int, replayed: bool) -> int:
        c = _with(config, training=dict(micro_batch=b, global_batch=b * d * M))
        return device_bytes(c, impl, device, gpu, fragmentation_margin, budget_bytes if replayed else None, replay)

    return largest_replayed(lambda b: needs(b, False), budget_bytes, lambda b: needs(b, True) <= budget_bytes, 1,
                            MICRO_BATCH_LIMIT)


def need_budget(budget_bytes: Optional[int], what: str) -> int:
    if budget_bytes is None:
        raise MemplanError(f"{what} needs a memory budget: give --mem SIZE or --gpu NAME")
    return budget_bytes
