"""Every check that only a GPU can make, in one run against a deadline (the device machine is lent for minutes).

Stages, most valuable first; after each the output directory is packed into ``--tar`` (a run stopped at its limit
still leaves what it finished):
1. ``env.json``: torch, the card, cuDNN, and what a fresh process holds outside PyTorch's pool.
2. ``allocator.json`` + ``alloc/``: ``memplan validate --allocator --device cuda``'s small Llama-shaped runs (issue
   20 item 5), each recorded in a fresh process per allocator setting (the committed CUDA fixtures).
3. ``dropout.json``: traced inventories against what CUDA's kernels save (validation/cuda_dropout.py, issue 22).
4. ``maxseq.jsonl`` + ``llama3-8b/``: memplan's ``--max-seq`` of llama3-8b (transformers sdpa, bf16, one GPU)
   against real runs: the prediction must train, one 1,024-token step more must die (issue 20's done-means); the
   run at the prediction is recorded; where the verdict misses, one more run bounds the longest that trains.

    PYTHONPATH=. python benchmarks/gpu_checks.py --out DIR --tar FILE.tgz --predictions P.json --deadline 500
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Callable, Optional

RUN_TIMEOUT_S = 150  # one llama3-8b run in a fresh process (import, build, two steps)


class Clock:
    def __init__(self, deadline_s: float) -> None:
        self.start = time.monotonic()
        self.deadline_s = deadline_s

    def left(self) -> float:
        return self.deadline_s - (time.monotonic() - self.start)

    def stamp(self) -> str:
        return f"[{time.monotonic() - self.start:6.1f} s]"


def _pack(out: Path, tar: Optional[str]) -> None:
    if tar:
        with tarfile.open(tar, "w:gz") as t:
            t.add(out, arcname=".")


def _stage(name: str, clock: Clock, need_s: float, fn: Callable[[], None], out: Path, tar: Optional[str]) -> None:
    if clock.left() < need_s:
        print(f"{clock.stamp()} {name}: skipped ({clock.left():.0f} s left, needs {need_s:.0f})", flush=True)
        return
    print(f"{clock.stamp()} {name}", flush=True)
    try:
        fn()
    except Exception as e:  # a stage's failure must not cost the stages after it
        import traceback

        (out / f"{name}.error.txt").write_text(traceback.format_exc(), encoding="utf-8")
        print(f"{clock.stamp()} {name} FAILED: {type(e).__name__}: {str(e)[:500]}", flush=True)
    _pack(out, tar)
    print(f"{clock.stamp()} {name} done", flush=True)


def env(out: Path) -> None:
    import torch

    free, total = torch.cuda.mem_get_info()
    data = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "cudnn": torch.backends.cudnn.version(),
            "total_memory": total, "free_after_init": free, "outside_pool_after_init": total - free,
            "capability": list(torch.cuda.get_device_capability())}
    try:
        import transformers

        data["transformers"] = transformers.__version__
    except ImportError:
        pass
    (out / "env.json").write_text(json.dumps(data, indent=1), encoding="utf-8")
    print(data, flush=True)


def allocator(out: Path) -> None:
    from memplan.check.allocator import ALLOCATOR_CASES, allocator_summary, run_allocator
    from memplan.report.formats import allocator_validation_dict

    from concurrent.futures import ThreadPoolExecutor

    (out / "alloc").mkdir(exist_ok=True)
    # the small runs side by side (each in its own process, its own allocator; together well under 1 GB)
    with ThreadPoolExecutor(len(ALLOCATOR_CASES)) as pool:
        results = [r for rs in pool.map(lambda c: run_allocator([c], "cuda", str(out / "alloc")), ALLOCATOR_CASES)
                   for r in rs]
    data = allocator_validation_dict(results, [], allocator_summary(results, []))
    (out / "allocator.json").write_text(json.dumps(data, indent=1, default=str), encoding="utf-8")
    for r in results:
        print(r.case.name, r.allocator, r.checks, r.recorded.reserved_peak_bytes, r.measured.get("max_memory_reserved"),
              r.memplan.reserved_peak_bytes, flush=True)


def dropout(out: Path, predictions: str) -> None:
    from validation import cuda_dropout

    cuda_dropout.main(["measure", "--predictions", predictions, "--out", str(out / "dropout.json")])


def _run(case, s: int, allocator: str, out: Optional[Path]) -> tuple[str, Optional[dict]]:
    """('trains' | 'dies' | 'error: ...', the recording's stats) of one fresh-process run at length s."""
    from memplan.check.allocator import record_cuda

    from validation import alloc_trace

    try:
        rec = record_cuda(case, allocator, out, s, timeout_s=RUN_TIMEOUT_S)
    except alloc_trace.OutOfMemory:
        return "dies", None
    except Exception as e:
        return f"error: {type(e).__name__}: {str(e)[-400:]}", None
    return "trains", (rec.stats if rec is not None else None)


def _child(stage: str, out: Path, predictions: Optional[str], timeout_s: float) -> None:
    """A stage that uses CUDA itself, in a fresh process: this one never makes a CUDA context, which would hold
    part of the card while the max-seq runs need all of it."""
    args = [sys.executable, "-m", f"{__package__}.gpu_checks", "--out", str(out), "--child", stage]
    args += ["--predictions", predictions] if predictions else []
    subprocess.run(args, check=True, timeout=timeout_s)


def max_seq(out: Path, clock: Clock, tar: Optional[str]) -> None:
    from memplan.check.allocator import MAX_SEQ_CASES, MAX_SEQ_STEP, predicted_max_seq
    from memplan.check.peak import card_preset

    env_file = out / "env.json"  # the card's name (the env stage's); no name: the H100's preset
    gpu = card_preset(json.loads(env_file.read_text(encoding="utf-8"))["device"] if env_file.exists() else "")
    rec_dir = out / "llama3-8b"
    rec_dir.mkdir(exist_ok=True)
    order = [(c, a) for rec in ("full", "none") for a in ("default", "expandable") for c in MAX_SEQ_CASES
             if c.recompute == rec]
    for case, alloc in order:
        if clock.left() < 2 * 45:
            print(f"{clock.stamp()} max-seq: stopped, {clock.left():.0f} s left", flush=True)
            break
        t0 = time.monotonic()
        predicted = predicted_max_seq(case, gpu, alloc)
        row = {"case": case.name, "allocator": alloc, "gpu_preset": gpu.name, "predicted": predicted,
               "predict_s": round(time.monotonic() - t0, 2), "runs": {}}
        if predicted is not None:
            name = f"{case.name.replace(' ', '_')}-{alloc}-s{predicted}.json.gz"
            verdict, stats = _run(case, predicted, alloc, rec_dir / name)
            row["runs"][predicted] = verdict
            row["stats_at_predicted"] = stats
            longer = predicted + MAX_SEQ_STEP
            row["runs"][longer] = _run(case, longer, alloc, None)[0]
            if verdict == "dies" and clock.left() > 45:  # unsafe: how far below does it train?
                row["runs"][predicted - MAX_SEQ_STEP] = _run(case, predicted - MAX_SEQ_STEP, alloc, None)[0]
            elif row["runs"][longer] == "trains" and clock.left() > 45:  # too cautious: how far above?
                row["runs"][longer + MAX_SEQ_STEP] = _run(case, longer + MAX_SEQ_STEP, alloc, None)[0]
            row["passed"] = verdict == "trains" and row["runs"][longer] == "dies"
        row["wall_s"] = round(time.monotonic() - t0, 1)
        with open(out / "maxseq.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(row, default=str) + "\n")
        print(f"{clock.stamp()} {json.dumps({k: v for k, v in row.items() if k != 'stats_at_predicted'})}",
              flush=True)
        _pack(out, tar)


def probe(out: Path, clock: Clock, runs: str, tar: Optional[str]) -> None:
    """Named runs, each recorded (to its out-of-memory where it dies): "CASE:ALLOCATOR:S[:S...]" separated by ";",
    CASE a MAX_SEQ_CASES name; the lengths of one entry are tried in order until one trains."""
    from memplan.check.allocator import MAX_SEQ_CASES

    rec_dir = out / "probe"
    rec_dir.mkdir(exist_ok=True)
    for item in runs.split(";"):
        name, alloc, *lengths = item.split(":")
        case = next(c for c in MAX_SEQ_CASES if c.name == name)
        for s in map(int, lengths):
            if clock.left() < 50:
                print(f"{clock.stamp()} probe: stopped, {clock.left():.0f} s left", flush=True)
                return
            verdict, stats = _run(case, s, alloc, rec_dir / f"{name.replace(' ', '_')}-{alloc}-s{s}.json.gz")
            print(f"{clock.stamp()} {name} {alloc} s {s}: {verdict}", flush=True)
            with open(out / "probe.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps({"case": name, "allocator": alloc, "s": s, "verdict": verdict}) + "\n")
            _pack(out, tar)
            if verdict == "trains":
                break


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/gpu_checks.py")
    parser.add_argument("--out", required=True)
    parser.add_argument("--tar")
    parser.add_argument("--predictions", help="validation.cuda_dropout predict's file (else no dropout stage)")
    parser.add_argument("--deadline", type=float, default=500)
    parser.add_argument("--stages", default="env,allocator,dropout,maxseq")
    parser.add_argument("--runs", help="with stage probe: the runs to record (see probe)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # env | dropout: this stage alone, in this process
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    clock = Clock(args.deadline)
    stages = args.stages.split(",")
    if args.child == "env":
        env(out)
        return 0
    if args.child == "dropout":
        dropout(out, args.predictions)
        return 0
    if "env" in stages:
        _stage("env", clock, 0, lambda: _child("env", out, args.predictions, 120), out, args.tar)
    small = []  # the small stages side by side: the allocator's runs and the dropout models use little of the card
    if "allocator" in stages:
        small.append(lambda: _stage("allocator", clock, 60, lambda: allocator(out), out, None))
    if "dropout" in stages and args.predictions:
        small.append(lambda: _stage("dropout", clock, 30, lambda: _child("dropout", out, args.predictions, 200),
                                    out, None))
    if small:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(small)) as pool:
            list(pool.map(lambda f: f(), small))
        _pack(out, args.tar)
    if "maxseq" in stages:
        _stage("maxseq", clock, 90, lambda: max_seq(out, clock, args.tar), out, args.tar)
    if "probe" in stages and args.runs:
        _stage("probe", clock, 50, lambda: probe(out, clock, args.runs, args.tar), out, args.tar)
    print(f"{clock.stamp()} all done", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

