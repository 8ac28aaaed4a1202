"""The planner: its vectorised memory equals `estimate`'s, byte for byte; the budget filter;
the K22 530B plan family; bad input."""

import functools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.plan.estimate import estimate
from memplan.memory.term_bytes import PlanValues
from memplan.plan.search import search
from memplan.plan.space import Fixed, enumerate_plans
from memplan.presets.batch import search_inputs
from memplan.presets.catalog import load_gpu, load_model
from memplan.core.training import Recompute

A100 = load_gpu("a100-80gb")


def space(name, gpus, **fixed):
    model, training, gb = search_inputs(load_model(name), gpus)
    return model, training, gb


@pytest.fixture(scope="module")
def result_530b():
    model, training, gb = space("gpt3-530b", 2240)
    return search(model, training, 2240, gb, 80 * 10**9, gpu=A100, top=20)


@functools.lru_cache(maxsize=None)
def searched(name, gpus):
    """The search of a test_vectorised_equals_estimate case, once per case: its 60 examples draw a plan of one of three
    searches (each search, with the fields of every plan it computes on first use, ~0.7 s of CPU)."""
    model, training, gb = space(name, gpus)
    return search(model, training, gpus, gb, 10**15, gpu=A100, top=1)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([("gpt3-530b", 2240), ("gpt3-175b", 64), ("gpt-22b", 16)]), st.integers(0, 10**9))
def test_vectorised_equals_estimate(case, seed):
    name, gpus = case
    result = searched(name, gpus)
    i = seed % result.candidates
    config = result.config(i)
    est = estimate(config, gpu=A100)
    e = result.evaluated
    # the step peak at the planner's critical moments equals estimate's walk over every event of
    # every stage, and so does what the device needs
    assert int(e.peak_bytes[i]) == int(est.step.peak_bytes)
    assert int(e.first_stage_peak_bytes[i]) == int(est.steps[0].peak_bytes)
    assert int(e.last_stage_peak_bytes[i]) == int(est.steps[-1].peak_bytes)
    assert int(e.device_bytes[i]) == int(est.flat_total)
    assert int(e.retained_bytes[i]) == max(int(est.stages[0].total), int(est.stages[-1].total))
    # the same step-time model on one plan gives the same number
    from memplan.timing.step import step_time

    one = step_time(config.model, config.training, A100, PlanValues.from_config(config), config.global_batch)
    assert float(one.step_time_s) == pytest.approx(float(result.evaluated.step_time_s[i]), rel=1e-12)


def test_candidates_are_distinct_and_valid():
    model, training, gb = space("gpt3-530b", 2240)
    plans = enumerate_plans(model, 2240, gb)
    rows = np.stack([plans.t, plans.p, plans.d, plans.m, plans.sp, plans.zero, plans.shard, plans.b,
                     plans.recompute, plans.recomputed_layers])
    assert len(np.unique(rows, axis=1).T) == len(plans.t)
    assert np.all(plans.t * plans.p * plans.d == 2240)
    assert np.all(model.num_layers % (plans.p * plans.m) == 0)
    assert np.all(gb % (plans.b * plans.d) == 0)
    assert np.all((plans.sp == 0) | (plans.t > 1))
    assert np.all((plans.zero == 0) | (plans.d > 1))
    assert np.all(plans.d % plans.shard == 0)
    assert np.all((plans.zero > 0) | (plans.shard == plans.d))  # no shard group without sharding
    assert np.all((plans.zero == 0) | (plans.shard > 1))  # a shard of one rank is no sharding


def test_k22_family_fits_530b_on_2240(result_530b):
    e = result_530b.evaluated
    x = e.plans
    k22 = (x.t == 8) & (x.sp == 1) & (x.recompute == Recompute.SELECTIVE)
    fits = e.device_bytes <= 80 * 10**9
    assert np.any(k22 & fits)
    # K22's own plan: t=8, p=35, d=8, b=1, m=3, SP + selective, no optimizer sharding.
    own = k22 & (x.p == 35) & (x.d == 8) & (x.b == 1) & (x.m == 3) & (x.zero == 0)
    assert np.any(own & fits)


def test_full_recompute_slower_than_selective_same_tpd(result_530b):
    e = result_530b.evaluated
    x = e.plans
    base = (x.t == 8) & (x.p == 35) & (x.d == 8) & (x.b == 1) & (x.m == 3) & (x.zero == 0) & (x.sp == 1)
    sel = np.flatnonzero(base & (x.recompute == Recompute.SELECTIVE))
    full = np.flatnonzero(base & (x.recompute == Recompute.FULL) & (x.recomputed_layers == 1))
    assert len(sel) == 1 and len(full) == 1
    assert e.step_time_s[full[0]] > e.step_time_s[sel[0]]


def test_ranked_by_step_time_and_all_fit(result_530b):
    times = [result_530b.evaluated.step_time_s[i] for i in result_530b.top]
    assert times == sorted(times)
    assert all(result_530b.evaluated.device_bytes[i] <= 80 * 10**9 for i in result_530b.top)


def test_impossible_budget_gives_nearest_miss():
    model, training, gb = space("gpt3-530b", 2240)
    result = search(model, training, 2240, gb, 10**9, gpu=A100)
    assert result.top == [] and result.feasible == 0
    assert result.nearest_miss == int(np.argmin(result.evaluated.device_bytes))


