"""A whole torchtitan 0.3.0 FSDP2 training step on CPU over gloo: the per-rank peak of live storage bytes and where.

``step_rank`` builds a tiny Llama 3 with torchtitan's own config code (validation/titan.py ``build_model``: the sdpa
inner attention in place of compiled FlexAttention, said there), applies torchtitan's own ``parallelize_llama`` with
``data_parallel_shard_degree`` = the world (FSDP2 through its ``apply_fsdp_to_decoder``: MixedPrecisionPolicy param
bf16 / reduce fp32, ``reshard_after_forward`` by its "default" policy: True for the blocks and the embedding, False
for the final norm + LM head group; its AC wrappers for ``--ac full`` / ``selective-op``: validation/titan.py
``_AcShim``), builds the optimizer as the Trainer does (``OptimizersContainer`` from ``default_adamw()``: one AdamW
group, lr 8e-4, betas (0.9, 0.95), eps 1e-8, weight decay 0.1, ``implementation="fused"``) and runs the Trainer's
``train_step`` body twice: ``optimizers.zero_grad(set_to_none=False)`` (its default: ``disable_cuda_graphs`` False),
forward with the dataloader's ``positions`` (torchtitan's text datasets yield them with every sample, the Trainer
passes them to the model: each layer's RoPE gathers its cache rows at them), ``CrossEntropyLoss`` (sum over tokens / the global count of valid tokens), ``del pred``, backward,
``dist_utils.clip_grad_norm_(max_norm 1.0, foreach=True)``, ``optimizers.step()``.  The lr scheduler (a Python
float) is left out.  Only the second step is measured (the AdamW states and every lazy buffer exist).

Measurement (``_StepStorages``, a validation/step.py ``StepTracker`` labelled by its ``LayerHooks``): every storage an
op touches inside the step, as input or output, and every storage alive at the step's start that belongs to the model
or the optimizer (the fp32 sharded parameters, gradients, AdamW moments and step counters, the buffers, FSDP2's
all-gather outputs), are followed until they die; after every op the live bytes are the sum of their *current*
``nbytes()``.  Summing current sizes is what makes FSDP2 visible: it frees an unsharded parameter by
``untyped_storage().resize_(0)`` and re-allocates it by resizing back, outside the dispatcher, so a tracker that
counts a storage's bytes once when it is made (validation/instruments.py ``LiveTracker``) keeps them forever.  A
DTensor is counted by its local tensor.  At the peak the live bytes are split into the fp32 states, FSDP2's unsharded
bf16 parameters, and the rest (activations, the loss, gradients in flight, reduce-scatter buffers).

Limits: temporaries an op allocates and frees inside itself are not seen (fused AdamW's, gloo's); on CPU nothing runs
ahead of the compute: FSDP2's implicit forward prefetch (the next block's all-gather issued on its own CUDA stream
while this one computes) cannot show (validation/fsdp2.py); its backward prefetch (``_backward_prefetch``: the
previous block unsharded when a block's backward starts) runs on CPU as on CUDA.  Nothing here computes a byte count
from a formula; every number is read off a tensor.
"""

from __future__ import annotations

import gc
import weakref
from functools import partial

import torch

from .step import LayerHooks, StepTracker
from .titan import Shape, loader_positions, local_tensor, tp_model


# the ops at which memplan's step moments are compared (validation/titan_step.py ``compare``): the loss's forward and
# backward, SwiGLU's product backward (mul), sdpa's backward, FSDP2's reduce-scatter copy-in, the embedding's backward
MOMENT_OPS = ("nll_loss_forward", "_log_softmax_backward_data", "mul", "_scaled_dot_product_flash_attention_for_cpu_backward",
              "fsdp.chunk_cat", "embedding_dense_backward", "_fused_adamw_")
KINDS = ("states", "unsharded", "all-gather", "reduce-scatter", "buffers", "batch", "step")


