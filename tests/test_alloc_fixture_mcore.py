"""memplan's allocation stream of a megatron-core run against a recording of the real code (issue 20 items 1 and 5),
as tests/test_alloc_fixtures.py does for transformers: megatron-core 0.16.1's GPTModel (local spec, Llama-like:
RMSNorm, SwiGLU, RoPE, GQA 4 heads / 2 groups; s 256, b 2, h 256, f 704, v 4,096, 2 layers, bf16), DDP with the
fp32 gradient buffer, the distributed optimizer over torch AdamW (clip_grad 1.0), Megatron-LM's train_step, on one
gloo rank (validation/mcore_alloc.py), built and stepped twice, every storage allocated and freed in order: the
committed gzip fixture tests/data/alloc/mcore-llama-s256.json.gz. memplan's stream of the same plan
(`--impl megatron-local --device cpu`, bf16-mixed, ZeRO-1, for-loop AdamW: memplan/check/mcore_step.py) is compared.

Re-record (half a minute of CPU; deterministic, the figures come out the same):
    PYTHONPATH=. python tests/test_alloc_fixture_mcore.py --record

What matches (checked below): the second step's forward and backward, every request over 1 MiB (kSmallSize: the
large pool, where the size picks the segment) and every free of one, in the recorded order, and the most bytes live
inside that stretch within 0.1 % (measured 31,171,072 B recorded, 31,154,688 B memplan: -0.05 %). Fixed to get
there (each fails this test when undone): the fp32 logits made after the bf16 logits (cross_entropy.py
calculate_logits_max), the unfused SwiGLU's backward (the 2f-wide fc1 output freed before chunk's backward
concatenates the halves' gradients), the output layer's backward (the bf16 gradient of the logits cast while the
fp32 softmax lives, then the output layer's bf16 weight gradient, its own tensor until the hook adds it to the
main gradient).

What does not match (so megatron-core plans keep the flat margin, `Inventory.stream_checked` False): the model's
build and the optimizer. Measured here (`PYTHONPATH=. python tests/test_alloc_fixture_mcore.py`): the whole run's
live peak -1.2 %, reserved peak (replayed) +5.9 % with the default allocator and -9.3 % with expandable segments.
- build: on CPU megatron-core initialises each weight in fp32 and casts it (`_initialize_affine_weight_cpu`, not
  the GPU's in-place init); DDP then allocates one bf16 parameter buffer (7,145,984 B) and the fp32 gradient buffer
  and frees the per-parameter tensors (param_and_grad_buffer.py): memplan keeps the per-parameter tensors;
- optimizer: the distributed optimizer's fp32 masters are one tensor per parameter (distrib_optimizer.py
  `_build_model_and_main_param_groups`: `shard_model_param.clone().float()`), AdamW's moments per parameter in
  step 1: memplan makes one flat shard per state (3 x 14,291,968 B);
- the step: clip_grad's CPU fallback (`local_multi_tensor_scale`: an out-of-place product per gradient) and the
  for-loop AdamW's sqrt / div temporaries per parameter, against memplan's one 8,912,896 B block; in each step's
  gradient sync (start_grad_sync, d = 1) a 14,291,968 B tensor (the gradient buffer's size) made outside the
  dispatcher and freed at once, gloo's by all signs (not checked on NCCL).
"""

import dataclasses
import sys
from pathlib import Path

import pytest

from memplan.check.cases import mcore_case
from memplan.check.mcore_step import IMPL, McoreStep, mcore_step_config
from memplan.check.validate import case_model
from memplan.core.specs import Config
from memplan.memory.allocator import replay
from memplan.memory.reserved import ALLOCATORS, allocation_stream, allocator_config, replay_stream
from memplan.memory.stream_events import Alloc

pytest.importorskip("torch")

from validation.alloc_trace import load, save  # noqa: E402

FIXTURE = Path(__file__).parent / "data" / "alloc" / "mcore-llama-s256.json.gz"
SHAPE = dict(s=256, h=256, v=4096, f=704)  # b 2, a 4, g 2, L 2: mcore_case's
MiB = 1 << 20
CAPACITY = 1 << 36  # as test_alloc_fixtures: nothing released, nothing dies