def test_hsdp_shard_group_memory():
    # ZeRO-1 over a shard group of k ranks keeps 12/k optimizer bytes per parameter instead of 12/d.
    model, training, gb = space("gpt3-530b", 2240)
    result = search(model, training, 2240, gb, 10**15, gpu=A100, top=1,
                    fixed=Fixed(tp=8, pp=35, vpp=1, micro_batch=1, sp=True, recompute=Recompute.SELECTIVE, zero=1))
    x = result.evaluated.plans
    assert set(x.d) == {8} and sorted(set(x.shard)) == [2, 4, 8]
    for i in range(result.candidates):
        est = estimate(result.config(i))
        params = est.stages[0].params
        assert est.stages[0].optimizer == -(-12 * params // int(x.shard[i]))


def test_fixed_dimensions_pin_the_space():
    model, training, gb = space("gpt3-530b", 2240)
    plans = enumerate_plans(model, 2240, gb, Fixed(tp=8, pp=35, recompute=Recompute.SELECTIVE))
    assert set(plans.t) == {8} and set(plans.p) == {35} and set(plans.recompute) == {Recompute.SELECTIVE}


def test_search_cli_json(run_cli):
    code, out, _ = run_cli("search", "--model", "gpt3-530b", "--gpus", "2240", "--mem", "80GB", "--json", "--top", "3")
    data = json.loads(out)
    assert code == 0
    assert data["candidates_evaluated"] >= data["feasible"] > 0
    assert len(data["plans"]) == 3
    for plan in data["plans"]:
        assert {"tp", "pp", "dp", "micro_batch", "vpp", "sp", "recompute", "zero", "memory", "step_time_s",
                "mfu"} <= set(plan)
        assert plan["memory"]["device_bytes"] <= 80 * 10**9
        assert 0 < plan["mfu"] < 1


def test_emit_megatron(run_cli):
    code, out, _ = run_cli("search", "--model", "gpt3-530b", "--gpus", "2240", "--mem", "80GB", "--tp", "8",
                           "--pp", "35", "--vpp", "3", "--sp", "--recompute", "selective", "--zero", "0",
                           "--micro-batch", "1", "--emit", "megatron")
    for flag in ("--tensor-model-parallel-size 8", "--pipeline-model-parallel-size 35", "--sequence-parallel",
                 "--recompute-granularity selective", "--num-layers-per-virtual-pipeline-stage 1",
                 "--micro-batch-size 1", "--global-batch-size 2240"):
        assert flag in out


def test_emit_megatron_hsdp(run_cli):
    code, out, _ = run_cli("search", "--model", "gpt3-530b", "--gpus", "2240", "--tp", "8", "--pp", "35",
                           "--zero", "1", "--zero-shard", "4", "--emit", "megatron", "--top", "1")
    # d = 2240 / (8 * 35) = 8 ranks, sharded in groups of 4: two distributed-optimizer instances
    assert "--use-distributed-optimizer" in out and "--num-distributed-optimizer-instances 2" in out


def test_require_fit_exit_1(run_cli):
    code, out, _ = run_cli("search", "--model", "gpt3-530b", "--gpus", "8", "--mem", "80GB", "--require-fit")
    assert code == 1 and "nearest miss" in out
    code, _, _ = run_cli("search", "--model", "gpt3-530b", "--gpus", "8", "--mem", "80GB")
    assert code == 0


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--gpus", "0", "--mem", "80GB"], "GPU count must be positive"),
        (["--gpus", "2240", "--mem", "80"], "unit"),
        (["--gpus", "11", "--global-batch", "280", "--mem", "80GB"], "no plan of gpt3-530b divides 11 GPUs"),
        (["--gpus", "100", "--tp", "8", "--pp", "35", "--mem", "80GB"], "not divisible by t*p"),
        (["--mem", "80GB"], "--gpus is required"),
    ],
)
def test_search_bad_input(run_cli, args, fragment):
    code, _, err = run_cli("search", "--model", "gpt3-530b", *args)
    assert code == 2 and len(err.strip().splitlines()) == 1 and fragment in err, err


def test_progress_bar_only_after_the_delay():
    import io

    from rich.console import Console

    from memplan.report.search_tables import DelayedProgress

    out = io.StringIO()
    quiet = DelayedProgress(Console(file=out), delay=3600)
    quiet(1, 2)
    assert quiet.bar is None  # a fast search shows no bar
    shown = DelayedProgress(Console(file=out), delay=0)
    calls = []
    model, training, gb = space("gpt3-530b", 2240)
    search(model, training, 2240, gb, 80 * 10**9, gpu=A100, chunk=50_000,
           progress=lambda done, total: (calls.append((done, total)), shown(done, total)))
    shown.close()
    assert shown.bar is not None and calls[-1][0] == calls[-1][1] and len(calls) > 1


@pytest.mark.parametrize("impl", ["hf-sdpa", "torch"])
def test_search_times_the_plans_with_their_implementation(impl):
    """search, its plans' numbers and estimate time a plan with the kernels of the implementation
    that runs it (eager PyTorch ops move more bytes than Megatron-LM's fused kernels), not with
    Megatron-LM's: the same plan differs in step time between the two implementations."""
    from memplan.timing.step import step_time

    name = "llama3-8b" if impl == "hf-sdpa" else "gpt-22b"
    model, training, gb = space(name, 8)
    result = search(model, training, 8, gb, 10**15, gpu=A100, top=3, impl=impl)
    i = result.top[0]
    config = result.config(i)
    plan = PlanValues.from_config(config)
    own = float(step_time(config.model, config.training, A100, plan, config.global_batch, impl=impl).step_time_s)
    megatron = float(step_time(config.model, config.training, A100, plan, config.global_batch).step_time_s)
    assert own != pytest.approx(megatron, rel=1e-3)
    assert float(result.evaluated.step_time_s[i]) == pytest.approx(own, rel=1e-12)
    assert float(estimate(config, gpu=A100, impl=impl).perf.step_time_s) == pytest.approx(own, rel=1e-12)
