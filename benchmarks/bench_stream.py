"""Speed of the allocation stream (memplan/memory/stream.py) and of its replay through the caching allocator model
(memplan/memory/allocator.py replay_ops), as `estimate` runs them (issue 20: a 32-layer step of tens of thousands of
events replayed in well under 0.1 s).

Build: llama3-8b (32 layers), p = 1, Megatron-LM and transformers (hf-sdpa), the run of 2 steps; prints the events
and the build time (best of 10). Replay: the same streams through the default allocator (capacity 1 TB, so the run
completes) and the stream `estimate --model gpt3-530b` replays (its most loaded stage: interleaved 1F1B, p = 35,
vpp = 3, 2p micro-batches per step, 2 steps), on the budget estimate replays it on; best of 10 each, CPU seconds of
this process (the machine is shared: its wall time is noisier), with the load average.

    PYTHONPATH=. python benchmarks/bench_stream.py
"""

import dataclasses
import os
import time

from memplan import estimate
from memplan.memory.alloc_conf import AllocatorConfig
from memplan.memory.allocator import replay_ops
from memplan.memory.pipeline import replayed_microbatches
from memplan.memory.reserved import allocation_stream
from memplan.memory.stage import stage_memory
from memplan.memory.stream import stream_for
from memplan.memory.term_bytes import PlanValues
from memplan.presets.batch import make_config
from memplan.presets.catalog import load_model
from memplan.inventory.assemble import training_inventory


def best(run, times: int = 10) -> tuple[float, object]:
    """The least CPU seconds of `times` runs, and the last answer."""
    least, answer = float("inf"), None
    for _ in range(times):
        start = time.process_time()
        answer = run()
        least = min(least, time.process_time() - start)
    return least, answer


def gpt3_530b_stream():
    """The stream of the stage that decides `estimate --model gpt3-530b` (memplan/plan/stage_verdict.py) and its
    capacity."""
    result = estimate("gpt3-530b")
    config, reserved = result.config, result.estimate.reserved
    inventory = training_inventory(config.model, "megatron", "cuda", config.training)
    plan = PlanValues.from_config(config)
    plan = dataclasses.replace(plan, microbatches=replayed_microbatches(reserved.stage, int(plan.p), int(plan.m),
                                                                        int(plan.microbatches)))
    mem = stage_memory(config.model, inventory.terms, config.training, plan, reserved.stage,
                       granularity=inventory.granularity, layout=inventory.weight_layout)
    workspace = result.estimate.gpu.workspace_bytes  # one thread's; the stream makes the two

    def build():
        return stream_for(config.model, inventory, config.training, plan, reserved.stage, mem,
                          workspace_bytes=workspace)
    return build, reserved.capacity_bytes


def main() -> None:
    print(f"load average {os.getloadavg()[0]:.2f}; CPU seconds of this process, best of 10")
    for impl, micro_batches in (("megatron", 1), ("megatron", 8), ("hf-sdpa", 1), ("hf-sdpa", 8)):
        config = make_config(load_model("llama3-8b"), parallel=dict(tp=1, pp=1, dp=1),
                             training=dict(micro_batch=1, global_batch=micro_batches),
                             whole_model_per_rank=impl.startswith("hf-"))
        allocation_stream(config, impl=impl)  # warm: the inventory and its caches
        built, stream = best(lambda: allocation_stream(config, impl=impl, steps=2))
        ops = stream.ops()
        replayed, result = best(lambda: replay_ops(ops, 10 ** 12, AllocatorConfig()))
        print(f"llama3-8b {impl:9s} M = {micro_batches}: {len(stream.events):7,d} events, built in "
              f"{built * 1e3:6.1f} ms ({built / len(stream.events) * 1e6:.2f} us per event), replayed in "
              f"{replayed * 1e3:6.1f} ms ({replayed / len(ops) * 1e6:.2f} us per event; fits {result.fits})")
    build, capacity = gpt3_530b_stream()
    built, stream = best(build)
    ops = stream.ops()
    replayed, result = best(lambda: replay_ops(ops, capacity, AllocatorConfig()))
    print(f"gpt3-530b interleaved stage {stream.stage}: {len(stream.events):,d} events, built in {built * 1e3:.1f} ms, "
          f"replayed in {replayed * 1e3:.1f} ms ({replayed / len(ops) * 1e6:.2f} us per event; fits {result.fits}, "
          f"reserved peak {result.reserved_peak_bytes / 2 ** 30:.2f} GiB)")


if __name__ == "__main__":
    main()
