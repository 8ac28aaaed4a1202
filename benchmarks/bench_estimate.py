"""Wall time of `memplan estimate --model gpt3-530b` as a user runs it (a new process each time).

Target (issue 2): under 0.3 s on the 2-core development machine. Prints the median of N runs,
and the in-process time of the estimate itself.

    python benchmarks/bench_estimate.py [--runs 15]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()

    exe = shutil.which("memplan")
    cmd = [exe] if exe else [sys.executable, "-m", "memplan.cli"]
    cmd += ["estimate", "--model", "gpt3-530b"]
    subprocess.run(cmd, check=True, capture_output=True)  # warm the file cache
    walls = []
    for _ in range(args.runs):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        walls.append(time.perf_counter() - start)

    from memplan.plan.estimate import estimate
    from memplan.presets.batch import make_config
    from memplan.presets.catalog import load_model

    inproc = []
    for _ in range(args.runs):
        start = time.perf_counter()
        estimate(make_config(load_model("gpt3-530b")))
        inproc.append(time.perf_counter() - start)

    print(f"command: {' '.join(cmd)}")
    print(f"wall time, new process: median {statistics.median(walls) * 1e3:.0f} ms "
          f"(min {min(walls) * 1e3:.0f} ms, max {max(walls) * 1e3:.0f} ms, {args.runs} runs); target < 300 ms")
    print(f"estimate() in process: median {statistics.median(inproc) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
