"""In-process time of the caching allocator's verdict (issue 20 item 4): the 530B / 2240 GPU search with its listed
plans replayed against the same search without the replays (target: at most 2x), the making of its listed plans'
streams alone (`run_stream`, as memplan/plan/stage_verdict.py makes them: every pipeline stage of a listed plan, up
to the first whose run dies), their replays alone (`replay_ops`), and `estimate --max-seq` on gpt3-530b (target:
under 1 s), as medians of N runs, optionally beside another checkout ("before").

    python benchmarks/bench_verdict.py [--runs 3] [--rounds 3] [--baseline DIR] [--cpu]

DIR is a checkout of another commit, e.g. `mkdir -p /tmp/base && git archive f26f385 | tar -x -C /tmp/base`. Each
checkout is timed in `--rounds` child processes (its tree on PYTHONPATH; the checkouts in turn, so that they share
the load), each after one warm-up run of each command (presets and inventories cached, as in a second command of
one process). "without replays" is the same API call with
plan/verdict.py's `replay_listing` replaced by the arrangement alone (`arrange`): the vectorised search, its
listing arranged and folded, nothing replayed. The machine is shared: compare figures of one run, read medians;
`--cpu` times CPU seconds of the process (time.process_time) instead of wall seconds, less moved by other processes
on a loaded machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent

TIMER = r"""
import json, sys, time
import memplan.api.searching as searching
import memplan.plan.estimate as estimate_module
from memplan.memory.allocator import replay_ops
from memplan import estimate, search
from memplan.plan.arrange import arrange

runs = int(sys.argv[1])
clock = time.process_time if sys.argv[2] == "cpu" else time.perf_counter
replayed = searching.replay_listing


def unreplayed(result, sort="time", fold=True, top=10, replay=None):
    arrange(result, sort, fold, top)
    return result


def search_530b():
    return search("gpt3-530b", gpus=2240, mem="80GB").result.feasible


def search_530b_unreplayed():
    searching.replay_listing = unreplayed
    try:
        return search("gpt3-530b", gpus=2240, mem="80GB").result.feasible
    finally:
        searching.replay_listing = replayed


captured = []  # the listed plans' streams (as replay_ops takes them) and capacities, from one search
made = []  # the arguments each of those streams was made with
try:  # where the verdict makes and replays the streams: every stage (plan/stage_verdict.py) or, before, estimate.py
    import memplan.plan.stage_verdict as verdict_module
except ImportError:
    verdict_module = estimate_module
replay_run, run_stream = verdict_module.replay_run, verdict_module.run_stream


def capture(stream, capacity, settings, try_expandable=True, **kwargs):  # kwargs: ops, where the tree takes them
    captured.append((kwargs.get("ops") or stream.ops(), capacity))
    return replay_run(stream, capacity, settings, try_expandable, **kwargs)


def capture_made(*args, **kwargs):
    made.append((args, kwargs))
    return run_stream(*args, **kwargs)


verdict_module.replay_run, verdict_module.run_stream = capture, capture_made
search_530b()
verdict_module.replay_run, verdict_module.run_stream = replay_run, run_stream


def streams():
    for args, kwargs in made:
        run_stream(*args, **kwargs)
    return len(made)


def replays():
    for ops, capacity in captured:
        replay_ops(ops, capacity)
    return len(captured)


CASES = {
    "search gpt3-530b --gpus 2240 --mem 80GB": search_530b,
    "  the same without replays": search_530b_unreplayed,
    "  its listed plans' streams made alone": streams,
    "  its listed plans' replays alone": replays,
    "estimate gpt3-530b --max-seq": lambda: estimate("gpt3-530b", max_seq=True).max_seq_len,
    "estimate gpt3-530b --max-seq --frag-margin 0":
        lambda: estimate("gpt3-530b", max_seq=True, frag_margin=0.0).max_seq_len,
}
out = {}
for label, run in CASES.items():
    answer = run()
    seconds = []
    for _ in range(runs):
        start = clock()
        run()
        seconds.append(clock() - start)
    out[label] = {"answer": answer, "seconds": seconds}
print(json.dumps(out))
"""


def timed(tree: Path, runs: int, clock: str = "wall") -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    env.pop("MEMPLAN_CONFIGS", None)  # each checkout reads its own presets
    out = subprocess.run([sys.executable, "-c", TIMER, str(runs), clock], env=env, cwd=tree, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3, help="timed runs per child process")
    parser.add_argument("--rounds", type=int, default=3, help="child processes per checkout, taken in turn")
    parser.add_argument("--baseline", type=Path, help="a checkout of another commit to compare with")
    parser.add_argument("--cpu", action="store_true", help="CPU seconds of the process instead of wall seconds")
    args = parser.parse_args()
    columns = [("after" if args.baseline else "median", HERE)]
    if args.baseline:
        columns.insert(0, ("before", args.baseline.resolve()))
    figures: dict[str, dict] = {}
    for _ in range(args.rounds):  # the checkouts in turn, so that they share the machine's load
        for name, tree in columns:
            for label, case in timed(tree, args.runs, "cpu" if args.cpu else "wall").items():
                figures.setdefault(name, {}).setdefault(label, {"answer": case["answer"], "seconds": []})
                figures[name][label]["seconds"] += case["seconds"]
    print(f"{'':48s}" + "".join(f" {name:>18s}" for name, _ in columns))
    for label in figures[columns[0][0]]:
        line = f"{label:48s}"
        for name, _ in columns:
            case = figures[name][label]
            line += f" {statistics.median(case['seconds']):>8.3f} s {case['answer']:>7,d}"
        print(line)
    line = f"{'  ratio, with / without replays (target <= 2)':48s}"
    for name, _ in columns:
        with_, without = (statistics.median(figures[name][k]["seconds"]) for k in
                          ("search gpt3-530b --gpus 2240 --mem 80GB", "  the same without replays"))
        line += f" {with_ / without:>8.2f} x {'':7s}"
    print(line)
    print(f"{'CPU' if args.cpu else 'wall'} seconds, medians of {args.rounds} x {args.runs} runs in process (after a "
          f"warm-up run in each of {args.rounds} "
          "child processes per checkout, taken in turn); the number beside each time is its answer: "
          "plans that fit, streams replayed, or the longest length in tokens")
    print(f"load average {os.getloadavg()[0]:.2f} (1 min), {os.getloadavg()[1]:.2f} (5 min)")


if __name__ == "__main__":
    main()
