"""memplan's allocation stream with the traced order against the CUDA recordings (issue 20): for each recording, the
reserved and allocated peaks and the request each run died at, recorded, replayed from memplan's stream derived from
the step timeline (memplan/memory/stream.py) and from its stream with every step traced
(memplan/memory/stream_traced.py: the inventory file's `step_order`); with --verdicts, memplan's verdict on the H100 preset at every recorded llama3-8b
length (tests/data/alloc/cuda/h100_runs.json) from both streams. llama3-8b's order is the shipped trace
(configs/traced/llama3-8b/hf-sdpa-cuda.yaml); another model's is traced here (CUDA's kernels, ~10 s of CPU).

    PYTHONPATH=. python benchmarks/layer_replay.py tests/data/alloc/cuda/*.json.gz
    PYTHONPATH=. python benchmarks/layer_replay.py --verdicts tests/data/alloc/cuda/h100_runs.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import memplan
from memplan.check.allocator import ALLOCATOR_CASES, LLAMA3_8B_ORDER, MAX_SEQ_CASES
from memplan.check.peak import card_preset, peak_config
from memplan.memory.reserved import allocation_stream, allocator_config, replay_stream
from validation import layer_match, trace
from validation.alloc_trace import load

H100 = "NVIDIA H100 80GB HBM3"


def order_file(case: dict, tmp: Path) -> Path:
    """The traced inventory file with the step's order of a recorded case's model."""
    if (case["h"], case["L"], case["v"]) == (4096, 32, 128256):
        return LLAMA3_8B_ORDER
    path = tmp / f"h{case['h']}-L{case['L']}.yaml"
    if not path.is_file():
        data = trace.trace_hf_config(layer_match.llama_config(case), kernels="cuda", layer_order=True)
        path.write_text(trace.to_yaml(data))
    return path


def verdicts(runs_file: Path) -> None:
    print("plan | allocator | s | the H100 | memplan's derived stream | memplan's traced stream")
    word = {True: "fits", False: "dies"}
    agree = [0, 0]
    runs = json.loads(runs_file.read_text(encoding="utf-8"))["runs"]
    for run in runs:
        case = next(c for c in MAX_SEQ_CASES if c.name == run["case"])
        fits = [memplan.estimate("llama3-8b", impl="hf-sdpa", gpu="h100-80gb", gpus=1, global_batch=1,
                                 precision="bf16-true", recompute=case.recompute, optimizer_impl=case.optimizer,
                                 seq_len=run["seq_len"], allocator=run["allocator"],
                                 inventory=inventory).estimate.fits for inventory in (None, str(LLAMA3_8B_ORDER))]
        agree = [n + (f == (run["run"] == "trains")) for n, f in zip(agree, fits)]
        print(f"{run['case']} | {run['allocator']} | {run['seq_len']:,} | {run['run']} | {word[fits[0]]} | "
              f"{word[fits[1]]}")
    print(f"agree with the H100: derived {agree[0]} of {len(runs)}, traced {agree[1]} of {len(runs)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/layer_replay.py", description=__doc__.split("\n")[0])
    p.add_argument("recordings", nargs="*", help="CUDA recordings (tests/data/alloc/cuda/*.json.gz)")
    p.add_argument("--verdicts", help="h100_runs.json: memplan's verdicts at its lengths")
    a = p.parse_args(argv)
    if a.verdicts:
        verdicts(Path(a.verdicts))
    workspace = card_preset(H100).workspace_bytes
    print("recording | allocator | recorded reserved (MB = 1e6 B) | derived stream (difference) | traced stream "
          "| recorded allocated peak | derived | traced | the request each died at (B): recorded / derived / traced")
    with tempfile.TemporaryDirectory(prefix="memplan-order-") as tmp:
        for path in a.recordings:
            rec = load(path)
            c = rec.case
            case = next(x for x in ALLOCATOR_CASES + MAX_SEQ_CASES if x.h == c["h"] and x.L == c["L"]
                        and x.optimizer == c["optimizer"] and x.recompute == c["recompute"])
            config = peak_config(dataclasses.replace(case, s=c["s"]))
            traced = config.model_copy(update={"model": config.model.model_copy(
                update={"inventory": str(order_file(c, Path(tmp)))})})
            small = c["L"] == 2  # the small runs shared the GPU: no capacity (tests/test_alloc_stream_cuda.py)
            capacity = (1 << 40) if small else rec.stats["total_memory"] - rec.stats["outside_pool_bytes"]
            allocator = "expandable" if "expandable_segments:True" in rec.alloc_conf else "default"
            derived, ordered = (replay_stream(allocation_stream(x, case.impl, "cuda", workspace_bytes=workspace),
                                              capacity, allocator_config(allocator)) for x in (config, traced))
            measured, peak = rec.stats["max_memory_reserved"], rec.live_peak_bytes

            def shown(x: int, truth: int, fits: bool = True) -> str:
                return f"{x / 1e6:,.1f} ({(x - truth) / 1e6:+,.2f}){'' if fits else ' dies'}"

            died = " / ".join(f"{x:,}" if x else "-" for x in [rec.stats.get("oom_request_bytes")] + [
                r.oom.requested_bytes if r.oom else None for r in (derived, ordered)])
            print(f"{Path(path).name.split('.')[0]} | {allocator} | {measured / 1e6:,.1f} | "
                  f"{shown(derived.reserved_peak_bytes, measured, derived.fits)} | "
                  f"{shown(ordered.reserved_peak_bytes, measured, ordered.fits)} | {peak / 1e6:,.1f} | "
                  f"{shown(derived.requested_peak_bytes, peak)} | {shown(ordered.requested_peak_bytes, peak)} | {died}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
