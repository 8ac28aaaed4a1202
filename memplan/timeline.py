"""The peak of a training step: the bytes alive after each event of one step on one GPU of a
pipeline stage, from the inventory (saved terms and the moments their code peaks at), the states
and the training loop; and what the device needs beyond PyTorch's allocator.

One step on a stage, walked for the micro-batch whose backward comes first in the steady state
(1F1B: the stage then holds every in-flight model chunk), layer position j = 1..n of its chunk:

- forward, after layer j: states + gradients that exist + the saved tensors of the other in-flight
  chunks + this chunk's first j layers;
- loss (last stage): the inventory's loss moments (logits, their fp32 copy, the cross-entropy's
  gradients) on top of everything saved;
- backward of layer j (n down to 1): the layers below j still saved, layer j's saved terms that
  its moments have not freed (all of them re-created when the layer is recomputed), the moments'
  transient tensors, and the gradients made so far;
- embedding backward (first stage): every gradient, nothing of this chunk saved;
- optimizer: states + every gradient + the optimizer's temporaries (torch AdamW foreach: one
  tensor the size of the parameters it steps, in their dtype, `exp_avg_sq_sqrt` in
  torch/optim/adam.py `_multi_tensor_adam`; fused: none).

Gradients: a main-gradient buffer (Megatron-LM, and memplan's reference loop) exists for the
whole step; torch `.grad` tensors (transformers) appear on their first write in the backward and
are freed by zero_grad after the optimizer step, so with one micro-batch the forward has none and
with gradient accumulation the later micro-batches' forwards have all of them.

Every quantity is a scalar or a numpy array (one element per plan). Backward bytes are linear in
j between the recomputed layers (the first N of a chunk, Megatron-LM's block method) and the
others, so the peak over all layers is at j in {1, N, N + 1, n}: the planner evaluates only those
(`critical=True`); a test checks that against the walk over every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from memplan.memory import PlanValues, StageMemory, symbol_values
from memplan.pipeline import chunks_in_flight, microbatches_in_flight
from memplan.specs import GpuSpec, ModelSpec, Recompute, TrainingSpec
from memplan.states import output_layer_group, param_groups
from memplan.terms import Inventory, Moment

PHASES = ("forward", "loss", "backward", "optimizer")


def _maximum(x: Any, y: Any) -> Any:
    """max(x, y) by arithmetic (ints and numpy arrays alike)."""
    return x + (y - x) * (y > x)


def _minimum(x: Any, y: Any) -> Any:
    return x - (x - y) * (x > y)


PARTS = ("weights", "optimizer", "gradients", "saved", "transient")


@dataclass(frozen=True)
class Event:
    phase: str  # forward | loss | backward | optimizer
    layer: Optional[int]  # position of the layer in the chunk (1..n), None outside the layers
    moment: str  # what is happening
    parts: dict[str, Any]  # allocated bytes alive by kind (PARTS; scalars or arrays)

    @property
    def bytes(self) -> Any:
        total: Any = 0
        for k in PARTS:
            total = total + self.parts[k]
        return total


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
    return training.optimizer_impl or inventory.optimizer_impl


def step_events(model: ModelSpec, inventory: Inventory, training: TrainingSpec, plan: PlanValues,
                stage_mem: StageMemory, stage: Any, critical: bool = False) -> StepPeak:
    """Every event of one step on one GPU of `stage` (or only the critical ones)."""
    values = symbol_values(model, plan)
    act = training.activation_bytes
    term_bytes = {t.id: t.bytes(values, act, plan.sp) for t in inventory.terms}
    layer_terms = [t for t in inventory.terms if t.scope == "layer"]
    last_terms = [t for t in inventory.terms if t.scope == "last"]
    first_terms = [t for t in inventory.terms if t.scope == "first"]
    chunk_terms = [t for t in inventory.terms if t.scope == "chunk"]
    rec = plan.recompute
    n = model.num_layers // (plan.p * plan.m)
    N = plan.recomputed_layers * (rec != Recompute.NONE)  # recomputed layers of a chunk (its first N)
    is_first, is_last = stage == 0, stage == plan.p - 1

    def layer_sum(keep) -> Any:
        total: Any = 0
        for t in layer_terms:
            total = total + term_bytes[t.id] * keep(t)
        return total

    stored_plain = layer_sum(lambda t: t.kept(Recompute.NONE))  # a layer that is not recomputed
    stored_rec = layer_sum(lambda t: t.kept(rec))  # a recomputed layer

    def stored_upto(j: Any) -> Any:
        """Saved bytes of layers 1..j of a chunk."""
        k = _minimum(j, N)
        return k * stored_rec + (j - k) * stored_plain

    last_cur = sum((term_bytes[t.id] for t in last_terms), 0) * is_last  # this micro-batch's head terms
    first_cur = sum((term_bytes[t.id] for t in first_terms), 0) * is_first
    chunk_cur = sum((term_bytes[t.id] for t in chunk_terms), 0)
    # Everything saved at the stage's peak (the in-flight chunks), minus this chunk's layers and head.
    retained = stage_mem.activations - stage_mem.recompute_working_bytes
    others = retained - stored_upto(n) - last_cur

    # Gradients by parameter group (bytes of one GPU), and when they exist.
    states = stage_mem.states
    group_grads = {g.name: g.per_gpu(values) * training.grad_bytes for g in param_groups(model)}
    head_group = output_layer_group().name
    untied_head = (not model.tied_embeddings) or (plan.p > 1)
    group_grads[head_group] = output_layer_group().per_gpu(values) * training.grad_bytes * untied_head
    layer_grad = sum((group_grads[g.name] for g in param_groups(model) if g.scope == "layer"), 0)
    buffer = inventory.grad_lifetime == "buffer"
    all_grads = states.gradients
    # A gradient buffer is alive all step; torch .grad tensors from the first backward write until
    # zero_grad, so in the forward only when earlier micro-batches of this step made them.
    grads_fwd = all_grads if buffer else all_grads * (plan.microbatches > 1)
    persistent = states.weights + states.optimizer + (all_grads if buffer else 0)

    def grads_of(m: Moment) -> Any:
        """Gradients a moment adds: with one micro-batch the torch .grad tensors made by now; the
        last group's new gradient while it is still its own tensor (`fresh`): before a hook adds it
        to the buffer, or before AccumulateGrad adds it to an existing .grad."""
        fresh = group_grads.get(m.grads[-1], 0) * training.weight_bytes // training.grad_bytes if (
            m.fresh and m.grads) else 0
        if buffer:
            return fresh if inventory.grad_hook_transient else 0
        made = sum((group_grads.get(g, 0) for g in m.grads), 0)
        return made * (plan.microbatches == 1) + fresh * (plan.microbatches > 1)

    loss_moments = [m for m in inventory.moments if m.scope == "last"]
    head_names = {g.name for g in param_groups(model) if g.scope == "last"} | {
        g for m in loss_moments for g in m.grads}

    def grads_after(layers_done: Any) -> Any:
        """torch .grad bytes once the head and `layers_done` layers of this chunk are back-propagated."""
        if buffer:
            return 0
        head = sum((group_grads.get(g, 0) for g in head_names), 0)
        made = head * is_last + layers_done * layer_grad
        return _minimum(made, all_grads) * (plan.microbatches == 1) + all_grads * (plan.microbatches > 1)

    def transient_bytes(m: Moment, recomputed: Any = 0) -> Any:
        """A moment's transients; those marked only_full exist in a recomputed layer's backward."""
        total: Any = 0
        for t in m.transients:
            n_t = t.bytes(values, act, plan.sp)
            total = total + (n_t * recomputed * (rec == Recompute.FULL) if t.only_full else n_t)
        return total

    held = sum((t.bytes(values, act, plan.sp) for t in inventory.held), 0) * is_last

    # a tied output layer's gradient waiting for the embedding's (same stage, torch autograd)
    tied_waits = 1 * (model.tied_embeddings and inventory.tied_grad_waits) * (plan.p == 1)
    waiting = group_grads["word embedding"] * training.weight_bytes // training.grad_bytes * tied_waits * buffer

    events: list[Event] = []
    layers = _critical_layers(n, N) if critical else [j + 1 for j in range(int(n))]
    buffer_grads = all_grads if buffer else 0
    accumulated = 0 if buffer else all_grads * (plan.microbatches > 1)  # .grad of earlier micro-batches

    def event(phase: str, layer: Any, name: str, gradients: Any, saved: Any, transient: Any, on: Any = 1) -> None:
        parts = dict(weights=states.weights, optimizer=states.optimizer, gradients=gradients, saved=saved,
                     transient=transient)
        events.append(Event(phase, layer, name, {k: v * on for k, v in parts.items()}))

    # forward of the chunk whose backward comes first
    for j in layers:
        event("forward", j, f"after layer {j}'s forward" if not critical else "layer forward",
              grads_fwd, others + stored_upto(j), held)
    # loss (last stage)
    for m in loss_moments:
        freed = sum((term_bytes[t.id] for t in last_terms if t.id in m.freed), 0)
        event("loss", None, m.name, buffer_grads + accumulated + grads_of(m),
              others + stored_upto(n) + last_cur - freed, held + transient_bytes(m), is_last)
    # backward, layer by layer
    layer_moments = [m for m in inventory.moments if m.scope == "layer"]
    for j in sorted(layers, reverse=True) if not critical else layers:
        recomputed = (j <= N) if not critical else _le(j, N)
        for m in layer_moments:
            alive = layer_sum(lambda t, m=m: _alive(t, m, rec, recomputed))
            event("backward", j, m.name, buffer_grads + grads_after(n - j) + grads_of(m) + waiting,
                  others + stored_upto(j - 1) + alive, held + transient_bytes(m, recomputed))
    # embedding backward (first stage): every gradient made, this chunk's layers gone; the gradient
    # arriving at the embedding and its dense weight gradient (with a buffer: before the hook;
    # tied and waiting: plus the head's gradient and their out-of-place sum)
    sym = model.symbols(b=plan.b, t=1)
    d_emb = sym["s"] * sym["b"] * sym["h"] * act
    dense = group_grads["word embedding"] * training.weight_bytes // training.grad_bytes
    tied_extra = 2 * dense * tied_waits
    emb_extra = (dense + tied_extra if buffer else tied_extra) + d_emb
    event("backward", None, "embedding backward (all gradients made)", all_grads, others - chunk_cur,
          emb_extra * is_first)
    # optimizer step: no activations (the step's micro-batches are done)
    temp = _optimizer_temporaries(training, inventory, stage_mem)
    event("optimizer", None, f"optimizer step ({optimizer_impl(training, inventory)} AdamW)", all_grads, 0, temp)
    peak = events[0].bytes
    index: Any = 0
    for i, e in enumerate(events[1:], start=1):
        index = index + (i - index) * (e.bytes > peak)
        peak = _maximum(peak, e.bytes)
    return StepPeak(events, peak, index, persistent, temp)


def _alive(term, moment: Moment, rec: Any, recomputed: Any) -> Any:
    """1 where a layer term is alive at a backward moment (scalar or array)."""
    if term.id in moment.freed:
        return 0
    plain = term.kept(Recompute.NONE)
    # Recomputed: full recompute re-creates every tensor (the checkpoint's own input copy stays);
    # selective re-creates the dropped attention core only once its backward is reached.
    full = _maximum(plain, term.kept(Recompute.FULL))
    selective = term.kept(Recompute.SELECTIVE) + (plain - term.kept(Recompute.SELECTIVE)) * int(moment.recomputed)
    as_recomputed = (rec == Recompute.FULL) * full + (rec == Recompute.SELECTIVE) * selective + (
        rec == Recompute.NONE) * plain
    return recomputed * as_recomputed + (1 - recomputed) * plain


def _le(x: Any, y: Any) -> Any:
    return 1 * (x <= y)


def _critical_layers(n: Any, N: Any) -> list[Any]:
    """Layer positions where the backward's bytes can peak: the ends of the recomputed block and
    of the rest (arrays in the planner; duplicates are harmless)."""
    return [n, _maximum(_minimum(N + 1, n), 1), _maximum(N, 1), 1 + 0 * n]


def _optimizer_temporaries(training: TrainingSpec, inventory: Inventory, stage_mem: StageMemory) -> Any:
    """torch AdamW foreach: one temporary per parameter it steps (exp_avg_sq_sqrt), in that
    parameter's dtype: the fp32 master copy when there is one, else the weights' dtype; the
    ZeRO-sharded shard only. Fused AdamW (Megatron-LM's TE / apex FusedAdam, torch fused) keeps none."""
    if optimizer_impl(training, inventory) != "foreach":
        return 0
    per_param = training.master_weight_bytes or training.weight_bytes
    moments_per_param = training.master_weight_bytes + training.optimizer_moments * training.optimizer_state_bytes
    # stage_mem.states.optimizer = stepped parameters x moments_per_param (sharded as ZeRO says)
    return stage_mem.states.optimizer * per_param // moments_per_param if moments_per_param else 0


@dataclass(frozen=True)
class DeviceMemory:
    """What the GPU needs for the step: the allocated peak, the caching allocator's margin above
    it and the memory outside PyTorch's pool."""

    peak_bytes: Any
    fragmentation_bytes: Any
    runtime_bytes: Any
    margin: float

    @property
    def total(self) -> Any:
        return self.peak_bytes + self.fragmentation_bytes + self.runtime_bytes


def communicators(plan: PlanValues) -> Any:
    """NCCL communicators a rank of the plan creates: its tensor-, pipeline- and data-parallel
    groups of more than one rank."""
    return 1 * (plan.t > 1) + 1 * (plan.p > 1) + 1 * (plan.d > 1)


def device_memory(peak_bytes: Any, plan: PlanValues, inventory: Inventory, gpu: Optional[GpuSpec],
                  margin: Optional[float] = None) -> DeviceMemory:
    """The allocated peak plus the fragmentation margin and the runtime's own memory (both from the
    GPU preset; none without a GPU)."""
    if gpu is None:
        m = margin or 0.0
        return DeviceMemory(peak_bytes, _frac(peak_bytes, m), 0 * peak_bytes, m)
    m = gpu.fragmentation_margin if margin is None else margin
    base = gpu.runtime_bytes.get(inventory.runtime)
    groups = communicators(plan)
    # the megatron figure was measured with one communicator already in it
    extra = _maximum(groups - 1, 0) if inventory.runtime == "megatron" else groups
    return DeviceMemory(peak_bytes, _frac(peak_bytes, m), base + extra * gpu.nccl_communicator_bytes, m)


def _frac(n: Any, margin: float) -> Any:
    """ceil(n * margin) in integers (margin to 1e-6)."""
    micro = round(margin * 1_000_000)
    return -(-(n * micro) // 1_000_000)
