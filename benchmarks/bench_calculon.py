"""memplan against Calculon (NVIDIA's LLM performance model) on the same plans: plans per second
of each, in one process, as medians of N runs after one warm-up run.

    CALCULON_PATH=/path/to/calculon python benchmarks/bench_calculon.py [--runs 5] [--calculon-own-logging]

CALCULON_PATH is a source tree of https://github.com/calculon-ai/calculon (the folder holding its
`calculon/` package and `systems/`; a git clone, so that its commit is printed). Calculon's package imports pandas and psutil (its search
commands need them; the per-plan API used here does not): run with an interpreter that has them
and memplan's dependencies, e.g. a separate venv:

    python3 -m venv /tmp/calc-venv && /tmp/calc-venv/bin/pip install numpy pandas psutil click rich pydantic pyyaml
    CALCULON_PATH=/tmp/calculon /tmp/calc-venv/bin/python benchmarks/bench_calculon.py

Without CALCULON_PATH, or when Calculon cannot be imported, it says why and prints memplan's side.

The matched space: gpt3-530b (configs/models/gpt3-530b.yaml) on 2240 A100 80GB, global batch
2,240 sequences (the preset's 280 scaled to 2240 GPUs, as `memplan search` does). Each plan is
one memplan enumerates (memplan.plan.space.plan_space: t <= 8 dividing a, p dividing L, d = 2240/(tp),
b dividing 2240/d, m dividing L/p with M divisible by p when m > 1, SP on/off) restricted to what
Calculon can express, and mapped to Calculon's Llm.Execution field by field:

  t, p, d, b, m        tensor_par, pipeline_par, data_par, microbatch_size, pipeline_interleaving
  SP on / off          tensor_par_comm_type 'rs_ag' (sequence parallelism) / 'p2p_rs_ag' (all-reduce,
                       pipeline sends split over t and all-gathered: Megatron-LM's scatter/gather,
                       which memplan models without SP); 'ar' when t = 1
  recompute            none -> 'none', selective -> 'attn_only', full of all L/(pm) layers of a chunk
                       -> 'full'; memplan's full recompute of 1 .. L/(pm) - 1 layers (Megatron-LM's
                       block method) has no Calculon counterpart: left out
  ZeRO                 0 -> optimizer_sharding False; 2 over all d ranks -> optimizer_sharding True
                       (Calculon shards the optimizer states and the weight gradients, as ZeRO 2;
                       memplan's ZeRO 1 has the same step time, more gradient memory); memplan's
                       ZeRO 1 and 3 and the HSDP shard groups k < d: left out
  fixed for Calculon   (options memplan has not, set to what memplan assumes) seq_par_ag_redo True
                       with SP unless recompute is full (SP stores the 1/t input and all-gathers it
                       again in the backward, K22 section 4.2.2 and memplan's inventory), else False;
                       data_par_overlap True (memplan overlaps the gradient reduction per bucket);
                       tensor_par_overlap 'none'; no weight / activation / optimizer offload;
                       fused_activation True; attention 'multihead'; datatype 'float16' (the system
                       file has no bfloat16 entry: the same 2 bytes and 312 TFLOP/s on an A100);
                       the tensor-parallel group on network 0 (NVLink, 8 GPUs), pipeline and data
                       parallelism on network 1 (InfiniBand), as memplan places them at 2240 GPUs
  system               Calculon's systems/a100_80g.json unchanged; memplan's configs/gpus/a100-80gb.yaml
  budget               80 GiB per GPU, Calculon's mem1 and memplan's preset memory

The model is Calculon's application JSON built from memplan's ModelSpec (hidden, feedforward,
seq_size, attn_heads, attn_size = h/a, num_blocks). Calculon models the transformer blocks only:
no embedding, LM head or loss (memplan does), so step times and memory differ by those too.

Timing. Both sides get the matched plans ready-made (memplan as the arrays `evaluate` takes, Calculon
as Llm.Execution arguments); enumerating them is not timed. memplan: `evaluate` on the plans (the
device memory, the step peak and the step time of every plan, vectorised; each plan's numbers equal
`search`'s), and, for scale, `search` over memplan's whole space from the model to the ranked
result, enumeration included. Calculon: per plan, in process, what its own
`llm-optimal-execution` does, less the stats dictionary it builds for each good plan:
`Llm(app, log)`, `compile(system, Llm.Execution(...))`, `run(system)` (an `Llm.Error` from `run` is
a plan over the memory), then `get_total_time()` and `get_mem_tier1_cap_req()`. The application
and system objects are built once. Its logger is disabled (`log.disabled = True`): Calculon's own
search passes `logging.Logger('sub')`, which has no level, so every `log.debug` in compile and run
builds a record that nothing prints; `--calculon-own-logging` times that too.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

HERE = Path(__file__).resolve().parent.parent
if str(HERE) not in sys.path:  # run with any interpreter that has memplan's dependencies
    sys.path.insert(0, str(HERE))

from memplan.memory.term_bytes import PlanValues  # noqa: E402
from memplan.plan.evaluate import evaluate  # noqa: E402
from memplan.plan.search import search  # noqa: E402
from memplan.plan.space import plan_space  # noqa: E402
from memplan.presets.batch import search_inputs  # noqa: E402
from memplan.presets.catalog import load_gpu, load_model  # noqa: E402
from memplan.core.model import ModelSpec  # noqa: E402
from memplan.core.training import Recompute  # noqa: E402

MODEL, GPUS, GPU = "gpt3-530b", 2240, "a100-80gb"
SHARDED_ZERO = 2  # the memplan ZeRO stage (over all d ranks) matched to Calculon's optimizer_sharding
RECOMPUTE = {int(Recompute.NONE): "none", int(Recompute.SELECTIVE): "attn_only", int(Recompute.FULL): "full"}


def median_runs(fn: Callable[[], Any], runs: int) -> tuple[float, Any]:
    """Median seconds of `runs` calls after one warm-up call, and the last call's result."""
    result = fn()
    seconds = []
    for _ in range(runs):
        start = time.perf_counter()
        result = fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), result


