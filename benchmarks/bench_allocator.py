"""Speed of memplan.memory.allocator.replay on a synthetic training run shaped like a 32-layer 1.6B-parameter model.

The stream: parameters built (7 weight matrices and 2 norms per layer, bf16), then 2 optimizer steps of 3
micro-batches each: per layer the forward keeps ~14 saved tensors (1 KiB norm statistics up to a few hundred
MiB of attention / MLP activations) and makes short-lived transients; the backward walks the layers in reverse,
makes transients and the gradients it accumulates, then frees the layer's saved tensors; AdamW's two states per
parameter appear at the first step, and each step's optimizer makes one foreach temporary per layer. About 30,000
events. Prints the median wall time of 7 replays and events per second.

    PYTHONPATH=. python benchmarks/bench_allocator.py
"""

from __future__ import annotations

import itertools
import statistics
import time

from memplan.memory.alloc_conf import parse_alloc_conf
from memplan.memory.allocator import replay

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


def synthetic_run(layers: int = 32, steps: int = 2, micro_batches: int = 3, hidden: int = 2048,
                  ffn: int = 5504, tokens: int = 8192) -> list[tuple[str, object, int, int]]:
    """(op, tensor_id, size_bytes, stream) events of a bf16 Llama-like training run on one GPU."""
    ids = itertools.count()
    events: list[tuple[str, object, int, int]] = []

    def alloc(size: int) -> int:
        tid = next(ids)
        events.append(("alloc", tid, size, 0))
        return tid

    def free(tid: int) -> None:
        events.append(("free", tid, 0, 0))

    def transient(*sizes: int) -> None:
        tids = [alloc(s) for s in sizes]
        for t in reversed(tids):
            free(t)

    weight_shapes = [hidden * 3 * hidden, hidden * hidden, hidden * ffn, hidden * ffn, ffn * hidden, hidden, hidden]
    for _ in range(layers):  # the parameters, alive for the whole run
        for n in weight_shapes:
            alloc(2 * n)
    act = 2 * tokens * hidden  # one bf16 activation
    saved_sizes = [4 * tokens, act, 3 * act, act, 2 * 32 * tokens * 8, act, 4 * tokens, act,
                   2 * tokens * ffn, 2 * tokens * ffn, 2 * tokens * ffn, act, tokens, 1 * KIB]
    states = None
    grads = None
    for _step in range(steps):
        for _mb in range(micro_batches):
            saved = []
            for _layer in range(layers):
                keep = []
                for s in saved_sizes:
                    keep.append(alloc(s))
                    transient(act, 512, 3 * KIB)
                transient(4 * tokens * 32 * 2, act, 2 * tokens * ffn)
                saved.append(keep)
            logits = alloc(2 * tokens * 32000)
            transient(4 * tokens * 32000, 4 * tokens * 32000)
            free(logits)
            if grads is None:
                grads = [[alloc(2 * n) for n in weight_shapes] for _ in range(layers)]
            for keep in reversed(saved):
                for s in reversed(saved_sizes[:6]):
                    transient(s, act, 2 * KIB)
                transient(2 * tokens * ffn, 2 * tokens * ffn, act, 512)
                for t in reversed(keep):
                    free(t)
        if states is None:
            states = [[alloc(4 * n) for n in weight_shapes for _ in range(2)] for _ in range(layers)]
        for _layer in range(layers):
            transient(*(2 * n for n in weight_shapes))
        for layer in grads:
            for t in layer:
                free(t)
        grads = None
    return events


def main() -> None:
    events = synthetic_run()
    for label, text in (("default", ""), ("expandable_segments:True", "expandable_segments:True"),
                        ("max_split_size_mb:512", "max_split_size_mb:512")):
        config = parse_alloc_conf(text)
        times = []
        for _ in range(7):
            start = time.perf_counter()
            result = replay(events, 80 * GIB, config)
            times.append(time.perf_counter() - start)
        median = statistics.median(times)
        print(f"{label:26s} {len(events):,} events: median {median * 1e3:.1f} ms of 7, "
              f"{len(events) / median:,.0f} events/s; reserved peak {result.reserved_peak_bytes / GIB:.2f} GiB, "
              f"allocated peak {result.allocated_peak_bytes / GIB:.2f} GiB, fits {result.fits}")


if __name__ == "__main__":
    main()