def config() -> Config:
    base = mcore_step_config(McoreStep("llama"))
    model = case_model(dataclasses.replace(mcore_case("llama", recompute="none", scope="model"), **SHAPE))
    return Config(model=model, parallel=base.parallel, training=base.training)


def _events_ours(stream) -> list:
    return [("alloc", e.id, e.size, 0) if type(e) is Alloc else ("free", e.id, 0, 0) for e in stream.events]


def _stretch(events: list, start: int, end: int) -> tuple[list, int, int]:
    """Within events[start:end]: the requests over 1 MiB and the frees of one, in order; the most bytes live
    (counted from the stretch's start); the bytes live at its end."""
    sizes = {tid: size for op, tid, size, _ in events[:end] if op == "alloc"}
    large, live, peak = [], 0, 0
    for op, tid, size, _ in events[start:end]:
        n = sizes.get(tid, 0)
        live += n if op == "alloc" else -n
        peak = max(peak, live)
        if n > MiB:
            large.append((op, n))
    return large, peak, live


def step_two() -> tuple[tuple, tuple]:
    """The second step's forward and backward: (recorded, memplan's) `_stretch`."""
    rec = load(FIXTURE)
    marks = rec.stats["marks"]
    at = next(i for i, (label, _) in enumerate(marks) if label == "step 2")
    start, end = marks[at][1], next(n for label, n in marks[at:] if label == "backward end")
    ours = allocation_stream(config(), IMPL, "cpu")
    phases = dict(ours.phases)
    return (_stretch(rec.events, start, end),
            _stretch(_events_ours(ours), phases["step 2"], phases["optimizer step 2"]))


def test_the_second_steps_forward_and_backward_are_the_recorded_order():
    (real_large, real_peak, real_end), (our_large, our_peak, our_end) = step_two()
    assert len(real_large) == 18  # the fixture as recorded: 9 requests over 1 MiB, each freed in the step
    assert our_large == real_large
    assert abs(our_peak - real_peak) <= 0.001 * real_peak
    assert real_end == our_end == 0  # the step's forward and backward leave nothing behind


def test_the_recording_is_the_run_memplan_plans():
    # the whole run's most bytes live (build, optimizer, two steps) within 2 % (measured -1.2 %: the build's and the
    # optimizer's order differ, module docstring), and the fixture is megatron-core's fallback optimizer
    rec = load(FIXTURE)
    ours = allocation_stream(config(), IMPL, "cpu")
    assert rec.stats["optimizer"] == "AdamW"
    assert abs(ours.peak_bytes - rec.live_peak_bytes) <= 0.02 * rec.live_peak_bytes


def _record() -> None:
    from validation.mcore import McoreCase
    from validation.mcore_alloc import record_mcore_run
    from validation.mcore_step import McoreStepCase

    c = mcore_case("llama", recompute="none", scope="model")
    model = McoreCase("llama", s=SHAPE["s"], b=c.b, h=SHAPE["h"], a=c.a, f=SHAPE["f"], g=c.g, v=SHAPE["v"], L=c.L,
                      recompute="none", scope="model", p_drop=c.dropout, backend="live")
    save(record_mcore_run(McoreStepCase(model, 1)), FIXTURE)


def _table() -> None:
    rec = load(FIXTURE)
    ours = allocation_stream(config(), IMPL, "cpu")
    print(f"live peak: recorded {rec.live_peak_bytes:,} B, memplan {ours.peak_bytes:,} B")
    for a in ALLOCATORS:
        real = replay(rec.events, CAPACITY, allocator_config(a))
        mine = replay_stream(ours, CAPACITY, allocator_config(a))
        err = mine.reserved_peak_bytes - real.reserved_peak_bytes
        print(f"{a:10s} reserved peak recorded {real.reserved_peak_bytes:,} B "
              f"({real.segments_at_reserved_peak} segments)"
              f" | memplan {mine.reserved_peak_bytes:,} B ({mine.segments_at_reserved_peak} segments) | {err:+,} B "
              f"({err / real.reserved_peak_bytes:+.1%})")
    (_, rp, _), (_, op, _) = step_two()
    print(f"step 2 forward + backward, most bytes live: recorded {rp:,} B, memplan {op:,} B ({(op - rp) / rp:+.2%})")


if __name__ == "__main__":
    if "--record" in sys.argv:
        _record()
    _table()
