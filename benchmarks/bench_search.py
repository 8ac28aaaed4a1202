"""Speed of `memplan search`: candidates evaluated, wall time, candidates per second.

    python benchmarks/bench_search.py [--runs 7]

1. The issue's query, gpt3-530b on 2240 A100 80GB with an 80 GB budget, in process (median of
   N runs) and as a new `memplan search` process (what a user waits for).
2. Larger real spaces (more GPUs, t beyond a node), to show how the rate holds as the space grows.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time

from memplan.planner import search
from memplan.presets import load_gpu, load_model, search_inputs


def timed_search(name: str, gpus: int, max_tp: int | None, runs: int) -> tuple[int, float]:
    model, training, gb = search_inputs(load_model(name), gpus)
    gpu = load_gpu("a100-80gb")
    times, n = [], 0
    for _ in range(runs):
        start = time.perf_counter()
        result = search(model, training, gpus, gb, 80 * 10**9, gpu=gpu, max_tp=max_tp)
        times.append(time.perf_counter() - start)
        n = result.candidates
    return n, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()

    cases = [("gpt3-530b", 2240, None), ("gpt3-530b", 2240, 128), ("gpt3-175b", 12288, 96), ("gpt-1t", 16384, 160)]
    print(f"{'query':45s} {'candidates':>11s} {'median s':>9s} {'candidates/s':>13s}")
    for name, gpus, max_tp in cases:
        n, seconds = timed_search(name, gpus, max_tp, args.runs)
        label = f"{name} --gpus {gpus}" + (f" --max-tp {max_tp}" if max_tp else "")
        print(f"{label:45s} {n:>11,d} {seconds:>9.3f} {n / seconds:>13,.0f}")

    exe = shutil.which("memplan")
    cmd = ([exe] if exe else [sys.executable, "-m", "memplan.cli"]) + [
        "search", "--model", "gpt3-530b", "--gpus", "2240", "--mem", "80GB"]
    walls = []
    for _ in range(args.runs):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        walls.append(time.perf_counter() - start)
    print(f"new process `{' '.join(cmd[1:])}`: median {statistics.median(walls):.2f} s wall ({args.runs} runs)")


if __name__ == "__main__":
    main()
