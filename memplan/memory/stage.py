"""Memory of one GPU of a pipeline stage: activations (from the inventory), weights,
gradients and optimizer states.

`PlanValues` holds the plan as numbers, scalars for `estimate` or numpy arrays (one element
per candidate) for the planner; `stage_memory` is the one function both call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from memplan.core.model import ModelSpec
from memplan.core.training import Recompute, TrainingSpec
from memplan.inventory.fp8 import weight_extra_bytes
from memplan.inventory.types import Term
from memplan.memory import dp_stack
from memplan.memory.adapters import gathered_base_layer, lora_states
from memplan.memory.offload import split_optimizer
from memplan.memory.optimizers import StageTensors
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
from memplan.memory.term_bytes import PlanValues, TermBytes, term_bytes_for, term_count


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
    trained_params: Any = None  # LoRA: the adapters' parameters (the optimizer steps only those); None: `params`
    gathered: Any = 0  # of `states.weights`, ZeRO-3's unsharded parameters in flight (bytes; dp_stack.gathered_params)

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
    counts: dict[tuple, Any] = {}  # the count depends only on a term's scope and recompute flags
    dropped: dict[tuple, Any] = {}  # 1 where recompute drops the term, by the same flags
    term_bytes, unit_bytes = {}, {}
    activations: Any = 0
    working: Any = 0
    for term in terms:
        per = unit_bytes[term.id] = sizes(term)
        key = term.recompute_flags
        if key not in counts:
            counts[key] = term_count(term, plan, layers_per_chunk, stage, recomputed)
        n = per * counts[key]
        term_bytes[term.id] = n
        activations = activations + n
        if working_set and term.scope == "layer":
            if key not in dropped:
                dropped[key] = term.kept(Recompute.NONE) * (1 - term.kept(plan.recompute))
            working = working + per * dropped[key]
    working = working * (recomputed > 0)
    activations = activations + working
    layers = layers_per_chunk * plan.m
    is_first, is_last = stage == 0, stage == plan.p - 1
    params = stage_params(model, sizes.group, layers, is_first, is_last, plan.p)
    tensors = None
    offload = training.offload_optimizer_fraction > 0
    by_tensor = training.optimizer not in ("adamw", "sgd", "sgd-nomomentum") or training.optimizer_impl == "for-loop"
    if by_tensor or offload:  # by tensor shape
        tensors = stage_tensors(model, model.symbols(t=plan.t), layers, is_first, is_last, plan.p, layout)
    one_layer = layer_params(model, sizes.group)
    # the tail: final norm and output layer (a last stage of no layers; p = 2 counts a tied output layer too)
    gathered_layer = gathered_base_layer(model, training, sizes.values, one_layer) if training.lora_rank else one_layer
    gathered = dp_stack.gathered_params(training, model, gathered_layer, stage_params(model, sizes.group, 0, 0, 1, 2),
                                        plan.t)
    gathered = one_layer if gathered is None else gathered
    # torchtitan with PP: the stage's parameters unsharded all step, their gradients accumulated unsharded in fp32
    gathered, accumulated = dp_stack.titan_pipelined(training, plan.p, params, gathered)
    states = state_bytes(params, training, state_shard(plan), plan.zero, gathered_params=gathered,
                         optimizer_unsharded=optimizer_bytes(training, params, tensors))
    if training.lora_rank:  # peft LoRA / QLoRA: frozen base, fp32 adapters trained (memplan/memory/adapters.py)
        states, trained = lora_states(model, training, sizes.values, params, layers, state_shard(plan), plan.zero)
    else:
        trained = None
    if training.dp_stack:  # DeepSpeed's reduce buckets, kept all step (memplan/memory/dp_stack.py)
        extra = dp_stack.buffer_bytes(training, model, plan.zero)
        if training.lora_rank:  # lora_states counts no gathered copy under ZeRO 3: the stack's unsharded base
            extra = extra + (plan.zero >= 3) * gathered * training.weight_bytes
        states = StateBytes(states.weights + extra, states.gradients + accumulated, states.optimizer)
    # lora_states counts no gathered copy without a stack
    in_flight = (plan.zero >= 3) * gathered * training.weight_bytes * (not training.lora_rank or bool(training.dp_stack))
    experts: Any = 0
    if model.is_moe:  # the routed experts' states are sharded over the expert-data-parallel group instead
        experts = stage_params(model, lambda g: sizes.group(g) if g.expert else 0, layers, is_first, is_last, plan.p)
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
                       host, experts, trained, in_flight)
