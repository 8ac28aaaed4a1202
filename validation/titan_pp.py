"""torchtitan 0.3.0's pipeline parallelism on CPU: what each stage keeps for the backward under torch's 1F1B / GPipe.

``pp_rank`` is one rank of a 2-stage run over gloo: the tiny torchtitan Llama 3 of validation/titan.py
(``build_model``, the sdpa inner attention, in bf16 as FSDP2's mixed precision would run it), split with
torchtitan's own ``_generate_llm_fqn_per_model_part`` and ``_split_module`` (its ``pipeline_llm`` path), one
``PipelineStage`` per rank, and torch's ``Schedule1F1B`` or ``ScheduleGPipe`` over ``microbatches`` micro-batches,
the loss torchtitan's (``cross_entropy`` of the fp32 logits) on the last stage.  ``chunks`` > 1: torchtitan's
multi-stage path (``Interleaved1F1B``, ``InterleavedZeroBubble``, ``LoopedBFS``; ``ZBVZeroBubble``, ``DualPipeV``):
``world x chunks`` virtual stages split by the same function, rank r holding stages r, r + world, ...
(``_get_pp_rank_to_stage_indices_mapping``'s loop style) or, for the V schedules, r and 2 world - 1 - r (its "v"
style), all its ``PipelineStage`` objects given to the schedule.

What is measured: the most bytes of saved-for-backward tensors alive at once during the step, per stage
(``saved_tensors_hooks``: each saved tensor's storage counted once while any saved reference to it lives; the
stage's parameters are not counted).  The zero-bubble schedules split a backward into I (input gradients) and W
(weight gradients): torch's ``stage_backward_input`` keeps, from I to W, the gradients flowing into the nodes where
the input and the weight paths meet (``param_groups``' "grads"; not saved tensors): ``grads_peak`` is the most bytes of
those alive at once (each storage once), ``held_peak`` the most of saved tensors + those together.  The pipeline's own buffers (received inputs, kept outputs) are not saved
tensors and are not in this figure.  No FSDP (one rank per stage): the states are not measured here.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .titan import Shape, build_model, loader_positions
from .titan_dsv3 import DsvShape, dsv3_model_config
from .titan_moe import MoeShape, moe_model_config

V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
MULTI = ("Interleaved1F1B", "InterleavedZeroBubble", "LoopedBFS") + V_SCHEDULES


class _SavedPeak:
    """saved_tensors_hooks that track the live bytes of saved storages (parameters excluded) and their peak."""

    def __init__(self, params) -> None:
        self.params = {StorageWeakRef(p.untyped_storage()) for p in params}
        self.refs: dict = {}
        self.live = self.peak = self.pending = self.grads_peak = self.held_peak = 0

    def pack(self, t):
        if t.device.type == "meta":  # the stage's shape inference
            return t
        key = StorageWeakRef(t.untyped_storage())
        if key in self.params:
            return t
        if key not in self.refs:
            self.refs[key] = 0
            self.live += t.untyped_storage().nbytes()
            self.peak = max(self.peak, self.live)
            self.held_peak = max(self.held_peak, self.live + self.pending)
        self.refs[key] += 1
        return _Held(self, key, t.detach())  # detached: a saved output kept with its grad_fn would be a cycle

    @staticmethod
    def unpack(held):
        return held.t if isinstance(held, _Held) else held

    def grads(self, delta: int) -> None:  # I -> W gradients (see module), counted beside the saved tensors
        self.pending += delta
        self.grads_peak = max(self.grads_peak, self.pending)
        self.held_peak = max(self.held_peak, self.live + self.pending)

    def drop(self, key, nbytes: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= nbytes


def _grad_bytes(param_groups) -> int:
    """Bytes of the distinct storages of the I -> W gradients in torch's ``param_groups``."""
    seen = {}
    for group in param_groups or ():
        for grads in group.get("grads") or ():
            for g in grads or ():
                if isinstance(g, torch.Tensor):
                    seen[StorageWeakRef(g.untyped_storage())] = g.untyped_storage().nbytes()
    return sum(seen.values())


def _track_split_backward(stage, saved: "_SavedPeak") -> None:
    """Count the I -> W gradients a split backward keeps in ``stage.backward_state`` until its W."""
    backward, weight, pending = stage.backward_one_chunk, stage.backward_weight_one_chunk, {}

    def backward_one_chunk(chunk_id, *args, **kwargs):
        out = backward(chunk_id, *args, **kwargs)
        state = stage.backward_state.get(chunk_id)
        if state is not None:
            pending[chunk_id] = _grad_bytes(state[1])
            saved.grads(pending[chunk_id])
        return out

    def backward_weight_one_chunk(chunk_id, *args, **kwargs):
        out = weight(chunk_id, *args, **kwargs)
        saved.grads(-pending.pop(chunk_id, 0))
        return out

    stage.backward_one_chunk, stage.backward_weight_one_chunk = backward_one_chunk, backward_weight_one_chunk


