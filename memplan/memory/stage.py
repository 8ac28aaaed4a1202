"""Memory of one GPU of a pipeline stage: activations (from the inventory), weights,
gradients and optimizer states.

`PlanValues` holds the plan as numbers, scalars for `estimate` or numpy arrays (one element
per candidate) for the planner; `stage_memory` is the one function both call. Under torchtitan's multi-stage
pipeline schedules the copies of each term come from the rank's peak in torch's order (`multi_counts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from memplan.core.model import ModelSpec
from memplan.core.training import Recompute, TrainingSpec
from memplan.core.arith import minimum
from memplan.inventory.fp8 import weight_extra_bytes
from memplan.inventory.titan import SPLIT_BLOCK, split_backward_grads
from memplan.inventory.types import Term
from memplan.memory import dp_stack
from memplan.memory.adapters import gathered_base_layer, lora_states
from memplan.memory.offload import split_optimizer
from memplan.memory.optimizers import StageTensors
from memplan.memory.param_group import stepped, trained_only
from memplan.memory.parallel import expert_states, state_shard
from memplan.memory.shapes import Layout, stage_tensors
from memplan.memory.states import (
    StateBytes,
    layer_params,
    optimizer_bytes,
    param_groups,
    stage_params,
    state_bytes,
)
from memplan.memory.term_bytes import (PlanValues, TermBytes, stage_unit_bytes, term_bytes_for, term_count,
                                      whole_layer)
from memplan.memory.pipeline_multi import (SPLIT_BACKWARD, chunk_dense, is_multi, one, rank_chunks, rank_peak,
                                           rank_stages, steady_microbatches)


@dataclass(frozen=True)
class StageMemory:
    """One GPU of pipeline stage `stage` (values are scalars or arrays)."""

    stage: Any
    layers: Any
    params: Any
    term_bytes: dict[str, Any]  # term id -> bytes on this GPU at the stage's peak
    unit_bytes: dict[str, Any]  # term id -> bytes of one copy (one layer / micro-batch) on this GPU
    recompute_working_bytes: Any  # one layer's recomputed activations, alive during its backward
    activations: Any  # saved terms + the recompute working set
    states: StateBytes
    sizes: Optional[TermBytes] = None  # evaluates further terms (transients) for the same plan
    tensors: Optional[StageTensors] = None  # the GPU's parameter tensors, for optimizers that need their shapes
    host_optimizer: Any = 0  # master weights + optimizer states stepped in host memory (optimizer offload)
    expert_params: Any = 0  # of `params`, the routed experts' (sharded over the expert-data-parallel group)
    # the parameters the optimizer steps (LoRA's adapters; `params` less those that get no gradient); None: `params`
    trained_params: Any = None
    gathered: Any = 0  # of `states.weights`, ZeRO-3's unsharded parameters in flight (bytes; dp_stack.gathered_params)
    held: Optional[list] = None  # multi-stage schedules: (micro-batch, chunk) sets of each chunk held at the peak
    extra_terms: tuple = ()  # terms beyond the inventory's (a split backward's I -> W gradients)
    units: Optional[dict] = None  # torchtitan without PP: FSDP2's units in bytes (dp_stack.titan_units)

    def in_flight(self, phase: str) -> Any:
        """Of `gathered`, the unsharded parameters alive at `phase` (dp_stack.TITAN_HELD); all of it all step without
        `units`, and where p > 1."""
        if self.units is None:
            return self.gathered
        on = self.units["on"]
        return on * sum((self.units[u] for u in dp_stack.TITAN_HELD[phase]), 0) + (1 - on) * self.gathered

    @property
    def weights(self) -> Any:
        return self.states.weights

    @property
    def gradients(self) -> Any:
        return self.states.gradients

    @property
    def optimizer(self) -> Any:
        return self.states.optimizer

    @property
    def total(self) -> Any:
        return self.activations + self.states.total


def stage_memory(
    model: ModelSpec, terms: tuple[Term, ...], training: TrainingSpec, plan: PlanValues, stage: Any,
    working_set: bool = True, granularity: int = 1, layout: Layout = "fused",
) -> StageMemory:
    """Memory of one GPU of pipeline stage `stage` at its peak: the first backward of the steady
    state, with every in-flight micro-batch stored and, under recompute, one layer's recomputed
    tensors alive on top (the recompute working set, which K22 leaves out). Each storage is rounded
    up to `granularity` bytes (the allocator's block size; 1 = exact); `layout`: how the
    implementation stores its weight matrices (Inventory.weight_layout), for the optimizers whose
    states depend on their shapes."""
    sizes = term_bytes_for(model, plan, training.activation_bytes, granularity)
    layers_per_chunk, recomputed = plan.chunk_layers(model, stage)
    multi = is_multi(plan.schedule)  # torchtitan's multi-stage schedules: counted from torch's order (module below)
    zb_terms = split_backward_grads(model, training.device) if str(plan.schedule) in SPLIT_BACKWARD else ()
    by_id, held = multi_counts(model, terms + zb_terms, plan, stage, sizes, recomputed) if multi else ({}, None)
    counts: dict[tuple, Any] = {}  # the count depends only on a term's scope and recompute flags
    dropped: dict[tuple, Any] = {}  # 1 where recompute drops the term, by the same flags
    term_bytes, unit_bytes = {}, {}
    activations: Any = 0
    working: Any = 0
    for term in terms + zb_terms:
        per = unit_bytes[term.id] = stage_unit_bytes(sizes, model, term, plan, stage)  # a dense / MoE layer's: the stage's
        key = term.recompute_flags
        if key not in counts and not multi:
            counts[key] = term_count(term, plan, layers_per_chunk, stage, recomputed)
        if multi and term.layer_kind:  # copies in layers of its kind, chunk by chunk (multi_counts): one layer's each
            n = sizes(whole_layer(model, term)) * by_id[term.id]
        else:
            n = per * (by_id[term.id] if multi else counts[key])
        term_bytes[term.id] = n
        activations = activations + n
        if working_set and term.scope == "layer" and term not in zb_terms:
            if key not in dropped:
                dropped[key] = term.kept(Recompute.NONE) * (1 - term.kept(plan.recompute))
            working = working + per * dropped[key]
    working = working * (recomputed > 0)
    activations = activations + working
    layers = plan.layers(model, stage) if multi else layers_per_chunk * plan.m
    is_first, is_last = plan.ends(stage)
    dense = plan.dense_layers(model, stage) if multi else None  # a rank's chunks' dense first layers (DeepSeek-V3)
    params = stage_params(model, sizes.group, layers, is_first, is_last, plan.p, dense)
    tensors = None
    offload = training.offload_optimizer_fraction > 0
    by_tensor = training.optimizer not in ("adamw", "sgd", "sgd-nomomentum") or training.optimizer_impl == "for-loop"
    if by_tensor or offload:  # by tensor shape
        tensors = stage_tensors(model, model.symbols(t=plan.t), layers, is_first, is_last, plan.p, layout, dense)
    one_layer = layer_params(model, sizes.group)
    # the tail: final norm and output layer (a last stage of no layers; p = 2 counts a tied output layer too)
    gathered_layer = gathered_base_layer(model, training, sizes.values, one_layer) if training.lora_rank else one_layer
    gathered = dp_stack.gathered_params(training, model, gathered_layer, stage_params(model, sizes.group, 0, 0, 1, 2),
                                        plan.t)
    gathered = one_layer if gathered is None else gathered
    # torchtitan with PP: the stage's parameters unsharded all step, their gradients accumulated unsharded in fp32
    gathered, accumulated = dp_stack.titan_pipelined(training, plan.p, params, gathered)
    embedding = sum((sizes.group(g) for g in param_groups(model) if g.scope == "first"), 0)
    units = dp_stack.titan_units(training, model, one_layer, stage_params(model, sizes.group, 0, 0, 1, 2), embedding,
                                 plan.p, plan.t)
    # parameters that never get a gradient (a frozen table, DeepSeek-V3.2's no_grad indexer): weights only
    trained = (stage_params(model, trained_only(sizes.group, training.dp_stack), layers, is_first, is_last, plan.p, dense)
               if any(not stepped(g, training.dp_stack) for g in param_groups(model)) else None)
    n_trained = params if trained is None else trained
    states = state_bytes(params, training, state_shard(plan), plan.zero, gathered_params=gathered,
                         optimizer_unsharded=optimizer_bytes(training, n_trained, tensors), trained=n_trained)
    if training.lora_rank:  # peft LoRA / QLoRA: frozen base, fp32 adapters trained (memplan/memory/adapters.py)
        states, trained = lora_states(model, training, sizes.values, params, layers, state_shard(plan), plan.zero)
    if training.dp_stack:  # DeepSpeed's reduce buckets, kept all step (memplan/memory/dp_stack.py)
        extra = dp_stack.buffer_bytes(training, model, plan.zero, layers)
        if training.lora_rank:  # lora_states counts no gathered copy under ZeRO 3: the stack's unsharded base
            extra = extra + (plan.zero >= 3) * gathered * training.weight_bytes
        states = StateBytes(states.weights + extra, states.gradients + accumulated, states.optimizer)
    # lora_states counts no gathered copy without a stack
    in_flight = (plan.zero >= 3) * gathered * training.weight_bytes * (not training.lora_rank or bool(training.dp_stack))
    experts: Any = 0
    if model.is_moe:  # the routed experts' states are sharded over the expert-data-parallel group instead
        experts = stage_params(model, lambda g: sizes.group(g) if g.expert else 0, layers, is_first, is_last, plan.p,
                               dense)
        states = expert_states(states, experts, training, plan)
    if training.fp8 is not None:  # Transformer Engine's FP8 weight caches and scaling state (memplan/inventory/fp8.py)
        linear = {g.name: sizes.group(g) for g in param_groups(model) if g.scope == "layer"}
        states = StateBytes(states.weights + weight_extra_bytes(linear, layers, training, granularity),
                            states.gradients, states.optimizer)
    host: Any = 0
    if offload:  # the offloaded share of the master weights and moments lives in host memory (memplan/memory/offload.py)
        on_gpu, host = split_optimizer(training, states.optimizer)
        states = StateBytes(states.weights, states.gradients, on_gpu)
    return StageMemory(stage, layers, params, term_bytes, unit_bytes, working, activations, states, sizes, tensors,
                       host, experts, trained, in_flight, held, zb_terms, units)


def multi_counts(model: ModelSpec, terms: tuple[Term, ...], plan: PlanValues, stage: int, sizes: TermBytes,
                 recomputed: Any) -> tuple[dict[str, Any], list]:
    """Copies of each term rank `stage` holds at its peak under a multi-stage schedule (memplan/memory/pipeline_multi.py:
    torch's order, torchtitan's chunks; plan.p, plan.m and the schedule scalars, M scalar or array): a (micro-batch,
    chunk) set keeps its layers' and its stage's terms until its B or W, the loss (the "last" terms of the output
    block) until its B or I, the split backward's gradients (`split_backward_grads`) from I to W. The peak is the
    step where their bytes are the most, found per plan; (copies by term id, the held count of each chunk then)."""
    p, m, stage = one(plan.p), one(plan.m), one(stage)
    stages = rank_stages(stage, p, m, str(plan.schedule))
    layers = rank_chunks(stage, p, m, model.num_layers, str(plan.schedule))
    # an MoE model's dense first layers in each chunk (DeepSeek-V3): a dense / MoE layer term (Term.layer_kind) is one
    # such layer's tensor (term_bytes.whole_layer; stage_memory) held once per layer of its kind in the chunk
    dense = chunk_dense(stage, p, m, model.num_layers, model.moe_first_dense_layers, str(plan.schedule))
    kinds = {"": layers, "dense": dense, "moe": tuple(n - k for n, k in zip(layers, dense))}

    def coefficients(t: Term) -> tuple[str, list]:
        """(when the term is alive: held / early / between, its copies per micro-batch of each chunk)."""
        if t.scope == "layer":  # AC covers every layer under these schedules (recomputed >= a chunk's layers)
            per = [minimum(recomputed, n) * t.kept(plan.recompute) + (n - minimum(recomputed, n)) * t.kept(Recompute.NONE)
                   for n in kinds[t.layer_kind]] if t.block != SPLIT_BLOCK else [n * (s != 0) for n, s in zip(layers, stages)]
        elif t.scope == "chunk":
            per = [t.kept(plan.recompute)] * m
        else:
            per = [1 * (s == (0 if t.scope == "first" else p * m - 1)) for s in stages]
        return ("between" if t.block == SPLIT_BLOCK else "early" if t.scope == "last" and t.block == "output"
                else "held"), per

    groups: dict[tuple, list] = {}  # terms alike in when and how often they are held: one weight, one count
    for t in terms:
        key = (t.block == SPLIT_BLOCK, t.scope, t.scope == "last" and t.block == "output", t.recompute_flags,
               t.layer_kind)
        groups.setdefault(key, []).append(t)
    coef = {key: coefficients(ts[0]) for key, ts in groups.items()}
    weights = {k: [0] * m for k in ("held", "early", "between")}
    for key, ts in groups.items():
        kind, per = coef[key]
        size = sum(sizes(whole_layer(model, t) if t.layer_kind else t) for t in ts)
        weights[kind] = [w + size * c for w, c in zip(weights[kind], per)]
    micro = np.asarray(plan.microbatches)
    steady = np.vectorize(lambda n: steady_microbatches(p, m, int(n), str(plan.schedule)))(micro)
    counts: dict[tuple, Any] = {key: 0 * micro for key in groups}
    held_out: list = [0 * micro for _ in range(m)]
    for M in np.unique(steady):  # one order per distinct M of the same peak (the search's plans hold several)
        mask = steady == M
        w = {k: [_at(x, mask, micro) for x in v] for k, v in weights.items()}
        _, held, pre = rank_peak(stage, p, m, int(M), str(plan.schedule), w["held"], w["early"], w["between"])
        alive = {"held": held, "early": pre, "between": [h - k for h, k in zip(held, pre)]}
        for key, (kind, per) in coef.items():
            counts[key] = _put(counts[key], mask, sum(_at(c, mask, micro) * a for c, a in zip(per, alive[kind])))
        held_out = [_put(h, mask, n) for h, n in zip(held_out, held)]
    return {t.id: counts[key] for key, ts in groups.items() for t in ts}, held_out


def _at(x: Any, mask: Any, like: Any) -> Any:
    """`x` where `mask` if it is an array shaped like the plans' `like`, else `x`."""
    return x[mask] if np.ndim(like) and np.shape(x) == np.shape(like) else x


def _put(into: Any, mask: Any, value: Any) -> Any:
    """`value` where `mask` (arrays), or `value` (scalars)."""
    if not np.ndim(into):
        return value
    out = np.array(into, dtype=np.result_type(into, value))
    out[mask] = value
    return out
