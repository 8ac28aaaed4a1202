"""No plan is lost: `search` decides the fit of every plan of the space and ranks them as evaluating
every plan one by one would.

- Every plan of small spaces: the search's numbers (device memory, step peaks, retained bytes, step
  time, MFU) equal the scalar `estimate` path for that plan.
- Every plan of real spaces (GPT-3 530B / 175B, Llama 3, HF implementations, pinned dimensions,
  ZeRO 0-3 and HSDP, no budget that fits, no GPU): `search` equals `search(reference=True)`, which
  evaluates the plans as flat arrays with `evaluate` and sorts them all: the same plan numbers,
  candidate and fit counts, top list, nearest and fastest misses, and the same numbers for every
  plan (`SearchResult.evaluated`, expanded from what the search computed).
- The two shortcuts the search takes are checked while it runs; when they do not hold it falls back
  to evaluating every row directly, with the same result (checked here by breaking them on purpose).
- The space is the one the plain nested loops give, in the same order.
"""

import functools

import numpy as np
import pytest

import memplan.plan.evaluate as evaluation
import memplan.plan.search as planner
from memplan.core.model import ModelSpec
from memplan.core.training import Recompute
from memplan.inventory.types import HF_IMPLS
from memplan.memory.term_bytes import PlanValues
from memplan.memory.timeline import StepPeak
from memplan.plan.estimate import estimate
from memplan.plan.search import search
from memplan.plan.space import Fixed, divisors, enumerate_plans
from memplan.presets.batch import search_inputs
from memplan.presets.catalog import load_gpu, load_model
from memplan.timing.step import step_time

A100 = load_gpu("a100-80gb")
H100 = load_gpu("h100-80gb")
PLAN_FIELDS = ("t", "p", "d", "m", "sp", "zero", "shard", "b", "recompute", "recomputed_layers", "microbatches")
NUMBERS = ("device_bytes", "peak_bytes", "first_stage_peak_bytes", "last_stage_peak_bytes", "retained_bytes",
           "step_time_s", "mfu", "tokens_per_s")


