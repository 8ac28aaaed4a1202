"""Speed of the allocation stream (memplan/memory/stream.py): llama3-8b (32 layers), p = 1, Megatron-LM and
transformers (hf-sdpa), the run of 2 steps; prints the events and the build time (best of 10)."""

import time

from memplan.memory.reserved import allocation_stream
from memplan.presets.batch import make_config
from memplan.presets.catalog import load_model


def main() -> None:
    for impl, micro_batches in (("megatron", 1), ("megatron", 8), ("hf-sdpa", 1), ("hf-sdpa", 8)):
        config = make_config(load_model("llama3-8b"), parallel=dict(tp=1, pp=1, dp=1),
                             training=dict(micro_batch=1, global_batch=micro_batches),
                             whole_model_per_rank=impl.startswith("hf-"))
        allocation_stream(config, impl=impl)  # warm: the inventory and its caches
        best = float("inf")
        for _ in range(10):
            start = time.perf_counter()
            stream = allocation_stream(config, impl=impl, steps=2)
            best = min(best, time.perf_counter() - start)
        print(f"llama3-8b {impl:9s} M = {micro_batches}: {len(stream.events):7,d} events in {best * 1e3:6.1f} ms "
              f"({best / len(stream.events) * 1e6:.2f} us per event)")


if __name__ == "__main__":
    main()
