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

Optimizers other than AdamW keep states that depend on each tensor's shape (Adafactor's factored
second moment, 8-bit Adam's blocks, Muon's split between hidden matrices and the rest:
memplan/optimizers.py): `weight_shapes` lists every parameter tensor of a group by shape, in the
order the implementation registers them ("fused": Megatron-LM and the reference layer, one QKV and
one MLP-input matrix, as transformers' GPT-2 Conv1D c_attn / c_fc; "separate": transformers' Llama
layout, q/k/v_proj and gate/up_proj apart; `Inventory.weight_layout` says which an
implementation uses).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Optional

from memplan import optimizers
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


Layout = Literal["fused", "separate"]


@dataclass(frozen=True)
class WeightShape:
    """`count` parameter tensors of group `group`, each `rows` x `cols` (cols None: a vector of rows),
    `split`: the dimension tensor parallelism divides (rows: column- / vocab-parallel, cols: row-parallel)."""

    group: str
    name: str
    rows: Poly
    cols: Optional[Poly]
    count: int = 1
    split: Optional[Literal["rows", "cols"]] = None

    @property
    def numel(self) -> Poly:
        return self.rows if self.cols is None else self.rows * self.cols

    def on_gpu(self, values: Mapping[str, Any], hidden: bool) -> optimizers.Tensor:
        """The tensor on one GPU with the symbols `values` (scalars or arrays; t splits `split`)."""
        r = self.rows.evaluate(values)
        c = None if self.cols is None else self.cols.evaluate(values)
        if self.split == "rows":
            r = -(-r // values["t"])
        elif self.split == "cols":
            c = -(-c // values["t"])
        return optimizers.Tensor(r, c, hidden and c is not None)


def weight_shapes(model: ModelSpec, layout: Layout = "fused") -> dict[str, tuple[WeightShape, ...]]:
    """Every parameter tensor by shape, scope by scope ("first", "layer", "last", "head": the output
    layer where it exists, see `output_layer_group`), each in the order the implementation registers
    them (the order a for-loop optimizer visits them). Shapes are (out, in) as nn.Linear's weight; the
    counts of a group add up to its `param_groups` count (a test checks both layouts, and the shapes
    against transformers' GPT-2 and Llama modules)."""
    P = Poly.parse
    q_kv = P("q g /a")  # K and V rows
    qkv_rows = Poly.parse_sum("q + 2 q g /a")
    f_in = P("2 f") if model.mlp == "swiglu" else P("f")
    norm = [WeightShape("layer norms", "norm weight", P("h"), None)]
    final = [WeightShape("final norm", "final norm weight", P("h"), None)]
    if model.norm == "layernorm":
        norm.append(WeightShape("layer norms", "norm bias", P("h"), None))
        final.append(WeightShape("final norm", "final norm bias", P("h"), None))
    col_bias, row_bias = "column-parallel biases (QKV, MLP input)", "row-parallel biases (output projection, MLP output)"

    def linear(group: str, name: str, rows: Poly, cols: Poly, split: str, count: int = 1) -> list[WeightShape]:
        out = [WeightShape(group, name, rows, cols, 1, split)]
        if model.bias:
            bias_group, bias_split = (col_bias, "rows") if split == "rows" else (row_bias, None)
            out.append(WeightShape(bias_group, name + " bias", rows, None, 1, bias_split))
        return out * count

    qkv_w, proj_w = "QKV projection weight", "attention output projection weight"
    fc1_w, fc2_w = "MLP input projection weight", "MLP output projection weight"
    if layout == "fused":
        layer = (norm + linear(qkv_w, "QKV", qkv_rows, P("h"), "rows") + linear(proj_w, "output projection", P("h"),
                 P("q"), "cols") + norm + linear(fc1_w, "MLP input", f_in, P("h"), "rows")
                 + linear(fc2_w, "MLP output", P("h"), P("f"), "cols"))
    else:
        mlp_in = (linear(fc1_w, "gate / up", P("f"), P("h"), "rows", 2) if model.mlp == "swiglu"
                  else linear(fc1_w, "MLP input", P("f"), P("h"), "rows"))
        layer = (linear(qkv_w, "Q", P("q"), P("h"), "rows") + linear(qkv_w, "K / V", q_kv, P("h"), "rows", 2)
                 + linear(proj_w, "output projection", P("h"), P("q"), "cols") + mlp_in
                 + linear(fc2_w, "MLP output", P("h"), P("f"), "cols") + norm + norm)
    first = [WeightShape("word embedding", "word embedding", P("v"), P("h"), 1, "rows")]
    if model.position_embedding == "learned":
        first.append(WeightShape("position embedding", "position embedding", P("s"), P("h")))
    head = (WeightShape(output_layer_group().name, "output layer", P("v"), P("h"), 1, "rows"),)
    return {"first": tuple(first), "layer": tuple(layer), "last": tuple(final), "head": head}


def stage_tensors(model: ModelSpec, values: Mapping[str, Any], layers: Any, is_first: Any, is_last: Any, p: Any,
                  layout: Layout = "fused") -> optimizers.StageTensors:
    """The parameter tensors of one GPU of a stage (`values`: the symbols, t scalar or arrays)."""
    shapes = weight_shapes(model, layout)
    on = {scope: tuple(w.on_gpu(values, scope == "layer") for w in ws) for scope, ws in shapes.items()}
    head_copy = 1 if not model.tied_embeddings else (p > 1)
    return optimizers.StageTensors(on["first"], on["layer"], on["last"], on["head"], layers, is_first, is_last,
                                   is_last * head_copy)


def optimizer_bytes(training: TrainingSpec, params: Any, tensors: Optional[optimizers.StageTensors] = None) -> Any:
    """Master weights and optimizer states of `params` parameters on one GPU, before ZeRO sharding:
    master + moments x state bytes per parameter for the optimizers whose states are full-size
    copies (AdamW, SGD, Lion), per tensor shape for the others (`tensors`: the GPU's tensors)."""
    if training.optimizer in ("adamw", "sgd", "sgd-nomomentum", "lion") or tensors is None:
        return params * (training.master_weight_bytes + training.optimizer_moments * training.optimizer_state_bytes)
    held = [(t, 1 * tensors.is_first) for t in tensors.first] + [(t, tensors.layers) for t in tensors.layer]
    held += [(t, 1 * tensors.is_last) for t in tensors.last] + [(t, 1 * tensors.has_head) for t in tensors.head]
    return params * training.master_weight_bytes + optimizers.state_bytes(training, held)


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


def state_bytes(params: Any, training: TrainingSpec, d: Any, zero: Any, gathered_params: Any = 0,
                optimizer_unsharded: Any = None) -> StateBytes:
    """Weights, gradients and optimizer bytes for `params` parameters on one GPU, the ZeRO-sharded
    parts split over `d` ranks (the data-parallel size, or the shard group with HSDP).

    `gathered_params` is the transient full copy ZeRO-3 gathers (one layer) during compute;
    `optimizer_unsharded` the master weights + optimizer states before sharding (`optimizer_bytes`;
    default: a full-size copy per moment, as AdamW and SGD keep).
    """
    if optimizer_unsharded is None:
        optimizer_unsharded = optimizer_bytes(training, params)
    z = zero
    weights = shard_bytes(params * training.weight_bytes, d, z >= 3) + (z >= 3) * gathered_params * training.weight_bytes
    gradients = shard_bytes(params * training.grad_bytes, d, z >= 2)
    optimizer = shard_bytes(optimizer_unsharded, d, z >= 1)
    return StateBytes(weights, gradients, optimizer)
