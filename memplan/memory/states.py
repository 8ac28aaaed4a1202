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
memplan/memory/optimizers.py): `weight_shapes` lists every parameter tensor of a group by shape, in the
order the implementation registers them ("fused": Megatron-LM and the reference layer, one QKV and
one MLP-input matrix, as transformers' GPT-2 Conv1D c_attn / c_fc; "separate": transformers' Llama
layout, q/k/v_proj and gate/up_proj apart; `Inventory.weight_layout` says which an
implementation uses).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Optional

from memplan.core.model import ModelSpec
from memplan.memory.dp_stack import sharded_weight_bytes
from memplan.core.training import TrainingSpec
from memplan.core.symbolic import Poly
from memplan.inventory.types import OUTPUT_LAYER_W
from memplan.memory import optimizers

# Where a group lives: in every layer, in each mixture-of-experts layer ("moe"), in each dense layer of an
# MoE model ("dense": the layers before the first MoE one), on the first stage or on the last.
Scope = Literal["layer", "moe", "dense", "first", "last"]
LAYER_SCOPES = ("layer", "moe", "dense")
GATE = "attention output gate weight"  # ModelSpec.attention_output_gate


@dataclass(frozen=True)
class ParamGroup:
    name: str
    count: Poly
    tp_split: bool
    scope: Scope
    expert: bool = False  # the routed experts: split over ep x etp instead of t (memplan/memory/parallel.py)

    def per_gpu(self, values: Mapping[str, Any]) -> Any:
        n = self.count.evaluate(values)
        if self.expert:  # E/ep experts on a GPU, each f_e/etp wide (ep | E and etp | f_e: specs.py)
            return n // (values.get("ep", 1) * values.get("etp", values["t"]))
        # Vocabulary-parallel embeddings are padded to a multiple of t (Megatron-LM pads v).
        return -(-n // values["t"]) if self.tp_split else n


_GROUPS: dict[int, tuple[ModelSpec, tuple[ParamGroup, ...]]] = {}  # by the (frozen) model's identity, model kept


def param_groups(model: ModelSpec) -> tuple[ParamGroup, ...]:
    """`model_groups` of the model, made once per model object (the timelines of a plan's stages ask it often)."""
    hit = _GROUPS.get(id(model))
    if hit is None or hit[0] is not model:
        if len(_GROUPS) >= 64:
            _GROUPS.clear()
        hit = _GROUPS[id(model)] = (model, model_groups(model))
    return hit[1]


def model_groups(model: ModelSpec) -> tuple[ParamGroup, ...]:
    """Parameter groups of a decoder-only transformer (column/row-parallel split as Megatron-LM).

    A mixture-of-experts layer's MLP (scope "moe") is its E routed experts, each a gated (3 h f_e) or
    plain (2 h f_e) MLP, the router's E x h weight and the shared experts' MLP (f_s wide, all of them
    together); the dense layers before the first MoE layer (scope "dense") keep an f-wide MLP. The experts
    keep the names of the dense MLP's groups (the backward's moments name them). transformers stores each
    MoE layer's experts as two 3-D tensors (weight_shapes); Megatron-LM's count is the same
    (megatron/training/theoretical_memory_usage.py: E x 2 h f_e x 3/2 + h E per MoE layer)."""
    norm = "2 h" if model.has_norm_bias else "h"  # LayerNorm: weight + bias; RMSNorm (Cohere's LayerNorm): weight
    gated = model.mlp == "swiglu"
    mlp_in = "2 h f" if gated else "h f"  # gated MLP: gate and up projections
    mlp = "dense" if model.moe_first_dense_layers else "layer"
    groups = [
        ParamGroup("QKV projection weight", mla_qkv_count(model) if model.is_mla else Poly.parse_sum("h q + 2 h q g /a"),
                   True, "layer"),
        ParamGroup("attention output projection weight", Poly.parse("q h"), True, "layer"),
    ]
    if model.is_mla:
        groups.append(ParamGroup("latent norms", Poly.parse_sum("rq + rkv" if model.q_lora_rank else "rkv"), False,
                                 "layer"))
    if model.qk_norm and model.norm_params:
        qk = Poly.parse_sum("q + q g /a" if model.qk_norm_width == "full" else "2 q /a")
        groups.append(ParamGroup("query / key norms", qk * (2 if model.has_norm_bias else 1), False, "layer"))
    if model.attention_sinks:
        groups.append(ParamGroup("attention sinks", Poly.parse("a"), True, "layer"))
    if model.attention_output_gate:  # AFMoE: self_attn.gate_proj, h -> q (full) or h -> a (head)
        groups.append(ParamGroup(GATE, Poly.parse("h q" if model.attention_output_gate == "full" else "h a"), True,
                                 "layer"))
    if model.is_moe:
        groups += [
            ParamGroup("MLP input projection weight", Poly.parse(("2 " if gated else "") + "E h fe"), True, "moe",
                       expert=True),
            ParamGroup("MLP output projection weight", Poly.parse("E h fe"), True, "moe", expert=True),
            ParamGroup("router weight", Poly.parse("E h"), False, "moe"),
        ]
        if model.moe_bias or model.moe_router_bias:  # gpt-oss, ERNIE 4.5: the router's bias E
            groups.append(ParamGroup("router bias", Poly.parse("E"), False, "moe"))
        if model.moe_bias:  # gpt-oss: each expert's gate_up bias 2 f_e and down bias h
            groups += [ParamGroup("expert biases", Poly.parse_sum(("2 " if gated else "") + "E fe + E h"), True, "moe",
                                  expert=True)]
        if model.moe_shared_ffn_hidden_size:
            groups += [
                ParamGroup("shared experts' input projection weight", Poly.parse(("2 " if gated else "") + "h fs"),
                           True, "moe"),
                ParamGroup("shared experts' output projection weight", Poly.parse("h fs"), True, "moe"),
            ]
        if model.moe_shared_gate:  # Qwen2-MoE: shared_expert_gate, h -> 1
            groups.append(ParamGroup("shared experts' gate", Poly.parse("h"), False, "moe"))
    if not model.is_moe or model.moe_first_dense_layers:
        prefix = "dense " if model.is_moe else ""
        groups += [
            ParamGroup(prefix + "MLP input projection weight", Poly.parse(mlp_in), True, mlp),
            ParamGroup(prefix + "MLP output projection weight", Poly.parse("h f"), True, mlp),
        ]
        if model.mlp_bias and not model.bias:  # GPT-J: fc_in's f and fc_out's h
            groups.append(ParamGroup(prefix + "MLP biases", Poly.parse_sum(("2 f" if gated else "f") + " + h"), True,
                                     mlp))
    if model.norm_params:
        groups.append(ParamGroup("layer norms", Poly.parse(norm) * model.layer_norms, False, "layer"))
    if model.attention_bias and not model.bias:
        groups += [ParamGroup("QKV biases", Poly.parse_sum("q + 2 q g /a"), True, "layer"),
                   ParamGroup("attention output projection bias", Poly.parse("h"), False, "layer")]
    elif model.qkv_bias and not model.bias:
        groups.append(ParamGroup("QKV biases", Poly.parse_sum("q + 2 q g /a"), True, "layer"))
    if model.out_bias and not (model.bias or model.attention_bias):  # GPT-Neo: out_proj's bias alone
        groups.append(ParamGroup("attention output projection bias", Poly.parse("h"), False, "layer"))
    if model.bias:
        mlp_bias = "2 f" if model.mlp == "swiglu" else "f"
        groups += [
            ParamGroup("column-parallel biases (QKV, MLP input)",
                       Poly.parse_sum(f"q + 2 q g /a + {mlp_bias}"), True, "layer"),
            ParamGroup("row-parallel biases (output projection, MLP output)", Poly.parse("2 h"), False, "layer"),
        ]
    groups.append(ParamGroup("word embedding", Poly.parse("v h"), True, "first"))
    if model.embedding_norm:  # BLOOM: word_embeddings_layernorm
        groups.append(ParamGroup("embedding norm", Poly.parse(norm), False, "first"))
    if model.position_embedding == "learned":
        groups.append(ParamGroup("position embedding", position_rows(model) * Poly.parse("h"), False, "first"))
    if model.norm_params and model.final_norm:
        groups.append(ParamGroup("final norm", Poly.parse(norm), False, "last"))
    if model.head_bias:
        groups.append(ParamGroup("output head bias", Poly.parse("v"), True, "last"))
    return tuple(groups)


def position_rows(model: ModelSpec) -> Poly:
    """Rows of a learned position table: the model's own count (transformers' max_position_embeddings), else s (K22,
    Megatron-LM), and OPT's / BioGPT's 2 rows beyond (their position ids start at 2)."""
    rows = Poly.parse("s") if model.position_rows is None else Poly.parse(str(model.position_rows))
    return rows + Poly.parse(str(model.position_offset)) if model.position_offset else rows


def output_layer_group() -> ParamGroup:
    """The output projection v x h: its own weight when untied; with tied embeddings the last
    stage still keeps a copy when p > 1 (Megatron-LM synchronises the two copies)."""
    return ParamGroup(OUTPUT_LAYER_W, Poly.parse("v h"), True, "last")


Count = Callable[[ParamGroup], Any]  # a group's parameters on one GPU for the plan at hand


def counter(values: Mapping[str, Any]) -> Count:
    """Count each group's parameters with the symbols `values` (scalars or arrays)."""
    return lambda group: group.per_gpu(values)


def mla_qkv_count(model: ModelSpec) -> Poly:
    """Multi-head latent attention's Q, K and V projections (transformers DeepseekV3Attention, Megatron-LM
    MLASelfAttention): Q through the r_q latent, q_a_proj h r_q + q_b_proj r_q a (d_n + d_r), or directly
    h a (d_n + d_r); kv_a_proj_with_mqa h (r_kv + d_r); kv_b_proj r_kv a (d_n + d_v). The output projection
    is q h with q = a d_v."""
    q = "h rq + a dn rq + a dr rq" if model.q_lora_rank else "a dn h + a dr h"
    return Poly.parse_sum(q + " + h rkv + h dr + a dn rkv + a dv rkv")


def layer_kinds(model: ModelSpec, layers: Any, is_first: Any) -> dict[str, Any]:
    """How many of a stage's `layers` layers each layer scope's groups are in: every layer ("layer"), the
    dense layers of an MoE model ("dense": the first moe_first_dense_layers, all on the first stage, as
    Config checks) and its MoE layers ("moe": the others)."""
    dense = model.moe_first_dense_layers * is_first
    return {"layer": layers, "moe": layers - dense, "dense": dense}


def stage_params(model: ModelSpec, count: Count, layers: Any, is_first: Any, is_last: Any, p: Any) -> Any:
    """Parameters held by one GPU of a stage with `layers` layers (scalars or arrays)."""
    total: Any = 0
    weights = {**layer_kinds(model, layers, is_first), "first": is_first, "last": is_last}
    for group in param_groups(model):
        total = total + count(group) * weights[group.scope]
    head_copy = 1 if not model.tied_embeddings else (p > 1)
    return total + (count(output_layer_group()) * head_copy + mtp_stage_params(model, count)) * is_last


def mtp_stage_params(model: ModelSpec, count: Count) -> Any:
    """The multi-token-prediction modules' own parameters on one GPU of the last stage (megatron-core
    multi_token_prediction.py MultiTokenPredictionLayer: enorm, hnorm, the final norm (h each), eh_proj (2h x h,
    column-parallel) and one transformer layer, an MoE one in an MoE model; the embedding and output head are the
    main model's, shared). Not in total_params: DeepSeek-V3's published 671 B excludes its MTP module."""
    if not model.mtp_layers:
        return 0
    layer = sum(count(g) for g in param_groups(model) if g.scope in ("layer", "moe" if model.is_moe else "layer"))
    own = count(ParamGroup("MTP eh_proj", Poly.parse("2 h h"), True, "last")) + 3 * model.hidden_size
    return model.mtp_layers * (layer + own)


def mtp_params(model: ModelSpec) -> int:
    """The multi-token-prediction modules' parameters (t = 1), beside total_params."""
    return int(mtp_stage_params(model, counter(model.symbols(t=1))))


def layer_params(model: ModelSpec, count: Count) -> Any:
    """Parameters of the largest layer on one GPU (an MoE model: an MoE layer or a dense one, whichever
    holds more; ZeRO-3 gathers one layer at a time)."""
    total: Any = 0
    kinds: dict[str, Any] = {"moe": 0, "dense": 0}
    for group in param_groups(model):
        if group.scope == "layer":
            total = total + count(group)
        elif group.scope in kinds:
            kinds[group.scope] = kinds[group.scope] + count(group)
    moe, dense = kinds["moe"], kinds["dense"]
    return total + moe + (dense - moe) * (dense > moe)


def total_params(model: ModelSpec) -> int:
    """Parameters of the whole model (t = 1, each tied weight once): one stage holding everything; without the
    multi-token-prediction modules (mtp_params), as DeepSeek-V3's published count."""
    return stage_params(model, counter(model.symbols(t=1)), model.num_layers, 1, 1, 1) - mtp_params(model)


def active_params(model: ModelSpec) -> int:
    """Parameters one token goes through: all of a dense model's; of an MoE model, its k routed experts
    of E (and the shared ones, the router) in each MoE layer (what model FLOPs count, timing/flops.py)."""
    if not model.is_moe:
        return total_params(model)
    per_expert = (3 if model.mlp == "swiglu" else 2) * model.hidden_size * model.fe
    if model.moe_bias:  # an expert's own biases (gpt-oss): gate_up 2 f_e, down h
        per_expert += (2 if model.mlp == "swiglu" else 1) * model.fe + model.hidden_size
    return total_params(model) - model.moe_layers * (model.num_experts - model.moe_top_k) * per_expert


Layout = Literal["fused", "separate"]


@dataclass(frozen=True)
class WeightShape:
    """`count` parameter tensors of group `group`, each `rows` x `cols` (cols None: a vector of rows), or
    with `batch` a 3-D tensor of `batch` such matrices (transformers' experts: E x rows x cols), `split`:
    the dimension tensor parallelism divides (rows: column- / vocab-parallel, cols: row-parallel)."""

    group: str
    name: str
    rows: Poly
    cols: Optional[Poly]
    count: int = 1
    split: Optional[Literal["rows", "cols"]] = None
    batch: Optional[Poly] = None

    @property
    def numel(self) -> Poly:
        n = self.rows if self.cols is None else self.rows * self.cols
        return n if self.batch is None else self.batch * n

    def on_gpu(self, values: Mapping[str, Any], hidden: bool) -> optimizers.Tensor:
        """The tensor on one GPU with the symbols `values` (scalars or arrays; t splits `split`)."""
        r = self.rows.evaluate(values)
        c = None if self.cols is None else self.cols.evaluate(values)
        if self.split == "rows":
            r = -(-r // values["t"])
        elif self.split == "cols":
            c = -(-c // values["t"])
        batch = 1 if self.batch is None else int(self.batch.evaluate(values))  # E: a model constant
        return optimizers.Tensor(r, c, hidden and c is not None, batch)


def weight_shapes(model: ModelSpec, layout: Layout = "fused") -> dict[str, tuple[WeightShape, ...]]:
    """Every parameter tensor by shape, scope by scope ("first", "layer", "dense_layer", "last", "head":
    the output layer where it exists, see `output_layer_group`), each in the order the implementation
    registers them (the order a for-loop optimizer visits them). Shapes are (out, in) as nn.Linear's
    weight; the counts of a group add up to its `param_groups` count (a test checks both layouts, and the
    shapes against transformers' GPT-2, Llama, Mixtral and Qwen3-MoE modules).

    "layer" is a layer of a dense model, or an MoE layer; "dense_layer" a dense layer of an MoE model
    (the first moe_first_dense_layers layers; empty for other models). transformers keeps each MoE layer's
    experts as two 3-D tensors, gate_up_proj E x 2f_e x h and down_proj E x h x f_e (Mixtral, Qwen3-MoE,
    DeepSeek-V3 in transformers 5.x), its router as an E x h matrix; Megatron-LM's grouped experts
    (TEGroupedMLP) one matrix per expert and projection. Within the MoE block, the experts come before the
    router here (Qwen3-MoE, DeepSeek-V3; Mixtral registers its router first)."""
    P = Poly.parse
    q_kv = P("q g /a")  # K and V rows
    qkv_rows = Poly.parse_sum("q + 2 q g /a")
    gated = model.mlp == "swiglu"
    f_in = P("2 f") if gated else P("f")
    norm = [WeightShape("layer norms", "norm weight", P("h"), None)]
    final = [WeightShape("final norm", "final norm weight", P("h"), None)]
    if model.has_norm_bias:
        norm.append(WeightShape("layer norms", "norm bias", P("h"), None))
        final.append(WeightShape("final norm", "final norm bias", P("h"), None))
    embedding_norm = [WeightShape("embedding norm", w.name.replace("final", "embedding"), P("h"), None)
                      for w in final] if model.embedding_norm else []
    if not model.norm_params:  # OLMo, nanochat: norms without weights
        norm, final = [], []
    if not model.final_norm:  # GPT-1: no norm after the last layer
        final = []
    qk_norms = [WeightShape("query / key norms", "query / key norm weight", P("q /a"), None,
                            4 if model.has_norm_bias else 2)] \
        if model.qk_norm and model.qk_norm_width == "head" and model.norm_params else []
    if model.qk_norm and model.qk_norm_width == "full" and model.norm_params:  # OLMo-2 (q, qg/a), Cohere
        # ((a, d), (g, d))
        qk_norms = [WeightShape("query / key norms", "query norm weight", P("q"), None),
                    WeightShape("query / key norms", "key norm weight", q_kv, None)]
    if model.attention_sinks:  # gpt-oss: self_attn.sinks, one logit per head
        qk_norms = [WeightShape("attention sinks", "sinks", P("a"), None, 1, "rows")] + qk_norms
    qkv_biases = ([WeightShape("QKV biases", "QKV bias", qkv_rows, None, 1, "rows")] if layout == "fused" else
                  [WeightShape("QKV biases", "Q bias", P("q"), None, 1, "rows"),
                   WeightShape("QKV biases", "K / V bias", q_kv, None, 2, "rows")])
    if model.attention_bias and not model.bias:  # q, k, v, o_proj biases (gpt-oss, Phi-3.5-MoE)
        qk_norms = qk_norms + qkv_biases + [WeightShape("attention output projection bias", "o_proj bias", P("h"),
                                                        None)]
    elif model.qkv_bias and not model.bias:  # Qwen2: q_proj, k_proj, v_proj have biases, nothing else
        qk_norms = qkv_biases + qk_norms
    if model.attention_output_gate:
        rows = P("q") if model.attention_output_gate == "full" else P("a")
        qk_norms = qk_norms + [WeightShape(GATE, "attention gate weight", rows, P("h"), 1, "rows")]
    if model.out_bias and not (model.bias or model.attention_bias):  # GPT-Neo: out_proj's bias alone
        qk_norms = qk_norms + [WeightShape("attention output projection bias", "out_proj bias", P("h"), None)]
    sandwich = norm * (model.layer_norms - 2)  # Gemma 2 / 3: norms on the sub-layers' outputs
    second = norm if model.layer_norms > 1 else []  # one norm: a parallel block's shared one (Falcon-7B, Cohere)
    col_bias, row_bias = "column-parallel biases (QKV, MLP input)", "row-parallel biases (output projection, MLP output)"

    def linear(group: str, name: str, rows: Poly, cols: Poly, split: str, count: int = 1) -> list[WeightShape]:
        out = [WeightShape(group, name, rows, cols, 1, split)]
        if model.bias:
            bias_group, bias_split = (col_bias, "rows") if split == "rows" else (row_bias, None)
            out.append(WeightShape(bias_group, name + " bias", rows, None, 1, bias_split))
        return out * count

    qkv_w, proj_w = "QKV projection weight", "attention output projection weight"
    fc1_w, fc2_w = "MLP input projection weight", "MLP output projection weight"
    prefix = "dense " if model.is_moe else ""
    if model.is_mla:  # the same tensors in both layouts (Megatron-LM: linear_q_down_proj, ..., linear_proj)
        attention = _mla_shapes(model) + linear(proj_w, "output projection", P("h"), P("q"), "cols")
        if layout == "fused":
            attention = norm + attention + second
    elif layout == "fused":
        attention = norm + linear(qkv_w, "QKV", qkv_rows, P("h"), "rows") + linear(
            proj_w, "output projection", P("h"), P("q"), "cols") + qk_norms + second
    else:
        attention = (linear(qkv_w, "Q", P("q"), P("h"), "rows") + linear(qkv_w, "K / V", q_kv, P("h"), "rows", 2)
                     + linear(proj_w, "output projection", P("h"), P("q"), "cols") + qk_norms)
    attention = attention + sandwich
    if layout == "fused":
        dense_mlp = (linear(prefix + fc1_w, "MLP input", f_in, P("h"), "rows")
                     + linear(prefix + fc2_w, "MLP output", P("h"), P("f"), "cols"))
    else:
        mlp_in = (linear(prefix + fc1_w, "gate / up", P("f"), P("h"), "rows", 2) if gated
                  else linear(prefix + fc1_w, "MLP input", P("f"), P("h"), "rows"))
        dense_mlp = mlp_in + linear(prefix + fc2_w, "MLP output", P("h"), P("f"), "cols")
    if model.mlp_bias and not model.bias:  # GPT-J: fc_in's and fc_out's biases
        dense_mlp += [WeightShape(prefix + "MLP biases", "MLP input bias", f_in, None, 1, "rows"),
                      WeightShape(prefix + "MLP biases", "MLP output bias", P("h"), None)]
    layer = attention + dense_mlp + ([] if layout == "fused" else norm + second)
    dense_layer: list[WeightShape] = []
    if model.is_moe:
        moe = _moe_shapes(model, layout)
        dense_layer = layer if model.moe_first_dense_layers else []
        layer = (attention + moe) if layout == "fused" else (attention + moe + norm + second)
    first = [WeightShape("word embedding", "word embedding", P("v"), P("h"), 1, "rows")] + embedding_norm
    if model.position_embedding == "learned":
        first.append(WeightShape("position embedding", "position embedding", position_rows(model), P("h")))
    final += [WeightShape("output head bias", "lm_head bias", P("v"), None, 1, "rows")] if model.head_bias else []
    head = (WeightShape(output_layer_group().name, "output layer", P("v"), P("h"), 1, "rows"),)
    return {"first": tuple(first), "layer": tuple(layer), "dense_layer": tuple(dense_layer), "last": tuple(final),
            "head": head}


def _mla_shapes(model: ModelSpec) -> list[WeightShape]:
    """Multi-head latent attention's tensors before the output projection, in transformers' order
    (DeepseekV3Attention: q_proj or q_a_proj, q_a_layernorm, q_b_proj; kv_a_proj_with_mqa, kv_a_layernorm,
    kv_b_proj)."""
    P, S = Poly.parse, Poly.parse_sum
    qkv_w, norms = "QKV projection weight", "latent norms"
    if model.q_lora_rank:
        q = [WeightShape(qkv_w, "q_a_proj", P("rq"), P("h")), WeightShape(norms, "q_a_layernorm", P("rq"), None),
             WeightShape(qkv_w, "q_b_proj", S("a dn + a dr"), P("rq"), 1, "rows")]
    else:
        q = [WeightShape(qkv_w, "q_proj", S("a dn + a dr"), P("h"), 1, "rows")]
    return q + [WeightShape(qkv_w, "kv_a_proj_with_mqa", S("rkv + dr"), P("h")),
                WeightShape(norms, "kv_a_layernorm", P("rkv"), None),
                WeightShape(qkv_w, "kv_b_proj", S("a dn + a dv"), P("rkv"), 1, "rows")]


def _moe_shapes(model: ModelSpec, layout: Layout) -> list[WeightShape]:
    """An MoE layer's MLP tensors: the routed experts, the router, the shared experts (weight_shapes)."""
    P = Poly.parse
    fe_in = P("2 fe") if model.mlp == "swiglu" else P("fe")
    router = [WeightShape("router weight", "router", P("E"), P("h"))]
    router += [WeightShape("router bias", "router bias", P("E"), None)] if model.moe_bias or model.moe_router_bias \
        else []
    E = model.num_experts or 0
    fc1_w, fc2_w = "MLP input projection weight", "MLP output projection weight"
    if layout == "fused":  # Megatron-LM TEGroupedMLP: linear_fc1.weight0..E-1, then linear_fc2's
        experts = [WeightShape(fc1_w, "expert MLP input", fe_in, P("h"), E, "rows"),
                   WeightShape(fc2_w, "expert MLP output", P("h"), P("fe"), E, "cols")]
    else:  # transformers: gate_up_proj (E, 2 f_e, h), down_proj (E, h, f_e)
        experts = [WeightShape(fc1_w, "experts' gate_up_proj", fe_in, P("h"), 1, "rows", P("E")),
                   WeightShape(fc2_w, "experts' down_proj", P("h"), P("fe"), 1, "cols", P("E"))]
    if model.moe_bias:  # gpt-oss: gate_up_proj_bias (E, 2 f_e), down_proj_bias (E, h)
        experts += [WeightShape("expert biases", "experts' gate_up_proj_bias", fe_in, None, 1, "rows", P("E")),
                    WeightShape("expert biases", "experts' down_proj_bias", P("h"), None, 1, None, P("E"))]
    shared: list[WeightShape] = []
    if model.moe_shared_ffn_hidden_size:
        s_in, s_out = "shared experts' input projection weight", "shared experts' output projection weight"
        if layout == "fused" or model.mlp != "swiglu":
            shared = [WeightShape(s_in, "shared experts' MLP input", P("2 fs") if model.mlp == "swiglu" else P("fs"),
                                  P("h"), 1, "rows")]
        else:
            shared = [WeightShape(s_in, "shared experts' gate / up", P("fs"), P("h"), 2, "rows")]
        shared.append(WeightShape(s_out, "shared experts' MLP output", P("h"), P("fs"), 1, "cols"))
        shared += [WeightShape("shared experts' gate", "shared_expert_gate", P("h"), None)] if model.moe_shared_gate \
            else []
    return (router + experts + shared) if layout == "fused" else (experts + router + shared)


def stage_tensors(model: ModelSpec, values: Mapping[str, Any], layers: Any, is_first: Any, is_last: Any, p: Any,
                  layout: Layout = "fused") -> optimizers.StageTensors:
    """The parameter tensors of one GPU of a stage (`values`: the symbols, t scalar or arrays)."""
    shapes = weight_shapes(model, layout)
    on = {scope: tuple(w.on_gpu(values, scope in ("layer", "dense_layer")) for w in ws) for scope, ws in shapes.items()}
    head_copy = 1 if not model.tied_embeddings else (p > 1)
    dense = layer_kinds(model, layers, is_first)["dense"]
    return optimizers.StageTensors(on["first"], on["layer"], on["last"], on["head"], layers - dense, is_first, is_last,
                                   is_last * head_copy, on["dense_layer"], dense)


def optimizer_bytes(training: TrainingSpec, params: Any, tensors: Optional[optimizers.StageTensors] = None) -> Any:
    """Master weights and optimizer states of `params` parameters on one GPU, before ZeRO sharding:
    master + moments x state bytes per parameter for the optimizers whose states are full-size
    copies (AdamW, SGD, Lion), per tensor shape for the others (`tensors`: the GPU's tensors)."""
    if training.optimizer in ("adamw", "sgd", "sgd-nomomentum", "lion") or tensors is None:
        return params * (training.master_weight_bytes + training.optimizer_moments * training.optimizer_state_bytes)
    held = [(t, 1 * tensors.is_first) for t in tensors.first] + [(t, tensors.layers) for t in tensors.layer]
    held += [(t, tensors.dense_layers) for t in tensors.dense]
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
    weights = shard_bytes(params * sharded_weight_bytes(training), d, z >= 3) + (z >= 3) * gathered_params * training.weight_bytes
    gradients = shard_bytes(params * training.grad_bytes, d, z >= 2)
    optimizer = shard_bytes(optimizer_unsharded, d, z >= 1)
    return StateBytes(weights, gradients, optimizer)
