"""The parameter tensors by shape (split from states.py): `weight_shapes` lists every parameter tensor of the
groups states.py counts, in the order the implementation registers them ("fused": Megatron-LM and the reference
layer, one QKV and one MLP-input matrix; "separate": transformers' Llama layout, q/k/v_proj and gate/up_proj apart),
and `stage_tensors` the tensors on one GPU of a stage (the optimizers' shape-dependent states, the allocator's
replay)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal, Mapping, Optional

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.core.symbolic import Poly
from memplan.memory import optimizers
from memplan.memory.embedding_groups import embedding_widths, frozen_position_width, position_rows
from memplan.memory.indexer_groups import INDEXER, NORM_GATES
from memplan.memory.states import (CROSS, CROSS_NORM, CROSS_OUT_BIAS, CROSS_QKV_BIAS, GATE, gate_rows, layer_kinds,
                                    layer_vectors, output_layer_group, param_groups)


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
    v_rows = P(f"{model.value_head_dim} g") if model.value_head_dim else q_kv  # MiMo-V2-Flash: V heads d_v wide
    o_cols = P(f"{model.value_head_dim} a") if model.value_head_dim else P("q")
    qkv_rows = P("q") + q_kv + v_rows
    gated = model.mlp == "swiglu"
    f_in = P("2 f") if gated else P("f")
    norm = [WeightShape("layer norms", "norm weight", P("h"), None)]
    final = [WeightShape("final norm", "final norm weight", P("h"), None)]
    if model.has_norm_bias:
        norm.append(WeightShape("layer norms", "norm bias", P("h"), None))
        final.append(WeightShape("final norm", "final norm bias", P("h"), None))
    e, e_out = embedding_widths(model)  # h, h unless factorised (ELECTRA, RemBERT, RoFormer)
    embedding_norm = [WeightShape("embedding norm", w.name.replace("final", "embedding"), e, None)
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
                   WeightShape("QKV biases", "K / V bias", q_kv, None, 2, "rows")] if not model.value_head_dim else
                  [WeightShape("QKV biases", "Q bias", P("q"), None, 1, "rows"),
                   WeightShape("QKV biases", "K bias", q_kv, None, 1, "rows"),
                   WeightShape("QKV biases", "V bias", v_rows, None, 1, "rows")])
    if model.attention_bias and not model.bias:  # q, k, v, o_proj biases (gpt-oss, Phi-3.5-MoE)
        qk_norms = qk_norms + qkv_biases + [WeightShape("attention output projection bias", "o_proj bias", P("h"),
                                                        None)]
    elif model.qkv_bias and not model.bias:  # Qwen2: q_proj, k_proj, v_proj have biases, nothing else
        qk_norms = qkv_biases + qk_norms
    if model.attention_output_gate:  # AFMoE, Laguna: h -> q (full) or h -> a (head)
        qk_norms = qk_norms + [WeightShape(GATE, "attention gate weight", gate_rows(model), P("h"), 1, "rows")]
        qk_norms += [WeightShape(GATE, "attention gate bias", P("a"), None, 1, "rows")] * model.attention_gate_bias
    qk_norms = qk_norms + [WeightShape(group, name, count, None) for group, name, count in layer_vectors(model)]
    if model.out_bias and not (model.bias or model.attention_bias):  # GPT-Neo: out_proj's bias alone
        qk_norms = qk_norms + [WeightShape("attention output projection bias", "out_proj bias", P("h"), None)]
    sandwich = norm * (model.layer_norms - 2)  # Gemma 2 / 3: norms on the sub-layers' outputs
    if model.encoder_kind == "seq2seq":  # a decoder's third norm: its cross-attention's (encoder_attn_layer_norm)
        sandwich = [replace(w, group=CROSS_NORM) for w in sandwich]
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
        attention = (_mla_shapes(model) + linear(proj_w, "output projection", P("h"), P("q"), "cols")
                     + _indexer_shapes(model))
        if layout == "fused":
            attention = norm + attention + second
    elif layout == "fused":
        attention = norm + linear(qkv_w, "QKV", qkv_rows, P("h"), "rows") + linear(
            proj_w, "output projection", P("h"), o_cols, "cols") + qk_norms + second
    else:
        kv = linear(qkv_w, "K / V", q_kv, P("h"), "rows", 2) if not model.value_head_dim else \
            linear(qkv_w, "K", q_kv, P("h"), "rows") + linear(qkv_w, "V", v_rows, P("h"), "rows")
        attention = (linear(qkv_w, "Q", P("q"), P("h"), "rows") + kv
                     + linear(proj_w, "output projection", P("h"), o_cols, "cols") + qk_norms)
    attention = attention + sandwich
    if model.encoder_kind == "seq2seq":  # BART's decoder: encoder_attn's k, v, q, out_proj (counted, not run alone)
        attention += [WeightShape(CROSS, "cross-attention K / V / Q", P("q"), P("h"), 3, "rows"),
                      WeightShape(CROSS, "cross-attention output", P("h"), P("q"), 1, "cols")]
        attention += [WeightShape(CROSS_QKV_BIAS, "cross-attention K / V / Q bias", P("q"), None, 3, "rows"),
                      WeightShape(CROSS_OUT_BIAS, "cross-attention output bias", P("h"), None)] if model.bias else []
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
    attention = attention if model.key_bias else _without_key_bias(attention)
    layer = attention + dense_mlp + ([] if layout == "fused" else norm + second)
    dense_layer: list[WeightShape] = []
    if model.is_moe:
        moe = _moe_shapes(model, layout)
        dense_layer = layer if model.moe_first_dense_layers else []
        layer = (attention + moe) if layout == "fused" else (attention + moe + norm + second)
    if model.gated_norm_rank:  # A.X-K2: a gated norm's fc1 (r x h), fc2 (h x r); two in an MoE layer, one in a dense one
        r = Poly.parse(str(model.gated_norm_rank))
        gates = [WeightShape(NORM_GATES, "gated norm fc1", r, P("h")), WeightShape(NORM_GATES, "gated norm fc2", P("h"), r)]
        layer, dense_layer = layer + gates * (1 + model.is_moe), dense_layer + gates * bool(dense_layer)
    if model.per_layer_input_size:  # Gemma 4: per_layer_input_gate (p x h), per_layer_projection (h x p), its norm
        p = Poly.parse(str(model.per_layer_input_size))
        layer = layer + [WeightShape("per-layer input gate / projection", "per_layer_input_gate", p, P("h"), 1, "rows"),
                         WeightShape("per-layer input gate / projection", "per_layer_projection", P("h"), p, 1, "cols")]
        layer += [WeightShape("per-layer input layer norm", "post_per_layer_input_norm", P("h"), None)] * \
            model.norm_params
    word_rows = P("v") + P(str(model.vocab_extra_rows)) if model.vocab_extra_rows else P("v")  # Mllama: 8 beyond v
    first = [WeightShape("word embedding", "word embedding", word_rows, e, 1, "rows")] + embedding_norm
    if model.per_layer_input_size:  # embed_tokens_per_layer, per_layer_model_projection, per_layer_projection_norm
        Lp = Poly.parse(str(model.num_layers * model.per_layer_input_size))
        rows = Poly.parse(str(model.per_layer_input_vocab or model.vocab_size))
        first += [WeightShape("per-layer input embedding", "embed_tokens_per_layer", rows, Lp, 1, "rows"),
                  WeightShape("per-layer input projection", "per_layer_model_projection", Lp, P("h"), 1, "rows")]
        first += [WeightShape("per-layer input norms", "per_layer_projection_norm", p, None)] * model.norm_params
    if model.position_embedding == "learned":
        first.append(WeightShape("position embedding", "position embedding", position_rows(model), e))
    if model.token_type_rows:  # BERT: token_type_embeddings
        first.append(WeightShape("token-type embedding", "token-type embedding", P(str(model.token_type_rows)), e))
    if model.embedding_widths:  # ELECTRA embeddings_project, RemBERT embedding_hidden_mapping_in: e -> h
        first += [WeightShape("embedding projection", "embedding projection", P("h"), e),
                  WeightShape("embedding projection", "embedding projection bias", P("h"), None)]
    if model.frozen_position_rows:  # RoFormer: encoder.embed_positions (head_dim wide); Pegasus, Marian: h wide
        first.append(WeightShape("frozen position table", "embed_positions", P(str(model.frozen_position_rows)),
                                 frozen_position_width(model)))
    final += [WeightShape("output head bias", "lm_head bias", P("v"), None, 1, "rows")] if model.head_bias else []
    if model.head_transform:  # BERT: cls.predictions.transform (dense h x h with bias, LayerNorm)
        final += [WeightShape("output head transform", "head transform dense", e_out, P("h")),
                  WeightShape("output head transform", "head transform dense bias", e_out, None)]
        final += [WeightShape("output head transform", "head transform " + w.name, e_out, None) for w in norm]
    extra = {scope: [WeightShape(x.name, x.name, P(str(x.rows)), None if x.cols is None else P(str(x.cols)), x.count)
                     for x in model.extra_tensors if x.scope == scope] for scope in ("first", "layer", "last")}
    first, layer, final = first + extra["first"], layer + extra["layer"], final + extra["last"]  # RoCBERT, X-MOD, ...
    dense_layer = dense_layer + extra["layer"] if dense_layer else []
    head = (WeightShape(output_layer_group(model).name, "output layer", P("v"), e_out, 1, "rows"),)
    return {"first": tuple(first), "layer": tuple(layer), "dense_layer": tuple(dense_layer), "last": tuple(final),
            "head": head}


def _without_key_bias(attention: list[WeightShape]) -> list[WeightShape]:
    """The attention's tensors less K's bias (Whisper's k_proj): K's rows of a fused QKV bias, one of the separate
    K / V biases, one of the cross-attention's three."""
    out: list[WeightShape] = []
    for w in attention:
        if w.name == "QKV bias":
            w = replace(w, rows=Poly.parse_sum("q + q g /a"))
        elif w.name == "cross-attention K / V / Q bias" or w.name == "K / V bias" and w.count == 2:
            w = replace(w, count=w.count - 1)
        elif w.name == "K / V bias" and any(o.name == "K / V bias" for o in out):
            continue  # linear()'s two K / V tensors, each with its bias: V's kept
        out.append(w)
    return out


def _mla_shapes(model: ModelSpec) -> list[WeightShape]:
    """Multi-head latent attention's tensors before the output projection, in transformers' order
    (DeepseekV3Attention: q_proj or q_a_proj, q_a_layernorm, q_b_proj; kv_a_proj_with_mqa, kv_a_layernorm,
    kv_b_proj)."""
    P, S = Poly.parse, Poly.parse_sum
    qkv_w, norms = "QKV projection weight", "latent norms"
    if model.mla_query_gate:  # A.X-K2: q_gate_proj over [q_a_layernorm's output, q_a_proj's]
        q = [WeightShape(qkv_w, "q_a_proj", P("rq"), P("h")), WeightShape(norms, "q_a_layernorm", P("rq"), None),
             WeightShape(qkv_w, "q_gate_proj", S("a dn + a dr + a dv"), P("2 rq"), 1, "rows")]
    elif model.q_lora_rank:
        q = [WeightShape(qkv_w, "q_a_proj", P("rq"), P("h")), WeightShape(norms, "q_a_layernorm", P("rq"), None),
             WeightShape(qkv_w, "q_b_proj", S("a dn + a dr"), P("rq"), 1, "rows")]
    else:
        q = [WeightShape(qkv_w, "q_proj", S("a dn + a dr"), P("h"), 1, "rows")]
    return q + [WeightShape(qkv_w, "kv_a_proj_with_mqa", S("rkv + dr"), P("h")),
                WeightShape(norms, "kv_a_layernorm", P("rkv"), None),
                WeightShape(qkv_w, "kv_b_proj", S("a dn + a dv"), P("rkv"), 1, "rows")]


def _indexer_shapes(model: ModelSpec) -> list[WeightShape]:
    """The lightning indexer's tensors (DeepseekV32Indexer, registered after o_proj), whole on every GPU."""
    if not model.mla_indexer:
        return []
    n, d = (Poly.parse(str(x)) for x in model.mla_indexer)
    return [WeightShape(INDEXER, "indexer.wq_b", n * d, Poly.parse("rq")), WeightShape(INDEXER, "indexer.wk", d,
                                                                                      Poly.parse("h")),
            WeightShape(INDEXER, "indexer.k_norm", d, None, 2), WeightShape(INDEXER, "indexer.weights_proj", n,
                                                                            Poly.parse("h"))]


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
    norms = [WeightShape("MoE block norms", "MoE block norm " + part, P("h"), None, model.moe_block_norms)
             for part in ("weight", "bias")[:1 + model.has_norm_bias]] if model.moe_block_norms and model.norm_params \
        else []  # A.X-K1: mlp.post_mlp_layernorm; Gemma 4: its MoE block's three
    return (router + experts + shared + norms) if layout == "fused" else (experts + router + shared + norms)


def stage_tensors(model: ModelSpec, values: Mapping[str, Any], layers: Any, is_first: Any, is_last: Any, p: Any,
                  layout: Layout = "fused", dense: Any = None) -> optimizers.StageTensors:
    """The parameter tensors of one GPU of a stage (`values`: the symbols, t scalar or arrays; `dense`: its dense
    first layers where not all on the first stage, states.layer_kinds)."""
    if model.layer_pattern or model.cross_attention_layers:
        kind = "a state-space hybrid's (layer_pattern)" if model.layer_pattern else "Mllama's (cross_attention_layers)"
        raise MemplanError(f"{kind} layers differ in their tensors: per-tensor optimizer states and optimizer offload "
                           "are not modelled for it; use --optimizer adamw or sgd")
    shapes = weight_shapes(model, layout)
    frozen = {g.name for g in param_groups(model) if not g.trained}  # no gradient, no state (ParamGroup.trained)
    on = {scope: tuple(w.on_gpu(values, scope in ("layer", "dense_layer")) for w in ws if w.group not in frozen)
          for scope, ws in shapes.items()}
    head_copy = 1 if not model.tied_embeddings else (p > 1)
    dense = layer_kinds(model, layers, is_first, dense=dense)["dense"]
    return optimizers.StageTensors(on["first"], on["layer"], on["last"], on["head"], layers - dense, is_first, is_last,
                                   is_last * head_copy, on["dense_layer"], dense)
