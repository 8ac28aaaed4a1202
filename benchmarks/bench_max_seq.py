"""In-process time of `estimate --max-seq` and `search --max-seq` (issue 20: the longest length on the caching
allocator's verdict; target: estimate --max-seq under 1 s), as the API runs them.

Each plan is answered `--runs` times in this process (the presets and inventories cached after the first, as a
user's second command would not have them: the first run is left out); prints the median and the answer. Plans:
llama3-8b on one H100 (hf-sdpa, full recompute: the replay is the default allocator's), the same with fused AdamW
and a global batch of 1 (issue 20's target: under 1 s; one micro-batch per step, so llama3-8b's shipped traced
inventory by default, its stream made from the traced step's order: memplan/plan/estimate.py traced_default,
memplan/memory/stream_traced.py), the same with --frag-margin 0 (the replay alone decides), a
Megatron-LM plan of llama3-8b on 8 GPUs with --frag-margin 0, and gpt3-530b as the README runs it.

    python benchmarks/bench_max_seq.py [--runs 5] [--cpu]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from memplan import estimate, search

ONE_GPU = dict(impl="hf-sdpa", precision="bf16-true", gpus=1, micro_batch=1, recompute="full", gpu="h100-80gb")
MEGATRON = dict(gpus=8, tp=2, pp=2, dp=2, vpp=1, sp=True, zero=0, micro_batch=1, recompute="selective",
                seq_len=4096, gpu="h100-80gb", frag_margin=0.0)
PLANS = [
    ("estimate llama3-8b hf-sdpa 1 GPU", lambda: estimate("llama3-8b", max_seq=True, **ONE_GPU).max_seq_len),
    ("estimate llama3-8b hf-sdpa 1 GPU fused AdamW, global batch 1 (issue 20's target; the traced inventory, its order)",
     lambda: estimate("llama3-8b", max_seq=True, optimizer_impl="fused", global_batch=1, **ONE_GPU).max_seq_len),
    ("estimate llama3-8b hf-sdpa 1 GPU --frag-margin 0",
     lambda: estimate("llama3-8b", max_seq=True, frag_margin=0.0, **ONE_GPU).max_seq_len),
    ("estimate llama3-8b t2 p2 d2 --frag-margin 0", lambda: estimate("llama3-8b", max_seq=True, **MEGATRON).max_seq_len),
    ("search llama3-8b t2 p2 d2 --frag-margin 0 (pinned)",
     lambda: search("llama3-8b", max_seq=True, all_variants=True, **MEGATRON).result.max_seq_len),
    ("estimate gpt3-530b", lambda: estimate("gpt3-530b", max_seq=True).max_seq_len),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--cpu", action="store_true", help="CPU seconds of the process (time.process_time) instead "
                        "of wall seconds, less moved by other processes on a loaded machine")
    args = parser.parse_args()
    clock = time.process_time if args.cpu else time.perf_counter
    for label, run in PLANS:
        answer = run()  # the first run reads the presets and builds the inventories
        times = []
        for _ in range(args.runs):
            start = clock()
            run()
            times.append(clock() - start)
        print(f"{label}: {answer:,} tokens, median {statistics.median(times):.3f} {'CPU' if args.cpu else 'wall'} s "
              f"of {args.runs} runs")
    print(f"load average {os.getloadavg()[0]:.2f} (1 min), {os.getloadavg()[1]:.2f} (5 min)")


if __name__ == "__main__":
    main()
