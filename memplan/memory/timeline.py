"""The peak of a training step: the bytes alive after each event of one step on one GPU of a pipeline stage, from
the inventory (saved terms and the moments their code peaks at), the states and the training loop (what the device
needs beyond the tensors: memplan/memory/device.py).

One step on a stage, walked for the micro-batch whose backward comes first in the steady state
(1F1B: the stage then holds every in-flight model chunk), layer position j = 1..n of its chunk:

- forward, after layer j: states + gradients that exist + the saved tensors of the other in-flight chunks + this
  chunk's first j layers;
- loss (last stage): the inventory's moments around the loss (logits and their fp32 copy in the forward; the
  cross-entropy's and the output layer's gradients, phase "backward", layer None) on top of everything saved;
- backward of layer j (n down to 1): the layers below j still saved, layer j's saved terms that its moments have not
  freed (all of them re-created when the layer is recomputed), the moments' transient tensors, the gradients so far;
- embedding backward (first stage): every gradient, nothing of this chunk saved;
- optimizer: states + every gradient + the optimizer's temporaries (torch AdamW foreach: one tensor the size of
  the parameters it steps, in their dtype, `exp_avg_sq_sqrt` in torch/optim/adam.py `_multi_tensor_adam`; fused:
  none; the other optimizers' in memplan/memory/optimizers.py).

Gradients: a main-gradient buffer (Megatron-LM, and memplan's reference loop) exists for the whole step; torch
`.grad` tensors (transformers) appear on their first write in the backward and are freed by zero_grad after the
optimizer step, so with one micro-batch the forward has none and with gradient accumulation the later micro-batches'
forwards have all of them.

Every quantity is a scalar or a numpy array (one element per plan). Backward bytes are linear in j within the
recomputed layers (the first N of a chunk, Megatron-LM's block method) and within the others, so the peak over all
layers is at j in {1, N, N + 1, n} (with a gradient buffer, where they grow with j, in {N, n}), and the forward's at
j = n: the planner evaluates only those (`critical=True`); a test checks that against the walk over every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from memplan.core.arith import maximum, minimum
from memplan.core.model import ModelSpec
from memplan.core.training import Recompute, TrainingSpec
from memplan.inventory.k22 import EMBEDDING_OUTPUT_GRAD
from memplan.inventory.titan_moments import REDUCE_SCATTER, RS_HELD_ID
from memplan.inventory.types import Inventory, Moment
from memplan.memory import optimizers
from memplan.memory.adapters import adapter_bytes, adapter_groups
from memplan.memory.offload import (TUNE_STASH, conversion_temp_bytes, layer_weight_bytes, offloaded_params, share,
                                    tune_loss_stash)
from memplan.memory.parallel import cp_moments, expert_shard, state_shard
from memplan.memory.dp_stack import shard_bytes
from memplan.memory.stage import StageMemory
from memplan.memory.param_group import LAYER_SCOPES, stepped
from memplan.memory.states import block_share, output_layer_group, param_groups
from memplan.memory.term_bytes import PlanValues, TermBytes

PHASES = ("forward", "loss", "backward", "optimizer")
PARTS = ("weights", "optimizer", "gradients", "saved", "transient")
PART_LABELS = {"weights": "weights", "optimizer": "optimizer states (master + moments)", "gradients": "gradients",
               "saved": "saved activations", "transient": "transient tensors"}  # how reports name them


@dataclass(frozen=True)
class Event:
    phase: str  # forward | loss | backward | optimizer
    layer: Optional[int]  # position of the layer in the chunk (1..n), None outside the layers
    moment: str  # what is happening
    parts: dict[str, Any]  # allocated bytes alive by kind (PARTS; scalars or arrays)
    bytes: Any  # their sum


@dataclass(frozen=True)
class StepPeak:
    """The events of one step on one GPU and their maximum (scalars, or arrays in the planner)."""
    events: list[Event]
    peak_bytes: Any
    peak_index: Any  # index into events of the (first) maximum
    persistent_bytes: Any  # weights + optimizer states (+ the gradient buffer): alive all step
    optimizer_temp_bytes: Any

    @property
    def peak_event(self) -> Event:
        return self.events[int(self.peak_index)]


def optimizer_impl(training: TrainingSpec, inventory: Inventory) -> str:
    """The optimizer's implementation: asked for, else the training code's where the optimizer has it."""
    return optimizers.resolve_impl(training, inventory.optimizer_impl)


OPTIMIZER_NAMES = {"adamw": "AdamW", "sgd": "SGD", "sgd-nomomentum": "SGD without momentum",
                   "adafactor": "Adafactor", "adam8bit": "8-bit Adam", "muon": "Muon + AdamW", "lion": "Lion"}


def step_events(model: ModelSpec, inventory: Inventory, training: TrainingSpec, plan: PlanValues,
                stage_mem: StageMemory, stage: Any, critical: bool = False) -> StepPeak:
    """Every event of one step on one GPU of `stage` (or only the critical ones)."""
    act = training.activation_bytes
    term_bytes = stage_mem.unit_bytes
    sizes = stage_mem.sizes or TermBytes(model, plan, act, inventory.granularity)
    layer_terms = [t for t in inventory.terms if t.scope == "layer"]
    last_terms = [t for t in inventory.terms if t.scope == "last"]
    chunk_terms = [t for t in inventory.terms if t.scope == "chunk"]
    rec = plan.recompute
    n, recomputed = plan.chunk_layers(model, stage)  # this stage's chunks (uneven stages: memplan/memory/pipeline.py)
    N = recomputed * (rec != Recompute.NONE)  # recomputed layers of a chunk (its first N)
    is_first, is_last = plan.ends(stage)  # the V schedules: rank 0 holds both
    is_full, is_sel, is_none = (rec == Recompute.FULL), (rec == Recompute.SELECTIVE), (rec == Recompute.NONE)
    stored_plain = stored_full = stored_sel = 0  # one layer's saved bytes: not recomputed, full, selective
    for t in layer_terms:
        n_t = term_bytes[t.id]
        stored_plain = stored_plain + n_t * t.kept(Recompute.NONE)
        stored_full = stored_full + n_t * t.kept(Recompute.FULL)
        stored_sel = stored_sel + n_t * t.kept(Recompute.SELECTIVE)
    stored_rec = is_full * stored_full + is_sel * stored_sel + is_none * stored_plain  # a recomputed layer

    def stored_upto(j: Any) -> Any:
        """Saved bytes of layers 1..j of a chunk."""
        k = minimum(j, N)
        return k * stored_rec + (j - k) * stored_plain

    last_cur = sum((term_bytes[t.id] for t in last_terms), 0) * is_last  # this micro-batch's head terms
    chunk_cur = sum((term_bytes[t.id] * t.kept(rec) for t in chunk_terms), 0)  # only_full ones: under full recompute
    # Everything saved at the stage's peak (the in-flight chunks), minus this chunk's layers and head.
    retained = stage_mem.activations - stage_mem.recompute_working_bytes
    others = retained - stored_upto(n) - last_cur
    # Activation offload (memplan/memory/offload.py: torch's save_on_cpu): the decoder layers' saved tensors of the other
    # layers and micro-batches are in host memory. The GPU keeps what is saved outside the layers, the current
    # layer's tensors (in the forward until packed, in its backward once brought back), one copy of the tensors the
    # layers share (chunk terms) and, in a layer's backward, the largest of its weights brought back.
    tune = training.activation_offloader == "torchtune"  # OffloadActivations (memplan/memory/offload.py)
    off = training.offload_activations and not tune

    def kept_upto(j: Any, stash: int = TUNE_STASH) -> Any:  # saved bytes of layers 1..j on the GPU (tune: its stash)
        return 0 if off else stored_upto(minimum(j, stash) if tune else j)
    unpacked_weight: Any = 0
    if off:
        outside = sum((stage_mem.term_bytes.get(t.id, 0) for t in inventory.terms if t.scope in ("first", "last")), 0)
        others = outside - last_cur + chunk_cur
        unpacked_weight = layer_weight_bytes(model, training, model.symbols(t=plan.t), inventory.weight_layout)[1]

    # Gradients by parameter group (bytes of one GPU), and when they exist.
    states = stage_mem.states
    groups = {g.name: g for g in param_groups(model)}
    head = output_layer_group(model)
    untied_head = (not model.tied_embeddings) or (plan.p > 1)
    grad_cache: dict[tuple[str, bool], Any] = {}
    lora = adapter_groups(model, training) if training.lora_rank else None  # only the adapters get gradients

    def group_grad(name: str, kept: bool = False) -> Any:
        """Gradient bytes of a parameter group on one GPU; `kept`: what a ZeRO-2/3 run keeps of the .grad tensors."""
        if (name, kept) not in grad_cache:
            if lora is not None:
                n = sizes.group(lora[name]) * adapter_bytes(training) if name in lora else 0
            elif name == head.name:
                n = sizes.group(head) * training.grad_bytes * untied_head
            else:  # a group that is never trained (ParamGroup.trained) gets no gradient
                n = (sizes.group(groups[name]) * training.grad_bytes * stepped(groups[name], training.dp_stack)
                     if name in groups else 0)
            shard = expert_shard(plan) if name in groups and groups[name].expert else state_shard(plan)
            grad_cache[name, kept] = shard_bytes(n, shard, plan.zero >= 2) if kept else n
        return grad_cache[name, kept]

    def new_grad(name: str) -> Any:
        """A group's gradient as autograd makes it, in the weights' dtype (before a hook or AccumulateGrad)."""
        if lora is not None:  # fp32 adapters: made in their own dtype
            return group_grad(name)
        return group_grad(name) * training.weight_bytes // training.grad_bytes

    buffer = inventory.grad_lifetime == "buffer"
    all_grads = states.gradients
    # the optimizer step in the backward (TrainingSpec.optimizer_in_backward; torch .grad, one micro-batch): a
    # gradient lives from its AccumulateGrad to its hook's step, except the LM head's, stepped after the embedding's
    in_backward = training.optimizer_in_backward
    # torchtune's register_optim_in_bwd_hooks (torchtune/training/memory.py) steps and zeroes every parameter in its
    # own hook: no LM head step waits (measured: tests/test_torchtune.py)
    delay_head = not inventory.name.startswith("torchtune")
    # A gradient buffer is alive all step; torch .grad tensors from the first backward write until
    # zero_grad, so in the forward only when earlier micro-batches of this step made them.
    grads_fwd = all_grads if buffer else all_grads * (plan.microbatches > 1)
    persistent = states.weights + states.optimizer + (all_grads if buffer else 0)

    def grads_of(m: Moment) -> Any:
        """Gradients a moment adds: with one micro-batch the torch .grad tensors made by now; the
        last group's new gradient while it is still its own tensor (`fresh`): before a hook adds it
        to the buffer, or before AccumulateGrad adds it to an existing .grad."""
        fresh = new_grad(m.grads[-1]) if (m.fresh and m.grads) else 0
        if in_backward:
            # the fresh gradient (its step follows once the node that made it has freed its saved input, which
            # outweighs the step's two temporaries of the gradient's size but for the shortest sequences: not
            # counted); the LM head's gradient once made (its step waits for the embedding's)
            waits = sum((group_grad(g) for g in m.grads if g in head_names), 0) * delay_head
            return fresh + waits
        if buffer:
            return fresh if inventory.grad_hook_transient else 0
        made = sum((group_grad(g, kept=True) for g in m.grads), 0)
        if m.grad_elements:  # a traced moment: the layer's own gradients made by then, counted in elements
            made = made + shard_bytes(m.grad_elements * training.grad_bytes, plan.shard, plan.zero >= 2)
        return made * (plan.microbatches == 1) + fresh * (plan.microbatches > 1)

    loss_moments = [m for m in inventory.moments if m.scope == "last"]
    layer_moments = [m for m in inventory.moments if m.scope == "layer" and m.phase == "backward"]
    head_names = {g.name for g in param_groups(model) if g.scope == "last"} | {
        g for m in loss_moments for g in m.grads}

    # an MoE model's dense layers come first (on the first stage; a multi-stage rank: in its walked chunk, if any): the
    # backward reaches them last
    dense_here = plan.chunk_dense_layers(model, stage)

    def grads_after(layers_done: Any) -> Any:
        """torch .grad bytes once the head and `layers_done` layers of this chunk are back-propagated."""
        if buffer:
            return 0
        head_grads = sum((group_grad(g, kept=True) for g in head_names), 0)
        if in_backward:  # the LM head's gradient waits for the embedding's step; the others are stepped at once
            return head_grads * is_last * untied_head
        kind = {scope: sum((group_grad(g, kept=True) for g, group in groups.items() if group.scope == scope), 0)
                for scope in LAYER_SCOPES}
        moe_done = minimum(layers_done, n - dense_here)  # the chunk's last layers are its MoE ones
        made = (head_grads * is_last + layers_done * kind["layer"] + moe_done * kind["moe"]
                + (layers_done - moe_done) * kind["dense"])
        if model.layer_pattern:  # a hybrid: each block's average share of a layer (derived)
            made = head_grads * is_last + layers_done * (kind["layer"] + block_share(model, kind))
        return made * (plan.microbatches == 1) + all_grads * (plan.microbatches > 1)

    # context parallelism's buffers (memplan/memory/parallel.py): inside the attention forward, and added to its backward
    cp_forward, cp_backward = cp_moments(model, inventory, plan)
    moments_all = inventory.moments + cp_forward
    # moments inside a layer's forward: the inventory's (an MoE layer's combine, memplan/inventory/moe.py) and cp's
    cp_forward = tuple(m for m in inventory.moments if m.phase == "forward" and m.scope == "layer") + cp_forward
    transients: dict[str, tuple[Any, Any]] = {}
    for m in moments_all:  # each moment's transients, and those of a recomputed layer only
        always: Any = 0
        rerun: Any = 0
        for t in m.transients + (cp_backward if m.id == "attention_backward" else ()):
            if t.only_full:
                rerun = rerun + sizes(t)
            else:
                always = always + sizes(t)
        transients[m.id] = (always, rerun)

    def transient_bytes(m: Moment, recomputed: Any = 0) -> Any:
        """A moment's transients; those marked only_full exist in a recomputed layer's backward."""
        always, rerun = transients[m.id]
        return always + rerun * recomputed * is_full

    held = sum((sizes(t) for t in inventory.held), 0) * is_last

    # a tied output layer's gradient waiting for the embedding's (same stage, torch autograd)
    tied_waits = 1 * (model.tied_embeddings and inventory.tied_grad_waits) * (plan.p == 1)
    waiting = new_grad("word embedding") * tied_waits * buffer

    events: list[Event] = []
    layers = (_critical_layers(n, N, buffer, dense_here if model.moe_first_dense_layers else 0) if critical
              else [j + 1 for j in range(int(n))])
    buffer_grads = all_grads if buffer else 0

    # the weights less ZeRO-3's unsharded parameters in flight, which torchtitan's FSDP2 holds by phase (StageMemory.in_flight)
    sharded = states.weights - stage_mem.gathered

    def event(phase: str, layer: Any, name: str, gradients: Any, saved: Any, transient: Any, on: Any = True,
              held_at: Any = "forward") -> None:
        weights = sharded + (stage_mem.in_flight(held_at) if isinstance(held_at, str) else held_at)
        parts = dict(weights=weights, optimizer=states.optimizer, gradients=gradients, saved=saved,
                     transient=transient)
        total = weights + states.optimizer + gradients + saved + transient
        if isinstance(on, bool):  # the stage-dependent moments (loss: last stage only)
            parts, total = (parts, total) if on else ({k: 0 for k in parts}, 0)
        else:
            parts, total = {k: v * on for k, v in parts.items()}, total * on
        events.append(Event(phase, layer, name, parts, total))

    # forward of the chunk whose backward comes first (its bytes grow with j: the last layer is critical)
    fwd_alive = {m.id: _alive_sums(layer_terms, term_bytes, m) for m in cp_forward}
    for j in (layers if not critical else [n]):
        for m in cp_forward:  # inside layer j's forward: the layers before it, its own saves so far, the buffers
            plain, full, selective = fwd_alive[m.id]
            recomputed = (j <= N) if not critical else _le(j, N)
            alive = recomputed * (is_full * full + is_sel * selective + is_none * plain) + (1 - recomputed) * plain
            event("forward", j, m.name, grads_fwd, others + kept_upto(j - 1, TUNE_STASH - 1) + alive,
                  held + transient_bytes(m, recomputed))
        event("forward", j, f"after layer {j}'s forward" if not critical else "layer forward",
              grads_fwd, others + (stored_plain if off else kept_upto(j)), held)
    # loss (last stage)
    for m in loss_moments:
        freed = sum((term_bytes[t.id] for t in last_terms if t.id in m.freed), 0)
        event(m.phase, None, m.name, grads_fwd + grads_of(m),
              others + kept_upto(n, tune_loss_stash(inventory.terms)) + last_cur - freed, held + transient_bytes(m),
              is_last, "head" if m.grads else "loss")  # FSDP2's head unit: its backward prefetches the last layer
    # backward, layer by layer
    # a layer's saved bytes alive at each moment: not recomputed, fully recomputed, selectively
    alive_sums = {m.id: _alive_sums(layer_terms, term_bytes, m) for m in layer_moments}
    # tensors of the chunk a moment has freed (a traced recomputed layer: inputs of the checkpointed layers
    # whose last user is done)
    chunk_freed = {m.id: sum((term_bytes[t.id] * t.kept(rec) for t in chunk_terms if t.id in m.freed), 0)
                   for m in layer_moments}
    units = stage_mem.units
    rs_layer = {m.id: sum((sizes(t) for t in m.transients if t.id.startswith(RS_HELD_ID)), 0) for m in layer_moments}
    for j, m, at in _layer_moment_positions(layer_moments, layers, n, N, critical):
        recomputed = (j <= N) if not critical else _le(j, N)
        # a traced moment happens in a recomputed layer's backward or in a layer kept whole, not both
        on = 1 if m.applies == "any" else (recomputed * is_full if m.applies == "recomputed" else
                                              recomputed * (1 - is_none) if m.applies == "rerun"
                                              else 1 - recomputed * is_full)
        if isinstance(on, (bool, int)) and not on:
            continue
        on = True if (m.applies == "any" and at is True) else (on if at is True else on * at)
        plain, full, selective = alive_sums[m.id]
        alive = recomputed * (is_full * full + is_sel * selective + is_none * plain) + (1 - recomputed) * plain
        first = (j == 1) * is_first  # FSDP2 prefetches the embedding in the first layer's backward, not a layer
        done = "reduce-scatter" if m.id == REDUCE_SCATTER else "layer"
        # the reduce-scatter input held through the last layer's backward is the head's (torchtitan, p = 1)
        rs = units["on"] * (j == n) * is_last * (units["tail_rs"] - rs_layer[m.id]) * (rs_layer[m.id] > 0) if units else 0
        event("backward", j, m.name, buffer_grads + grads_after(n - j) + grads_of(m) + waiting,
              others - chunk_freed[m.id] + (stored_rec * (j < n) if tune else kept_upto(j - 1)) + alive,
              held + transient_bytes(m, recomputed) + unpacked_weight + rs, on,
              first * stage_mem.in_flight(f"first {done}") + (1 - first) * stage_mem.in_flight(done))
    # embedding backward (first stage): every gradient made, this chunk's layers gone; the gradient
    # arriving at the embedding and its dense weight gradient (with a buffer: before the hook;
    # tied and waiting: plus the head's gradient and their out-of-place sum)
    d_emb = sizes(EMBEDDING_OUTPUT_GRAD)
    dense = new_grad("word embedding")
    tied_extra = 2 * dense * tied_waits
    emb_extra = (dense + tied_extra if buffer else tied_extra) + d_emb
    if in_backward:
        # the embedding's gradient and the waiting LM head's; then their steps, one tensor at a time, each with
        # a for-loop AdamW's two temporaries of its size (torch/optim/adamw.py _single_tensor_adamw: sqrt, division)
        kept = group_grad("word embedding") + group_grad(head.name) * untied_head * is_last
        event("backward", None, "embedding backward (its gradient and the LM head's)", kept, others - chunk_cur,
              d_emb * is_first)
        largest = maximum(new_grad("word embedding"), new_grad(head.name) * untied_head * is_last)
        event("backward", None, "optimizer steps of the embedding and the LM head (in the backward, for-loop "
              "AdamW)", kept, 0, 2 * largest)
        return _peak_of(events, persistent, 2 * largest)
    event("backward", None, "embedding backward (all gradients made)", all_grads, others - chunk_cur,
          emb_extra * is_first, held_at="embedding")
    # optimizer step: no activations (the step's micro-batches are done)
    temp = _optimizer_temporaries(training, inventory, stage_mem, plan)
    event("optimizer", None, f"optimizer step ({optimizer_impl(training, inventory)} "
          f"{OPTIMIZER_NAMES[training.optimizer]})", all_grads, 0, temp, held_at="optimizer")
    return _peak_of(events, persistent, temp)


def _peak_of(events: list[Event], persistent: Any, temp: Any) -> StepPeak:
    peak = events[0].bytes
    index: Any = 0
    for i, e in enumerate(events[1:], start=1):
        b = e.bytes
        index = index + (i - index) * (b > peak)
        peak = maximum(peak, b)
    return StepPeak(events, peak, index, persistent, temp)


def _layer_moment_positions(moments: list[Moment], layers: list[Any], n: Any, N: Any, critical: bool) -> list:
    """(j, moment, on) for the backward events: every layer position for a moment of every layer; for a
    moment of some layers (a traced layer group: `Moment.layers`, the model's layer indices, so position
    j is layer j - 1 of a model on one stage in one chunk, as transformers runs), those positions, and in
    the planner (`critical`) the first and last of them in the recomputed block 1..N and in the rest
    (the bytes are linear in j between them), `on` saying where such a position exists."""
    out = []
    if not critical:
        for j in sorted(layers, reverse=True):
            out += [(j, m, True) for m in moments if not m.layers or j - 1 in m.layers]
        return out
    import numpy as np

    for m in moments:
        if not m.layers:
            out += [(j, m, True) for j in layers]
            continue
        P = np.array(sorted({i + 1 for i in m.layers}))
        below = np.searchsorted(P, N, side="right")  # positions <= N
        last_in = P[np.maximum(below - 1, 0)]
        first_out = P[np.minimum(below, len(P) - 1)]
        # a stage of fewer layers than the model's (pipeline stages): its positions only (P's tail contiguous)
        out += [(P[0] + 0 * below, m, 1 * (below > 0)), (minimum(last_in, n), m, 1 * (below > 0)),
                (minimum(first_out, n), m, 1 * (below < len(P)) * (P[0] <= n)),
                (minimum(P[-1], n) + 0 * below, m, 1 * (below < len(P)) * (P[0] <= n))]
    return out


def _alive_sums(layer_terms, term_bytes: dict[str, Any], moment: Moment) -> tuple[Any, Any, Any]:
    """Bytes of a layer's saved terms alive at a backward moment when the layer is not recomputed,
    fully recomputed (every tensor re-created; the checkpoint's own input copy stays) and
    selectively recomputed (the attention core re-created once its backward is reached)."""
    plain: Any = 0
    full: Any = 0
    selective: Any = 0
    for t in layer_terms:
        if t.id in moment.freed:
            continue
        keep_none, keep_sel = t.kept(Recompute.NONE), t.kept(Recompute.SELECTIVE)
        n = term_bytes[t.id]
        if keep_none:
            plain = plain + n
        if keep_none or t.kept(Recompute.FULL):
            full = full + n
        if keep_sel or (keep_none and moment.recomputed):
            selective = selective + n
    return plain, full, selective


def _le(x: Any, y: Any) -> Any:
    return 1 * (x <= y)


def _critical_layers(n: Any, N: Any, buffer: bool, dense: Any = 0) -> list[Any]:
    """Layer positions where the backward's bytes can peak: the ends of the recomputed block
    (1..N) and of the rest (N+1..n), between which the bytes are linear in j, and with an MoE model's
    dense layers first also the ends of those (1..k: their gradients grow at another rate). With a
    gradient buffer no gradient is made per layer, so the bytes grow with j: the upper ends suffice."""
    upper = [n, maximum(N, 1)]
    if buffer:
        return upper
    ends = upper + [maximum(minimum(N + 1, n), 1), 1 + 0 * n]
    if isinstance(dense, int) and dense == 0:
        return ends
    return ends + [maximum(minimum(dense, n), 1), maximum(minimum(dense + 1, n), 1)]


def _optimizer_temporaries(training: TrainingSpec, inventory: Inventory, stage_mem: StageMemory,
                           plan: PlanValues) -> Any:
    """What the optimizer step allocates on one GPU (memplan/memory/optimizers.py `temporaries`): torch
    AdamW foreach one temporary per parameter it steps (exp_avg_sq_sqrt), in that parameter's dtype
    (the fp32 master copy when there is one, else the weights' dtype), the ZeRO shard only; fused
    AdamW (Megatron-LM's TE / apex FusedAdam, torch fused) none; the other optimizers their own."""
    shard = 1 + (state_shard(plan) - 1) * (plan.zero >= 1)
    impl = optimizer_impl(training, inventory)
    experts = stage_mem.expert_params
    trained = stage_mem.params if stage_mem.trained_params is None else stage_mem.trained_params
    temp = optimizers.temporaries(training, impl, trained, stage_mem.tensors, shard)
    if training.optimizer in ("adamw", "sgd", "sgd-nomomentum"):  # one temporary per stepped parameter: the routed
        # experts step their expert-data-parallel shard (the same as the others' when ep = 1 and etp = t)
        e_shard = 1 + (expert_shard(plan) - 1) * (plan.zero >= 1)
        temp = temp + (optimizers.temporaries(training, impl, experts, stage_mem.tensors, e_shard)
                       - optimizers.temporaries(training, impl, experts, stage_mem.tensors, shard))
    fraction = training.offload_optimizer_fraction
    if fraction == 0:
        return temp
    # optimizer offload (memplan/memory/offload.py): the GPU steps 1 - F of its shard (its temporaries shrink with it), and
    # the host's parameters are copied back through a GPU temporary of the host dtype, one tensor at a time
    offloaded = offloaded_params(training, stage_mem.params, state_shard(plan), plan.zero, stage_mem.trained_params)
    return temp - share(temp, fraction) + conversion_temp_bytes(training, stage_mem.tensors.largest(), offloaded)


def stages_by_load(steps: list[StepPeak], stages: list[StageMemory]) -> list[int]:
    """The stages, the most loaded first: by their GPU's peak, then what is retained at the first backward, then the
    earlier stage."""
    return sorted(range(len(stages)), key=lambda i: (-steps[i].peak_bytes, -stages[i].total, i))


def most_loaded_stage(steps: list[StepPeak], stages: list[StageMemory]) -> int:
    """The stage whose GPU peaks highest (stages_by_load's first)."""
    return stages_by_load(steps, stages)[0]