def same_result(fast, ref):
    """Everything a user sees, and every plan's numbers."""
    for name in ("candidates", "feasible", "top", "nearest_miss", "fastest_miss"):
        assert getattr(fast, name) == getattr(ref, name), name
    for i in fast.top + [x for x in (fast.nearest_miss, fast.fastest_miss) if x is not None]:
        assert fast.row(i) == ref.row(i)
    for name in PLAN_FIELDS:
        assert np.array_equal(getattr(fast.evaluated.plans, name), getattr(ref.evaluated.plans, name)), name
    for name in NUMBERS:
        a, b = getattr(fast.evaluated, name), getattr(ref.evaluated, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and np.array_equal(a, b), name


def both(model, training, gpus, gb, budget, **kw):
    return search(model, training, gpus, gb, budget, **kw), search(model, training, gpus, gb, budget, reference=True,
                                                                  **kw)


CASES = {
    "530b on 2240, 80 GB": ("gpt3-530b", 2240, 80 * 10**9, dict(gpu=A100, top=40)),
    "175b on 1024, 80 GB": ("gpt3-175b", 1024, 80 * 10**9, dict(gpu=A100, top=40)),
    "530b on 2240, no fit": ("gpt3-530b", 2240, 10**9, dict(gpu=A100)),
    "530b on 8, no fit": ("gpt3-530b", 8, 80 * 10**9, dict(gpu=A100)),
    "22b on 64, torch, 40 GB": ("gpt-22b", 64, 40 * 10**9, dict(gpu=A100, impl="torch", top=25)),
    "22b on 64, H100, margin": ("gpt-22b", 64, 40 * 10**9, dict(gpu=H100, margin=0.25)),
    "22b on 64, no GPU": ("gpt-22b", 64, 40 * 10**9, dict(gpu=None, top=25)),
    "22b on 64, no GPU, no margin": ("gpt-22b", 64, 40 * 10**9, dict(gpu=None, margin=0.0)),
    "llama3-8b on 8, hf-sdpa": ("llama3-8b", 8, 80 * 10**9, dict(gpu=H100, impl="hf-sdpa", top=50)),
    "llama3-8b on 8, hf-eager": ("llama3-8b", 8, 80 * 10**9, dict(gpu=H100, impl="hf-eager", top=50)),
    "llama3-8b on 64": ("llama3-8b", 64, 80 * 10**9, dict(gpu=H100, top=30)),
    "llama3-70b on 64, max-tp 16": ("llama3-70b", 64, 80 * 10**9, dict(gpu=H100, max_tp=16)),
    "175b on 1024, ZeRO-3": ("gpt3-175b", 1024, 80 * 10**9, dict(gpu=A100, fixed=Fixed(zero=3))),
    "175b on 1024, ZeRO-1 over 4": ("gpt3-175b", 1024, 80 * 10**9, dict(gpu=A100, fixed=Fixed(zero=1, zero_shard=4))),
    "175b on 1024, full recompute": ("gpt3-175b", 1024, 80 * 10**9, dict(gpu=A100, fixed=Fixed(recompute=Recompute.FULL))),
    "175b on 1024, 8 layers recomputed": ("gpt3-175b", 1024, 80 * 10**9,
                                          dict(gpu=A100, fixed=Fixed(recompute=Recompute.FULL, recompute_num_layers=8))),
    "530b on 2240, t=8 p=35": ("gpt3-530b", 2240, 80 * 10**9, dict(gpu=A100, fixed=Fixed(tp=8, pp=35))),
    "530b on 2240, top 0": ("gpt3-530b", 2240, 80 * 10**9, dict(gpu=A100, top=0)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_search_equals_the_reference(case):
    name, gpus, budget, kw = CASES[case]
    model, training, gb = search_inputs(load_model(name), gpus,
                                        training=dict(precision="bf16-true") if kw.get("impl") in HF_IMPLS else None)
    fast, ref = both(model, training, gpus, gb, budget, **kw)
    same_result(fast, ref)


def test_hf_long_sequences_and_foreach():
    model, training, gb = search_inputs(load_model("llama3-8b"), 16, seq_length=32768,
                                        training=dict(precision="bf16-true", optimizer_impl="foreach"))
    same_result(*both(model, training, 16, gb, 80 * 10**9, gpu=H100, impl="hf-sdpa"))


def test_the_ranking_keeps_every_tie():
    """ZeRO-1 and ZeRO-2 plans of the same shard group take the same time: a long top list of a
    space full of ties, ordered by (time, memory, plan number), as the reference sorts them."""
    model, training, gb = search_inputs(load_model("gpt3-175b"), 1024)
    fast, ref = both(model, training, 1024, gb, 80 * 10**9, gpu=A100, top=2000)
    times = ref.evaluated.step_time_s[ref.top]
    assert len(set(times.tolist())) < len(times)  # there are ties to break
    same_result(fast, ref)


TINY = ModelSpec(name="tiny", num_layers=12, hidden_size=256, num_attention_heads=8, seq_length=128, vocab_size=1000)


@pytest.mark.parametrize("gpus, gb", [(4, 4), (2, 4)])
def test_every_plan_equals_estimate(gpus, gb):
    """Every plan of a small space (full recompute of up to 12 layers, pipelines, ZeRO and HSDP):
    the search's numbers are the scalar path's, for each plan alone."""
    training = search_inputs(load_model("gpt-22b"), gpus)[1]
    result = search(TINY, training, gpus, gb, 10**15, gpu=A100)
    e = result.evaluated
    assert result.candidates == len(e.device_bytes) > 200
    assert np.any(e.plans.recomputed_layers >= 5)  # rows the search derives from k = 1 and 2
    for i in range(result.candidates):
        config = result.config(i)
        est = estimate(config, gpu=A100)
        assert int(e.device_bytes[i]) == int(est.flat_total)
        assert int(e.peak_bytes[i]) == int(est.step.peak_bytes)
        assert int(e.first_stage_peak_bytes[i]) == int(est.steps[0].peak_bytes)
        assert int(e.last_stage_peak_bytes[i]) == int(est.steps[-1].peak_bytes)
        assert int(e.retained_bytes[i]) == max(int(est.stages[0].total), int(est.stages[-1].total))
        one = step_time(config.model, config.training, A100, PlanValues.from_config(config), config.global_batch,
                        breakdown=False)
        assert float(one.step_time_s) == float(e.step_time_s[i])
        assert float(one.mfu) == float(e.mfu[i])


def test_a_shortcut_that_fails_its_check_is_not_taken(monkeypatch):
    """Break the two properties the search relies on (memory affine in the recomputed layers k;
    the ZeRO variant acting through the states only, with a gradient buffer): its checks see it and
    it evaluates every row directly, still equal to the reference (which sees the same change)."""
    model, training, gb = search_inputs(load_model("gpt-22b"), 64)
    real = evaluation.step_events
    for extra in (lambda plan: plan.recomputed_layers ** 2 * 1000,  # not affine in k
                  lambda plan: plan.zero * plan.b * 10**6):  # the ZeRO variant times the micro-batch
        def bent(model, inventory, training, plan, stage_mem, stage, critical=False, extra=extra):
            steps = real(model, inventory, training, plan, stage_mem, stage, critical)
            for e in steps.events:
                object.__setattr__(e, "bytes", e.bytes + extra(plan))
            peak = functools.reduce(np.maximum, [e.bytes for e in steps.events])
            return StepPeak(steps.events, peak, 0, steps.persistent_bytes, steps.optimizer_temp_bytes)

        monkeypatch.setattr(evaluation, "step_events", bent)
        same_result(*both(model, training, 64, gb, 40 * 10**9, gpu=A100, top=25))
    monkeypatch.setattr(evaluation, "step_events", real)


def test_any_fits_is_the_fit_count():
    model, training, gb = search_inputs(load_model("llama3-8b"), 8)
    for s in (4096, 65536, 131072, 262144):  # the last two fit no plan
        at_s = model.model_copy(update={"seq_length": s})
        ref = search(at_s, training, 8, gb, 80 * 10**9, gpu=H100, reference=True)
        assert planner.any_fits(at_s, training, 8, gb, 80 * 10**9, gpu=H100) == (ref.feasible > 0)


def _nested_loops(model, gpus, global_batch, fixed=Fixed(), max_tp=8, impl="megatron"):
    """The space as plain loops (the planner's enumeration before it became a table)."""
    a, g, L, s = model.num_attention_heads, model.g, model.num_layers, model.seq_length
    hf = impl in HF_IMPLS
    pick = lambda values, pinned: [v for v in values if pinned is None or v == pinned]  # noqa: E731
    out = []
    for t in pick([t for t in divisors(a) if g % t == 0 and t <= max_tp and (t == 1 or not hf)], fixed.tp):
        for p in pick([p for p in divisors(L) if p == 1 or not hf], fixed.pp):
            if gpus % (t * p):
                continue
            d = gpus // (t * p)
            if (fixed.dp is not None and d != fixed.dp) or global_batch % d:
                continue
            sps = [0] if t == 1 else [x for x in (0, 1) if x == 0 or s % t == 0]
            if fixed.sp is not None:
                sps = [x for x in sps if x == int(fixed.sp)]
            # d = 1: a ZeRO stage over one rank only when pinned (as estimate takes it; issue 23)
            zeros = [(z, k) for z in pick([0, 1, 2, 3] if d > 1 else [0] + ([fixed.zero] if fixed.zero else []),
                                          fixed.zero)
                     for k in ([d] if z == 0 else [k for k in divisors(d) if k > 1 or d == 1])
                     if fixed.zero_shard is None or (z > 0 and k == fixed.zero_shard)]
            for b in pick(divisors(global_batch // d), fixed.micro_batch):
                M = global_batch // (d * b)
                for m in pick(divisors(L // p) if p > 1 else [1], fixed.vpp):
                    if m > 1 and M % p:
                        continue
                    n = L // (p * m)
                    # transformers checkpoints every layer or none (issue 23)
                    rec = [(0, n)] + ([] if hf else [(1, n)]) + [(2, k) for k in range(1 if not hf else n, n + 1)]
                    if fixed.recompute is not None:
                        rec = [r for r in rec if r[0] == fixed.recompute]
                    if fixed.recompute_num_layers is not None:
                        rec = [r for r in rec if r[0] == 2 and r[1] == fixed.recompute_num_layers]
                    out += [(t, p, d, m, sp, z, k, b, r, nr, M) for sp in sps for z, k in zeros for r, nr in rec]
    return out


@pytest.mark.parametrize("name, gpus, kw", [
    ("gpt3-530b", 2240, {}), ("gpt3-175b", 1024, dict(max_tp=16)), ("llama3-8b", 8, dict(impl="hf-sdpa")),
    ("gpt-22b", 64, dict(fixed=Fixed(zero=2, sp=True))), ("gpt-22b", 64, dict(fixed=Fixed(recompute_num_layers=3))),
    ("gpt3-175b", 96, dict(fixed=Fixed(dp=4, vpp=2))),
])
def test_the_space_is_the_nested_loops(name, gpus, kw):
    model, _, gb = search_inputs(load_model(name), gpus)
    plans = enumerate_plans(model, gpus, gb, **kw)
    expected = np.array(_nested_loops(model, gpus, gb, **kw), dtype=np.int64).T
    assert np.array_equal(np.stack([getattr(plans, f) for f in PLAN_FIELDS]), expected)
