"""Parameters, and the bytes of weights, gradients and optimizer states per GPU.

Parameter counts are an inventory like the activations: named groups with a polynomial
count, whether tensor parallelism splits them, and where they live. The K22 GPT count is
12Lh^2 (1 + 13/(12h) + (v + s)/(12Lh)) (K22 section 6 / appendix A; Megatron-LM's general
count adds g/a for grouped K/V and 3hf for a gated MLP; Q, K, V and the output projection are
q = a x head_dim wide, q = h unless a config says otherwise); the tests check it.

Bytes per parameter are the named sizes of `TrainingSpec` (Megatron-LM
docs/user-guide/features/dist_optimizer.md): bf16 weights (2) + fp32 main gradients (4) +
fp32 master weights (4) + two fp32 Adam moments (8) = 18. ZeRO (Rajbhandari et al. 2020)
splits over the d data-parallel ranks: stage 1 (= Megatron-LM's distributed optimizer) the
master weights and moments, giving 6 + 12/d; stage 2 also the gradients; stage 3 also the
weights, which are then gathered one layer at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping

from memplan.specs import ModelSpec, TrainingSpec
from memplan.symbolic import Poly

Scope = Literal["layer", "first", "last"]


@dataclass(frozen=True)
class ParamGroup:
    name: str
    count: Poly
    tp_split: bool
    scope: Scope

    def per_gpu(self, values: Mapping[str, Any]) -> Any:
        n = self.count.evaluate(values)
        # Vocabulary-parallel embeddings are padded to a multiple of t (Megatron-LM pads v).
        return -(-n // values["t"]) if self.tp_split else n


def param_groups(model: ModelSpec) -> tuple[ParamGroup, ...]:
    """Parameter groups of a decoder-only transformer (column/row-parallel split as Megatron-LM)."""
    norm = "2 h" if model.norm == "layernorm" else "h"  # LayerNorm: weight + bias; RMSNorm: weight
    mlp_in = "2 h f" if model.mlp == "swiglu" else "h f"  # gated MLP: gate and up projections
    groups = [
        ParamGroup("QKV projection weight", Poly.parse_sum("h q + 2 h q g /a"), True, "layer"),
        ParamGroup("attention output projection weight", Poly.parse("q h"), True, "layer"),
        ParamGroup("MLP input projection weight", Poly.parse(mlp_in), True, "layer"),
        ParamGroup("MLP output projection weight", Poly.parse("h f"), True, "layer"),
        ParamGroup("layer norms", Poly.parse(norm) * 2, False, "layer"),
    ]
    if model.bias:
        mlp_bias = "2 f" if model.mlp == "swiglu" else "f"
        groups += [
            ParamGroup("column-parallel biases (QKV, MLP input)",
                       Poly.parse_sum(f"q + 2 q g /a + {mlp_bias}"), True, "layer"),
            ParamGroup("row-parallel biases (output projection, MLP output)", Poly.parse("2 h"), False, "layer"),
        ]
    groups.append(ParamGroup("word embedding", Poly.parse("v h"), True, "first"))
    if model.position_embedding == "learned":
        groups.append(ParamGroup("position embedding", Poly.parse("s h"), False, "first"))
    groups.append(ParamGroup("final norm", Poly.parse(norm), False, "last"))
    return tuple(groups)


def output_layer_group() -> ParamGroup:
    """The output projection v x h: its own weight when untied; with tied embeddings the last
    stage still keeps a copy when p > 1 (Megatron-LM synchronises the two copies)."""
    return ParamGroup("output layer (LM head)", Poly.parse("v h"), True, "last")


Count = Callable[[ParamGroup], Any]  # a group's parameters on one GPU for the plan at hand


def counter(values: Mapping[str, Any]) -> Count:
    """Count each group's parameters with the symbols `values` (scalars or arrays)."""
    return lambda group: group.per_gpu(values)


def stage_params(model: ModelSpec, count: Count, layers: Any, is_first: Any, is_last: Any, p: Any) -> Any:
    """Parameters held by one GPU of a stage with `layers` layers (scalars or arrays)."""
    total: Any = 0
    for group in param_groups(model):
        weight = {"layer": layers, "first": is_first, "last": is_last}[group.scope]
        total = total + count(group) * weight
    head_copy = 1 if not model.tied_embeddings else (p > 1)
    return total + count(output_layer_group()) * is_last * head_copy


def layer_params(model: ModelSpec, count: Count) -> Any:
    """Parameters of one layer on one GPU."""
    total: Any = 0
    for group in param_groups(model):
        if group.scope == "layer":
            total = total + count(group)
    return total


def total_params(model: ModelSpec) -> int:
    """Parameters of the whole model (t = 1, each tied weight once): one stage holding everything."""
    return stage_params(model, counter(model.symbols(t=1)), model.num_layers, 1, 1, 1)


def shard_bytes(n: Any, d: Any, on: Any) -> Any:
    """n bytes, split over d ranks (rounded up) where `on` is true."""
    return on * (-(-n // d)) + (1 - on) * n


@dataclass(frozen=True)
class StateBytes:
    weights: Any
    gradients: Any
    optimizer: Any  # master weights + optimizer moments

    @property
    def total(self) -> Any:
        return self.weights + self.gradients + self.optimizer


def state_bytes(params: Any, training: TrainingSpec, d: Any, zero: Any, gathered_params: Any = 0) -> StateBytes:
    """Weights, gradients and optimizer bytes for `params` parameters on one GPU, the ZeRO-sharded
    parts split over `d` ranks (the data-parallel size, or the shard group with HSDP).

    `gathered_params` is the transient full copy ZeRO-3 gathers (one layer) during compute.
    """
    optimizer_per_param = training.master_weight_bytes + training.optimizer_moments * training.optimizer_state_bytes
    z = zero
    weights = shard_bytes(params * training.weight_bytes, d, z >= 3) + (z >= 3) * gathered_params * training.weight_bytes
    gradients = shard_bytes(params * training.grad_bytes, d, z >= 2)
    optimizer = shard_bytes(params * optimizer_per_param, d, z >= 1)
    return StateBytes(weights, gradients, optimizer)