# --- memplan ------------------------------------------------------------------------------------
def matched_plans(model: ModelSpec, global_batch: int) -> tuple[PlanValues, int]:
    """memplan's plans that Calculon can express (module docstring), and memplan's plan count."""
    space = plan_space(model, GPUS, global_batch)
    flat = space.flat()
    whole_chunk = model.num_layers // (flat.p * flat.m)
    keep = (((flat.recompute != Recompute.FULL) | (flat.recomputed_layers == whole_chunk))
            & ((flat.zero == 0) | ((flat.zero == SHARDED_ZERO) & (flat.shard == flat.d))))
    return flat.take(np.flatnonzero(keep)), space.count


def describe(plans: PlanValues, i: int) -> str:
    rec = {0: "no-recompute", 1: "selective", 2: "full"}[int(plans.recompute[i])]
    return (f"t={plans.t[i]} p={plans.p[i]} d={plans.d[i]} b={plans.b[i]} m={plans.m[i]} "
            f"{'SP' if plans.sp[i] else 'no-SP'} {rec} ZeRO-{plans.zero[i]}")


# --- Calculon -----------------------------------------------------------------------------------
def load_calculon() -> tuple[Any, str]:
    """(calculon module, its source tree) or (None, why not)."""
    path = os.environ.get("CALCULON_PATH")
    if not path:
        return None, "CALCULON_PATH is not set"
    tree = Path(path).expanduser().resolve()
    if not (tree / "calculon" / "__init__.py").is_file():
        return None, f"CALCULON_PATH={path} holds no calculon/ package"
    sys.path.insert(0, str(tree))
    try:
        import calculon
    except ImportError as exc:
        return None, (f"Calculon at {tree} cannot be imported ({exc}); its package imports pandas and psutil: "
                      "run with an interpreter that has them (module docstring)")
    return calculon, str(tree)


