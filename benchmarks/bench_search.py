"""Speed of `memplan search` (and of a new `memplan estimate` process) against the targets of
issue 13, as medians of N runs, optionally side by side with another checkout ("before").

    python benchmarks/bench_search.py [--runs 7] [--baseline DIR]

DIR is a checkout of another commit, for example the one before the speed work:

    mkdir -p /tmp/memplan-base && git archive d86129d | tar -x -C /tmp/memplan-base

Each in-process figure is measured in a child process (the checkout on its PYTHONPATH) after one
warm-up search; a new process is the `memplan` command (as its installed script starts it) from
start to exit, what a user waits for, with Python's bytecode cache written by a warm-up run as an
installation has it (PYTHONDONTWRITEBYTECODE is dropped for the children: with it every module is
compiled again in every process). The machine is shared: compare figures of one run only, and read
medians, not single runs.

Targets: the 530B / 2240 GPU search < 50 ms in process and < 0.4 s as a new process; `estimate`
< 0.25 s as a new process; the ~1.5 M-plan 175B / 12288 GPU search (--max-tp 96) < 0.5 s, every
plan evaluated (tests/test_planner_exhaustive.py: the same result as evaluating each plan).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent

TIMER = r"""
import json, sys, time
from memplan.plan.search import search
from memplan.presets.batch import search_inputs
from memplan.presets.catalog import load_gpu, load_model
name, gpus, max_tp, runs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) or None, int(sys.argv[4])
model, training, gb = search_inputs(load_model(name), gpus)
gpu = load_gpu("a100-80gb")
search(model, training, gpus, gb, 80 * 10**9, gpu=gpu, max_tp=max_tp)  # warm-up
seconds = []
for _ in range(runs):
    start = time.perf_counter()
    result = search(model, training, gpus, gb, 80 * 10**9, gpu=gpu, max_tp=max_tp)
    seconds.append(time.perf_counter() - start)
print(json.dumps({"candidates": result.candidates, "feasible": result.feasible, "seconds": seconds}))
"""

# (label, model, GPUs, --max-tp, target seconds in process or None)
SEARCHES = [
    ("search gpt3-530b --gpus 2240", "gpt3-530b", 2240, None, 0.050),
    ("search gpt3-530b --gpus 2240 --max-tp 128", "gpt3-530b", 2240, 128, None),
    ("search gpt3-175b --gpus 12288 --max-tp 96", "gpt3-175b", 12288, 96, 0.5),
    ("search gpt-1t --gpus 16384 --max-tp 160", "gpt-1t", 16384, 160, None),
]
PROCESSES = [
    ("new process: search gpt3-530b --gpus 2240 --mem 80GB",
     ["search", "--model", "gpt3-530b", "--gpus", "2240", "--mem", "80GB"], 0.4),
    ("new process: estimate --model gpt3-530b", ["estimate", "--model", "gpt3-530b"], 0.25),
]


# the installed `memplan` script: argv[0] names the command, then memplan.cli.main runs
COMMAND = "import sys; sys.argv[0] = 'memplan'; from memplan.cli import main; sys.exit(main())"


def env_for(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree)
    env.pop("MEMPLAN_CONFIGS", None)  # each checkout reads its own presets
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def in_process(tree: Path, name: str, gpus: int, max_tp: int | None, runs: int) -> dict:
    out = subprocess.run([sys.executable, "-c", TIMER, name, str(gpus), str(max_tp or 0), str(runs)],
                         env=env_for(tree), cwd=tree, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def new_process(trees: list[Path], args: list[str], runs: int) -> list[list[float]]:
    """Wall time of `memplan ARGS` per tree, runs interleaved (they share the noise)."""
    walls: list[list[float]] = [[] for _ in trees]
    for tree in trees:  # warm the file cache and write the bytecode cache
        subprocess.run([sys.executable, "-c", COMMAND, *args], env=env_for(tree), cwd=tree, check=True,
                       capture_output=True)
    for _ in range(runs):
        for i, tree in enumerate(trees):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", COMMAND, *args], env=env_for(tree), cwd=tree, check=True,
                           capture_output=True)
            walls[i].append(time.perf_counter() - start)
    return walls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--baseline", type=Path, help="a checkout of another commit to compare with")
    args = parser.parse_args()
    trees = [HERE] + ([args.baseline.resolve()] if args.baseline else [])

    cols = f"{'':48s} {'plans':>10s} {'fit':>8s}"
    cols += f" {'before':>9s} {'after':>9s} {'speed-up':>9s}" if args.baseline else f" {'median':>9s}"
    print(cols + f" {'target':>8s} {'/target':>8s}")
    for label, name, gpus, max_tp, target in SEARCHES:
        after = in_process(HERE, name, gpus, max_tp, args.runs)
        line = f"{label:48s} {after['candidates']:>10,d} {after['feasible']:>8,d}"
        now = statistics.median(after["seconds"])
        if args.baseline:
            before = in_process(args.baseline, name, gpus, max_tp, args.runs)
            then = statistics.median(before["seconds"])
            line += f" {then:>8.3f}s {now:>8.3f}s {then / now:>8.1f}x"
            if (before["candidates"], before["feasible"]) != (after["candidates"], after["feasible"]):
                line += f" (before: {before['candidates']:,} plans, {before['feasible']:,} fit)"
        else:
            line += f" {now:>8.3f}s"
        if target:
            line += f" {'< ' + format(target, 'g') + 's':>8s} {now / target:>8.2f}"
        print(line, flush=True)
    for label, cli_args, target in PROCESSES:
        walls = new_process(trees, cli_args, args.runs)
        now = statistics.median(walls[0])
        line = f"{label:48s} {'':>10s} {'':>8s}"
        if args.baseline:
            then = statistics.median(walls[1])
            line += f" {then:>8.3f}s {now:>8.3f}s {then / now:>8.1f}x"
        else:
            line += f" {now:>8.3f}s"
        print(line + f" {'< ' + format(target, 'g') + 's':>8s} {now / target:>8.2f}", flush=True)
    print(f"medians of {args.runs} runs; in process: after one warm-up search; /target below 1 meets the target")
    print(f"load average {os.getloadavg()[0]:.2f} (1 min), {os.getloadavg()[1]:.2f} (5 min)")


if __name__ == "__main__":
    main()
