"""megatron-core's vocab-parallel cross-entropy, unfused and with ``--cross-entropy-loss-fusion`` (native), on CPU.

``compute_language_model_loss`` (megatron/core/models/common/language_module/language_module.py, 0.16.1) calls
``tensor_parallel.vocab_parallel_cross_entropy`` (eager torch ops) unless ``cross_entropy_loss_fusion`` is set; with
``cross_entropy_fusion_impl='native'`` it calls ``fusions/fused_cross_entropy.fused_vocab_parallel_cross_entropy``,
whose four pieces are ``jit_fuser`` = ``torch.compile`` (megatron/core/jit.py): on CPU inductor generates C++ kernels
(gcc). Both functions run here as megatron-core ships them, on bf16 logits [s, b, v] made by a ``clone`` of a leaf
(the output layer's logits: a fresh tensor whose gradient the clone passes on as it is), over a one-rank gloo group.

Compiled code allocates its buffers in C++ without the dispatcher, so ``instruments.LiveTracker`` cannot see them (and
torch.compile runs eagerly under a dispatch mode). The bytes are read off torch.profiler's allocation events
(``profile_memory=True``: every CPU allocation and free, in time order). Before the measured call each function runs
once (the compilation). ``forward_peak``, ``after_forward`` and ``backward_peak`` are bytes alive made since the
measured call began (the logits included), the peak of each phase; the labels exist before.

Nothing here computes a byte count from a formula; every number is read off an allocation.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .ranks import run_ranks


@dataclass
class LossMeasurement:
    fused: bool
    s: int
    b: int
    v: int
    logits_bytes: int  # the bf16 logits [s, b, v]
    forward_peak: int
    after_forward: int  # what the loss keeps for its backward (the logits freed)
    backward_peak: int


def _allocations(prof) -> list[tuple[int, int]]:
    from torch._C._profiler import _EventType

    out, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.typed[0] == _EventType.Allocation:
            out.append((node.start_time_ns, node.typed[1].alloc_size))
    return sorted(out)


def allocation_peak(prof, start: int) -> tuple[int, int]:
    """The peak and the final bytes alive, from `start` bytes, over the profile's allocations."""
    live = peak = start
    for _, n in _allocations(prof):
        live += n
        peak = max(peak, live)
    return peak, live


def _measure_rank(rank: int, world: int, s: int, b: int, v: int) -> list[LossMeasurement]:
    from torch.profiler import ProfilerActivity, profile

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    ps.initialize_model_parallel(1)
    try:
        group = ps.get_tensor_model_parallel_group()
        out = []
        for fused in (False, True):
            def loss_of(leaf, labels):
                logits = leaf.clone()
                if fused:
                    return fused_vocab_parallel_cross_entropy(logits, labels, group)
                return vocab_parallel_cross_entropy(logits, labels)

            for measured in (False, True):  # the first call compiles
                torch.manual_seed(0)
                leaf = torch.randn(s, b, v, dtype=torch.bfloat16, requires_grad=True)
                labels = torch.randint(0, v, (s, b))
                with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as fwd:
                    loss = loss_of(leaf, labels).sum()
                with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as bwd:
                    loss.backward()
                    del loss
            forward_peak, after = allocation_peak(fwd, 0)
            backward_peak, _ = allocation_peak(bwd, after)
            out.append(LossMeasurement(fused, s, b, v, s * b * v * 2, forward_peak, after, backward_peak))
        return out
    finally:
        ps.destroy_model_parallel()


def measure_mcore_loss(s: int = 32, b: int = 2, v: int = 256) -> list[LossMeasurement]:
    """[unfused, fused native] megatron-core cross-entropy on CPU, in one spawned gloo process."""
    return run_ranks(_measure_rank, 1, (s, b, v))[0]


def main(argv: list[str]) -> None:
    """Print the two measurements; with a path, write them there as JSON (tests/data/mcore_cross_entropy.json)."""
    import dataclasses
    import importlib.metadata
    import json

    got = measure_mcore_loss()
    for m in got:
        print(m)
    if argv:
        doc = {"command": "PYTHONPATH=. python -m validation.mcore_loss " + argv[0],
               "measured_with": f"megatron-core {importlib.metadata.version('megatron-core')}, torch {torch.__version__}",
               "cases": [dataclasses.asdict(m) for m in got]}
        with open(argv[0], "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.write("\n")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