def calculon_commit(tree: str) -> str:
    try:
        out = subprocess.run(["git", "-C", tree, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if out.returncode == 0:
            return out.stdout.strip()
    except OSError:
        pass
    return "unknown (not a git work tree; the commit of the snapshot it came from)"


def application(model: ModelSpec) -> dict[str, int]:
    """Calculon's application JSON for a memplan model (GPT layout: the q width is h)."""
    return {"hidden": model.hidden_size, "feedforward": model.f, "seq_size": model.seq_length,
            "attn_heads": model.num_attention_heads, "attn_size": model.hidden_size // model.num_attention_heads,
            "num_blocks": model.num_layers}


def executions(plans: PlanValues, global_batch: int) -> list[tuple]:
    """Each plan as Calculon's Llm.Execution arguments, in the order of Llm.Execution.fields()."""
    out = []
    for i in range(len(plans.t)):
        t, p, d, b, m = (int(v[i]) for v in (plans.t, plans.p, plans.d, plans.b, plans.m))
        sp, rec, sharded = bool(plans.sp[i]), RECOMPUTE[int(plans.recompute[i])], bool(plans.zero[i])
        comm = "rs_ag" if sp else ("p2p_rs_ag" if t > 1 else "ar")
        out.append((
            GPUS, t, p, d,
            0, 1, 1,  # tensor_par_net (NVLink), pipeline_par_net, data_par_net (InfiniBand)
            global_batch, b, "float16", True, "multihead", rec, m, sharded, comm,
            "none",  # tensor_par_overlap
            sp and rec != "full",  # seq_par_ag_redo
            d > 1,  # data_par_overlap
            False, False, False,  # weight, activations, optimizer offload
            True,  # training
        ))
    return out


def calculon_evaluate(Llm: Any, app: Any, system: Any, exes: list[tuple], log: logging.Logger) -> list[tuple]:
    """(fits, step seconds, tier-1 memory bytes) of every execution; None where compile refused it."""
    out = []
    for values in exes:
        model = Llm(app, log)
        try:
            model.compile(system, Llm.Execution(*values))
        except Llm.Error:
            out.append((False, None, None))
            continue
        try:
            model.run(system)
            fits = True
        except Llm.Error:  # raised by the memory check, after every time is computed
            fits = False
        out.append((fits, model.get_total_time(), model.get_mem_tier1_cap_req()))
    return out


def rank(times: np.ndarray, fit: np.ndarray, i: int) -> str:
    """Plan i's place among the plans that fit, fastest first."""
    if not fit[i]:
        return "over the budget"
    return f"#{int(np.count_nonzero(fit & (times < times[i]))) + 1} of {int(fit.sum()):,} that fit"


def spread(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> str:
    ratio = a[mask] / b[mask]
    if not len(ratio):
        return "no plans"
    return f"median {np.median(ratio):.2f} (range {ratio.min():.2f} - {ratio.max():.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--calculon-own-logging", action="store_true",
                        help="also time Calculon with the logger its own search passes (records made, not printed)")
    args = parser.parse_args()

    model, training, global_batch = search_inputs(load_model(MODEL), GPUS)
    gpu = load_gpu(GPU)
    budget = gpu.memory_bytes  # 80 GiB: Calculon's a100_80g mem1 too

    plans, whole = matched_plans(model, global_batch)
    n = len(plans.t)
    print(f"{MODEL} on {GPUS} {GPU}, global batch {global_batch:,} sequences, {budget / 2**30:g} GiB per GPU")
    print(f"memplan's space: {whole:,} plans; matched to Calculon's execution options: {n:,} plans "
          f"(ZeRO 0 / ZeRO-{SHARDED_ZERO} over d, full recompute of whole chunks only)")
    mp_s, mp = median_runs(lambda: evaluate(model, training, plans, gpu, global_batch), args.runs)
    mp_fit = mp.device_bytes <= budget
    search_s, result = median_runs(lambda: search(model, training, GPUS, global_batch, budget, gpu=gpu), args.runs)

    rows = [("memplan: evaluate, the matched plans", n, mp_s, int(mp_fit.sum())),
            ("memplan: search, its whole space", result.candidates, search_s, result.feasible)]
    calculon, where = load_calculon()
    cal = None
    if calculon is not None:
        Llm = calculon.Llm
        app = Llm.Application(application(model))
        with open(Path(where) / "systems" / "a100_80g.json") as f:
            system = calculon.System(json.load(f))
        exes = executions(plans, global_batch)
        log = logging.Logger("calculon-bench")
        log.disabled = True
        cal_s, cal = median_runs(lambda: calculon_evaluate(Llm, app, system, exes, log), args.runs)
        rows.append(("Calculon: compile + run per plan, logging off", n, cal_s, sum(1 for c in cal if c[0])))
        if args.calculon_own_logging:
            own_s, _ = median_runs(lambda: calculon_evaluate(Llm, app, system, exes, logging.Logger("sub")), args.runs)
            rows.append(("Calculon: the same, its search's logger", n, own_s, sum(1 for c in cal if c[0])))

    print(f"\n{'':48s} {'plans':>9s} {'median':>10s} {'plans/s':>12s} {'fit':>6s}")
    for label, count, seconds, fit in rows:
        print(f"{label:48s} {count:>9,d} {seconds:>9.4f}s {count / seconds:>12,.0f} {fit:>6,d}")
    print(f"medians of {args.runs} runs after one warm-up, one process (Python {sys.version.split()[0]}, "
          f"numpy {np.__version__}); fit: by each tool's own memory model within the budget")
    if calculon is None:
        print(f"\nCalculon not run: {where}")
        return
    print(f"memplan / Calculon on the same {n:,} plans: {cal_s / mp_s:,.0f}x the plans per second "
          f"(memplan's whole-space search: {(result.candidates / search_s) / (n / cal_s):,.0f}x)")
    print(f"Calculon {where} at commit {calculon_commit(where)}")

    # A few plans side by side (no assertion: the two models differ, docs/step_time.md)
    cal_time = np.array([c[1] if c[1] is not None else np.inf for c in cal])
    cal_mem = np.array([c[2] if c[2] is not None else np.inf for c in cal])
    cal_fit = np.array([c[0] for c in cal])
    mp_time = np.asarray(mp.step_time_s, dtype=np.float64)
    k22 = np.flatnonzero((plans.t == 8) & (plans.p == 35) & (plans.d == 8) & (plans.b == 1) & (plans.m == 3)
                         & (plans.sp == 1) & (plans.recompute == Recompute.SELECTIVE) & (plans.zero == 0))
    picks = [("K22's 2240-GPU plan", int(k22[0]))] if len(k22) else []
    if mp_fit.any():
        picks.append(("memplan's fastest that fits", int(np.flatnonzero(mp_fit)[np.argmin(mp_time[mp_fit])])))
    if cal_fit.any():
        picks.append(("Calculon's fastest that fits", int(np.flatnonzero(cal_fit)[np.argmin(cal_time[cal_fit])])))
    print(f"\n{'':30s} {'plan':44s} {'memplan step':>12s} {'device mem':>11s} {'Calculon step':>13s} {'tier-1 mem':>11s}")
    for label, i in picks:
        print(f"{label:30s} {describe(plans, i):44s} {mp_time[i]:>11.2f}s {mp.device_bytes[i] / 1e9:>8.2f} GB "
              f"{cal_time[i]:>12.2f}s {cal_mem[i] / 1e9:>8.2f} GB")
    for label, i in picks[1:]:
        print(f"{label}: memplan's {rank(mp_time, mp_fit, i)}, Calculon's {rank(cal_time, cal_fit, i)}")
    timed = np.isfinite(cal_time)
    both = mp_fit & cal_fit
    print(f"fit by both {int(both.sum()):,}, by memplan only {int((mp_fit & ~cal_fit).sum()):,}, "
          f"by Calculon only {int((~mp_fit & cal_fit).sum()):,}; Calculon / memplan step time: {spread(cal_time, mp_time, both)} "
          f"over the plans both fit, {spread(cal_time, mp_time, timed)} over all {int(timed.sum()):,}")
    print("GB = 10^9 bytes; memplan's device memory is its step peak + fragmentation margin + runtime, "
          "Calculon's tier-1 memory its weights, gradients, optimizer and activations of the blocks")


if __name__ == "__main__":
    main()
