"""megatron-core's training run recorded allocation by allocation (issue 20 item 5): the run
``validation/mcore_step.py`` measures (GPTModel from the local spec, bf16, DDP with the fp32 gradient buffer and
the bf16 parameter buffer, ``get_megatron_optimizer``'s distributed optimizer over torch AdamW, clip_grad 1.0,
Megatron-LM's train_step) from the model's construction on, for ``steps`` steps, on one gloo rank, under
``alloc_trace.EventTracker`` (every storage an op makes or first uses, and its free, in order; CPU kernels'
internal temporaries are not seen). The events are what memplan's caching-allocator model replays
(tests/test_alloc_fixtures.py).

``record_mcore_run(case, steps)`` -> ``alloc_trace.Recording``. Nothing here predicts: every event is read off
the run.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import warnings

from .alloc_trace import EventTracker, Recording
from .mcore import build
from .mcore_step import McoreStepCase, apply_step_patches, train_step, wrap_for_training
from .ranks import run_ranks


def _record_here(case: McoreStepCase, steps: int) -> Recording:
    warnings.filterwarnings("ignore")
    logging.getLogger("megatron.core").setLevel(logging.ERROR)
    apply_step_patches()
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random

    c = case.model
    ps.initialize_model_parallel(tensor_model_parallel_size=c.t)
    rec = Recording({"model": dataclasses.asdict(c), "dp": case.dp}, "cpu", steps)
    try:
        random.model_parallel_cuda_manual_seed(c.seed + 1)
        torch.manual_seed(c.seed)
        gc.collect()
        tracker = EventTracker()
        with tracker:
            ddp, optimizer = wrap_for_training(build(c))
            marks = [("built", len(tracker.events))]
            for step in range(1, steps + 1):
                marks.append((f"step {step}", len(tracker.events)))
                train_step(ddp, optimizer, c, lambda phase: marks.append((f"{phase} end", len(tracker.events))))
            gc.collect()
        rec.events = tracker.events
        # where each phase ends (``train_step``'s marks: forward with the loss, backward, grad-sync, optimizer):
        # (label, number of events before it)
        rec.stats = {"optimizer": type(optimizer.chained_optimizers[0].optimizer).__name__, "marks": marks}
        return rec
    finally:
        ps.destroy_model_parallel()


def _record_rank(rank: int, world: int, case: McoreStepCase, steps: int) -> Recording:
    return _record_here(case, steps)


def record_mcore_run(case: McoreStepCase, steps: int = 2) -> Recording:
    """``case`` run ``steps`` times from its construction on, on rank 0 of a d x t gloo group; rank 0's events."""
    return run_ranks(_record_rank, case.world, (case, steps))[0]