class _StepStorages(StepTracker):
    """``StepTracker`` whose live bytes are the current sizes of every followed storage (module docstring)."""

    def __init__(self, keep_ops: bool = False, classify=None) -> None:
        super().__init__(base=0, keep_ops=keep_ops)
        self.classify = classify or dict  # () -> {storage id: kind} of the moment (FSDP2's buffers in flight)
        self.followed: dict[int, weakref.ref] = {}
        self.kinds: dict[int, str] = {}  # storage id -> "states" / "unsharded" (the rest: "step")
        self.at_peak: dict[str, int] = {}
        self.made_by: dict[int, str] = {}  # storage id -> the op that first returned it ("" : seen as input first)
        self.peak_storages: list[tuple[str, str, int]] = []
        self._op = self._prev = ""
        self.gloo: set[int] = set()  # ids of gloo's scratch storages (``_see_input``)
        self.raw_peak = 0  # the most live bytes with gloo's scratch
        self.at_ops: dict[tuple, tuple] = {}  # (phase, layer, op) -> (most live bytes after it, by kind)
        self.segment_peaks: dict[int, tuple] = {}  # segment index -> (op, by kind, storages) at its most

    def follow(self, tensors, kind: str | None = None) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._follow(t, kind)

    def _follow(self, t: torch.Tensor, kind: str | None = None) -> None:
        st = local_tensor(t).untyped_storage()
        key = st._cdata
        if key not in self.followed:
            self.followed[key] = weakref.ref(st, partial(self._gone, key))
            self.made_by[key] = self._op
        if kind is not None:
            self.kinds[key] = kind

    def _gone(self, key: int, _ref) -> None:
        with self.lock:
            self.followed.pop(key, None)
            self.kinds.pop(key, None)
            self.made_by.pop(key, None)
            self.gloo.discard(key)

    def by_kind(self) -> dict[str, int]:
        out = dict.fromkeys(KINDS, 0)
        now = self.classify()
        with self.lock:
            items = [(k, r) for k, r in self.followed.items() if k not in self.gloo]
        for key, ref in items:
            st = ref()
            if st is not None:
                out[now.get(key) or self.kinds.get(key, "step")] += st.nbytes()
        return out

    @property
    def live(self) -> int:
        """Live bytes but gloo's scratch (``_see_input``)."""
        with self.lock:
            refs = [r for k, r in self.followed.items() if k not in self.gloo]
        return sum(st.nbytes() for st in (r() for r in refs) if st is not None)

    def gloo_live(self) -> int:
        with self.lock:
            refs = [r for k, r in self.followed.items() if k in self.gloo]
        return sum(st.nbytes() for st in (r() for r in refs) if st is not None)

    @live.setter
    def live(self, _value) -> None:  # LiveTracker's own bookkeeping: the sum above replaces it
        pass

    def _see_input(self, t: torch.Tensor) -> None:
        """A storage first seen as an input right after a c10d collective was made inside it: ProcessGroupGloo's
        ``_reduce_scatter_base_`` reduces a whole copy of its input (its chunk then copied out by ``split`` and
        ``copy_``), which NCCL's reduce-scatter does not make: followed apart (``gloo``), not in ``live``."""
        key = local_tensor(t).untyped_storage()._cdata
        if key not in self.followed and self._prev.startswith("c10d."):
            self.gloo.add(key)
        op, self._op = self._op, ""
        self._follow(t)
        self._op = op

    def _see_output(self, t: torch.Tensor) -> None:
        self._follow(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._prev, self._op = self._op, str(func.overloadpacket).replace("aten.", "")
        return super().__torch_dispatch__(func, types, args, kwargs)

    def storages(self) -> list[tuple[str, str, int]]:
        """(kind, the op that made it, bytes) of every followed storage alive with bytes, largest first."""
        with self.lock:
            items = list(self.followed.items())
        now = self.classify()
        rows = [("gloo" if k in self.gloo else now.get(k) or self.kinds.get(k, "step"), self.made_by.get(k, ""),
                 st.nbytes()) for k, r in items
                if (st := r()) is not None and st.nbytes()]
        return sorted(rows, key=lambda r: -r[2])

    def set(self, **label) -> None:
        """The label changes; at a decoder layer's forward end (FSDP2's post-forward done) its bytes by kind."""
        phase, layer = self.label[:2]
        super().set(**label)
        if phase == "forward" and layer is not None and self.layer is None:
            self.at_ops[("forward", layer, "end")] = (self.live, self.by_kind())

    def _sample(self, op: str, allocated: int, outputs: str) -> None:
        before = self.max_live
        seg_before = self.segments[-1][3] if self.segments and tuple(self.segments[-1][:3]) == self.label else -1
        super()._sample(op, allocated, outputs)
        self.raw_peak = max(self.raw_peak, self.live + self.gloo_live())
        if self.max_live > before:
            self.at_peak = self.by_kind()
            self.peak_storages = self.storages()
        key = (*self.label[:2], op)
        if op in MOMENT_OPS and self.live > self.at_ops.get(key, (-1,))[0]:
            self.at_ops[key] = (self.live, self.by_kind())
        if self.segments[-1][3] > seg_before:  # this segment's most live bytes so far: what they are
            self.segment_peaks[len(self.segments) - 1] = (op, self.by_kind(), self.storages())


def _fsdp_buffers(model) -> dict[int, str]:
    """FSDP2's communication buffers alive now, by storage id: "all-gather" (a group's flat all-gather output
    pending its copy-out: a prefetch; the last forward all-gather's, kept in ``comm_ctx.all_gather_state`` until the
    next one waits), "reduce-scatter" (the fp32 reduce-scatter inputs kept in ``comm_ctx.reduce_scatter_states``, the
    reduce outputs kept for HSDP's all-reduce)."""
    out: dict[int, str] = {}

    def add(t, kind):
        if isinstance(t, torch.Tensor):
            out[local_tensor(t).untyped_storage()._cdata] = kind

    for m in model.modules():
        if not hasattr(m, "_get_fsdp_state") or (g := m._get_fsdp_state()._fsdp_param_group) is None:
            continue
        if g._all_gather_result is not None:
            add(g._all_gather_result.all_gather_output, "all-gather")
        if g._all_reduce_state is not None:
            add(g._all_reduce_state.all_reduce_input, "reduce-scatter")
        ctx = g.comm_ctx
        if ctx.all_gather_state is not None:
            add(ctx.all_gather_state.all_gather_result.all_gather_output, "all-gather")
        for rs in ctx.reduce_scatter_states:
            add(rs.reduce_scatter_input, "reduce-scatter")
    return out


def _fsdp_unsharded(model) -> list[torch.Tensor]:
    """FSDP2's unsharded bf16 storages (each parameter's all-gather output; size 0 while resharded)."""
    out = []
    for m in model.modules():
        if hasattr(m, "_get_fsdp_state") and (g := m._get_fsdp_state()._fsdp_param_group) is not None:
            for p in g.fsdp_params:
                out += list(getattr(p, "all_gather_outputs", None) or [])
    return out


def step_rank(rank: int, world: int, shape: Shape, layers: int, vocab: int, s: int, b: int, ac: str = "none",
              ops: bool = False, tracker_cls: type | None = None) -> dict:
    """One rank of two torchtitan training steps (module docstring); the second measured.  Returns bytes:
    ``peak`` (the step's most live bytes) with ``peak_label`` (phase, layer, micro-batch, aten op) and
    ``at_peak`` (states / unsharded / step), ``start`` and ``end`` (live at the step's start and after
    ``optimizers.step()``), ``params`` / ``grads`` / ``adam`` (fp32 local storages, padding included; ``adam`` the
    moments, ``adam_steps`` the step counters), ``timeline`` (phase, layer, max, end per segment); with ``ops`` the
    op log; ``tracker_cls`` a ``_StepStorages`` subclass measuring the step (validation/titan_alloc.py's records
    the allocation events: ``out["tracker"]`` its ``result()``)."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, default_adamw
    from torchtitan.distributed import utils as dist_utils

    model, dims = tp_model(world, shape, layers, vocab, ac, tp=1, max_seq_len=s)  # the Trainer's RoPE cache length
    optimizers = OptimizersContainer(default_adamw(), model_parts=[model])
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config())
    blocks = list(model.layers.values())
    torch.manual_seed(1 + rank)
    # the loader's batches: torchtitan's dataset slices each sample into input and label and yields its positions
    # with them (validation/titan.py loader_positions), its DataLoader stacks them
    batches = [(d[:, :-1].contiguous(), d[:, 1:].contiguous(), loader_positions(b, s))
               for d in torch.randint(0, vocab, (2, b, s + 1))]

    def train_step(tracker):
        label = tracker.set if tracker is not None else (lambda **kw: None)
        label(phase="forward", layer=None, microbatch=0)
        optimizers.zero_grad(set_to_none=False)
        inputs, labels, positions = batches.pop(0)
        if tracker is not None:
            tracker.follow((inputs, labels, positions), "batch")
        global_valid_tokens = dist_utils.dist_sum_tensor(torch.tensor(labels.numel()), dims.get_mesh("batch"))
        # the Trainer's _forward_backward_body: the positions a model kwarg (post_dataloading_process: no attention
        # masks for the sdpa inner module), handed to the loss too (CrossEntropyLoss drops them)
        pred = model(inputs, positions=positions)
        label(phase="loss", layer=None)
        loss, _ = loss_fn(pred, labels, global_valid_tokens, positions=positions)
        del pred
        label(phase="backward", layer=None)
        loss.backward()
        label(phase="backward", layer=None)
        label(phase="optimizer", layer=None, microbatch=None)
        dist_utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True, pp_mesh=None, ep_enabled=False)
        optimizers.step()
        label(phase="optimizer", layer=None, microbatch=None)
        return loss.detach()

    train_step(None)
    gc.collect()
    opts = optimizers.optimizers
    states = [st for opt in opts for st in opt.state.values()]
    tracker = (tracker_cls or _StepStorages)(keep_ops=ops, classify=partial(_fsdp_buffers, model))
    tracker.follow((p for p in model.parameters()), "states")
    tracker.follow((p.grad for p in model.parameters()), "states")
    tracker.follow((v for st in states for v in st.values()), "states")
    tracker.follow(model.buffers(), "buffers")
    tracker.follow(_fsdp_unsharded(model), "unsharded")
    start = tracker.live
    hooks = LayerHooks(tracker, blocks)
    with tracker:
        train_step(tracker)
    hooks.close()
    gc.collect()
    tracker.settle()
    end = tracker.live

    def local_bytes(tensors) -> int:
        seen = {}
        for t in tensors:
            st = local_tensor(t).untyped_storage()
            seen[st._cdata] = st.nbytes()
        return sum(seen.values())

    out = {"peak": tracker.max_live, "raw_peak": tracker.raw_peak, "peak_label": tracker.peak_label, "at_peak": tracker.at_peak,
           "peak_storages": tracker.peak_storages,
           "start": start, "end": end,
           "params": local_bytes(model.parameters()), "grads": local_bytes(p.grad for p in model.parameters()),
           "adam": local_bytes(st[k] for st in states for k in ("exp_avg", "exp_avg_sq")),
           "adam_steps": local_bytes(st["step"] for st in states),
           "buffers": local_bytes(model.buffers()),
           "timeline": [(sg.phase, sg.layer, sg.max_bytes, sg.end_bytes) for sg in tracker.timeline()],
           "at_ops": tracker.at_ops,
           "segment_peaks": [tracker.segment_peaks.get(i) for i in range(len(tracker.segments))]}
    if ops:
        out["ops"] = tracker.ops
    if tracker_cls is not None:
        out["tracker"] = tracker.result()
    return out


def measure_step(shape: Shape, layers: int, vocab: int, s: int, b: int, ac: str = "none", world: int = 2,
                 ops: bool = False) -> list[dict]:
    """``step_rank`` on ``world`` spawned ranks over gloo."""
    from .ranks import run_ranks
    return run_ranks(step_rank, world, (shape, layers, vocab, s, b, ac, ops))


def summary(m: dict) -> dict:
    """A rank's figures as plain data (the JSON tests/data/titan_step.json records): the moments (at_ops, by kind)
    keyed "phase/layer/op", the peak, start, end and fp32 states."""
    return {"moments": {f"{ph}/{'-' if ly is None else ly}/{op}": kinds for (ph, ly, op), (_, kinds) in m["at_ops"].items()},
            "peak": m["peak"], "peak_at": list(m["peak_label"]), "at_peak": m["at_peak"], "raw_peak": m["raw_peak"],
            **{k: m[k] for k in ("start", "end", "params", "grads", "adam", "adam_steps", "buffers")}}


def main(argv: list[str] | None = None) -> None:
    """python -m validation.titan_step [--record FILE] [AC ...]: the tiny model's step on 2 gloo ranks (h 64, a 4,
    g 2, f 160, 2 layers, v 256, s 32, b 2) per AC mode, printed; --record writes rank 0's (both ranks equal)."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m validation.titan_step")
    ap.add_argument("--record")
    ap.add_argument("ac", nargs="*", default=["none", "full", "selective-op"])
    args = ap.parse_args(argv)
    out = {}
    for ac in args.ac:
        ranks = [summary(m) for m in measure_step(Shape(), 2, 256, 32, 2, ac)]
        if ranks[0] != ranks[1]:
            raise SystemExit(f"{ac}: the two ranks differ")
        out[ac] = r = ranks[0]
        print(f"{ac}: peak {r['peak']:,} B at {r['peak_at']} {r['at_peak']} (with gloo's scratch {r['raw_peak']:,} B); "
              f"start {r['start']:,} B, end {r['end']:,} B")
        for key, kinds in r["moments"].items():
            print(f"   {key}: {sum(kinds.values()):,} B {kinds}")
    if args.record:
        with open(args.record, "w") as fh:
            json.dump(out, fh, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
