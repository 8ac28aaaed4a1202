"""The cost of the step-peak model (memplan/memory/timeline.py) inside `estimate` and `search`.

    python benchmarks/bench_peak.py [--runs 9]

For each query it prints the median time of the whole call and of its step-peak part measured on
the same inputs in the same run: `estimate` evaluates the critical moments of every stage and walks
every event of the most loaded one (`step_peaks`); the planner evaluates the critical moments of the
first and last stage (`step_events(critical=True)`) on the plan arrays. The rest of each call (saved activations, states, step time, report data) is
what memplan computed before the peak model; "x slower" is whole / (whole - peak part).
To compare with an older commit, run benchmarks/bench_estimate.py and bench_search.py there and here.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

from memplan.plan.estimate import estimate, step_peaks
from memplan.memory.stage import stage_memory
from memplan.memory.term_bytes import PlanValues
from memplan.plan.evaluate import evaluate
from memplan.plan.space import enumerate_plans
from memplan.presets.batch import make_config, search_inputs
from memplan.presets.catalog import load_gpu, load_model
from memplan.inventory.assemble import inventory_for
from memplan.memory.timeline import step_events


def median_s(fn: Callable[[], object], runs: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def line(label: str, whole: float, part: float) -> None:
    print(f"{label:52s} {whole * 1e3:9.1f} ms {part * 1e3:9.1f} ms {part / whole:7.1%} {whole / (whole - part):7.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=9)
    args = parser.parse_args()
    print(f"{'query':52s} {'whole':>12s} {'peak part':>12s} {'share':>7s} {'vs none':>8s}")

    for name, impl, over in (("gpt3-530b", "megatron", {}),
                             ("llama3-8b", "hf-sdpa", dict(parallel=dict(tp=1, pp=1, dp=1, sp=False),
                                                           training=dict(global_batch=1)))):
        config = make_config(load_model(name), whole_model_per_rank=impl.startswith("hf-"), **over)
        gpu = load_gpu(load_model(name).gpu)
        inventory = inventory_for(config.model, impl)
        whole = median_s(lambda: estimate(config, gpu=gpu, impl=impl), args.runs)
        plan = PlanValues.from_config(config)
        stages = [stage_memory(config.model, inventory.terms, config.training, plan, i, granularity=inventory.granularity)
                  for i in range(config.parallel.pp)]
        part = median_s(lambda: (step_peaks(config, inventory, plan, stages),
                                 step_peaks(config, inventory, plan, stages, walk=0)), args.runs)
        line(f"estimate {name} ({impl}, {config.parallel.pp} stages)", whole, part)

    for name, gpus in (("gpt3-530b", 2240), ("gpt3-175b", 12288)):
        model, training, gb = search_inputs(load_model(name), gpus)
        gpu = load_gpu("a100-80gb")
        plans = enumerate_plans(model, gpus, gb, max_tp=8)
        inventory = inventory_for(model, "megatron")
        mems = [stage_memory(model, inventory.terms, training, plans, s, granularity=inventory.granularity)
                for s in (0, plans.p - 1)]

        def peaks() -> None:
            for stage, mem in zip((0, plans.p - 1), mems):
                step_events(model, inventory, training, plans, mem, stage, critical=True)

        whole = median_s(lambda: evaluate(model, training, plans, gpu, gb), args.runs)
        part = median_s(peaks, args.runs)
        line(f"search evaluation {name} on {gpus} GPUs ({len(plans.t):,} plans)", whole, part)


if __name__ == "__main__":
    main()