class _Held:
    def __init__(self, owner: _SavedPeak, key, t) -> None:
        self.owner, self.key, self.t, self.n = owner, key, t, t.untyped_storage().nbytes()

    def __del__(self) -> None:
        self.owner.drop(self.key, self.n)


def pp_rank(rank: int, world: int, shape, layers: int, vocab: int, s: int, b: int, microbatches: int,
            schedule: str, chunks: int = 1, dense: int = 1) -> dict:
    """One stage of a ``world``-stage pipeline step: its modules, the peak of its saved tensors' bytes (see module).
    ``shape`` a validation/titan.py Shape (Llama 3) or a validation/titan_moe.py MoeShape (Qwen3 MoE, balanced
    routing, no EP: each stage's experts whole) or a validation/titan_dsv3.py DsvShape (torchtitan's DeepSeek-V3 of
    ``layers`` layers, its first ``dense`` dense, the rest MoE; balanced routing, no EP, FlexAttention's save set in
    the stand-in op)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part, _split_module

    torch.manual_seed(0)
    if isinstance(shape, DsvShape):
        whole = dsv3_model_config(shape, vocab, n_layers=layers, n_dense=dense).build()
    elif isinstance(shape, MoeShape):
        whole = moe_model_config(shape, layers, vocab).build()
    else:
        whole = build_model(shape, layers, vocab)
    for prm in whole.parameters():  # bf16 parameters (the RoPE buffer keeps its complex dtype)
        prm.data = prm.data.to(torch.bfloat16)
    split = _generate_llm_fqn_per_model_part(world * chunks, layers)
    v_shape = schedule in V_SCHEDULES  # torch's "v" placement: rank r holds stages r and 2 world - 1 - r
    ids = [rank, 2 * world - 1 - rank] if v_shape else [rank + c * world for c in range(chunks)]
    parts = [_split_module(whole, split[i]) for i in ids]
    del whole
    stages = [PipelineStage(part, i, world * chunks, torch.device("cpu")) for part, i in zip(parts, ids)]

    def loss_fn(pred, labels):  # torchtitan's cross_entropy_loss: F.cross_entropy(pred.float(), labels)
        return torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))

    sched = get_schedule_class(schedule)(stages if chunks > 1 else stages[0], n_microbatches=microbatches,
                                         loss_fn=loss_fn)
    tokens = torch.randint(0, vocab, (b * microbatches, s))
    labels = tokens.roll(-1, 1)  # a storage of its own, as torchtitan's labels (rank 0 of a V holds both ends)
    # the dataloader's positions, a model kwarg every stage gets (torchtitan's pp_forward_backward_step: kwarg_mbs),
    # split into the micro-batches with the tokens
    positions = loader_positions(b * microbatches, s)
    saved = _SavedPeak([x for part in parts for x in (*part.parameters(), *part.buffers())])
    for stage in stages:
        _track_split_backward(stage, saved)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        args = (tokens,) if 0 in ids else ()  # the V schedules: rank 0 holds the first and the last stage
        sched.step(*args, target=labels if world * chunks - 1 in ids else None, positions=positions)
    return {"modules": [split[i] for i in ids] if chunks > 1 else split[rank], "saved_peak": saved.peak,
            "saved_after": saved.live, "grads_peak": saved.grads_peak, "held_peak": saved.held_peak,
            "grads_after": saved.pending}


def measure_pp(shape, layers: int, vocab: int, s: int = 16, b: int = 1, microbatches: int = 4,
               schedule: str = "1F1B", world: int = 2, chunks: int = 1, dense: int = 1) -> list[dict]:
    """``pp_rank`` on ``world`` spawned ranks over gloo (``dense``: a DeepSeek-V3's dense first layers)."""
    from .ranks import run_ranks
    return run_ranks(pp_rank, world, (shape, layers, vocab, s, b, microbatches, schedule, chunks, dense))


if __name__ == "__main__":
    import sys
    for kind in sys.argv[1:] or ("1F1B", "GPipe"):
        multi = kind in MULTI
        for m in (4, 5) if kind == "DualPipeV" else (3, 4) if multi else (4,):
            print(kind, m, measure_pp(Shape(), 6 if multi else 4, 128, microbatches=m, schedule=kind,
                                      chunks=2 if multi else 1))
