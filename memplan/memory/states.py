"""Parameters, and the bytes of weights, gradients and optimizer states per GPU.

Parameter counts are an inventory like the activations: named groups with a polynomial count, whether tensor
parallelism splits them, and where they live. The K22 GPT count is 12Lh^2 (1 + 13/(12h) + (v + s)/(12Lh)) (K22 section
6 / appendix A; Megatron-LM's general count adds g/a for grouped K/V and 3hf for a gated MLP; Q, K, V and the output
projection are q = a x head_dim wide, q = h unless a config says otherwise); the tests check it.

Bytes per parameter are the named sizes of `TrainingSpec` (Megatron-LM docs/user-guide/features/dist_optimizer.md):
bf16 weights (2) + fp32 main gradients (4) + fp32 master weights (4) + two fp32 Adam moments (8) = 18. ZeRO (Rajbhandari
et al. 2020) splits over the d data-parallel ranks: stage 1 (= Megatron-LM's distributed optimizer) the master weights
and moments, giving 6 + 12/d; stage 2 also the gradients; stage 3 also the weights, then gathered one layer at a time.
Parameters that never get a gradient (ParamGroup.trained false) have weights only.

Optimizers other than AdamW keep states that depend on each tensor's shape (Adafactor's factored second moment, 8-bit
Adam's blocks, Muon's split between hidden matrices and the rest: memplan/memory/optimizers.py): `weight_shapes`
(memplan/memory/shapes.py) lists every parameter tensor of a group by shape, in the order the implementation registers
them ("fused": Megatron-LM and the reference layer, one QKV and one MLP-input matrix, as transformers' GPT-2 Conv1D
c_attn / c_fc; "separate": transformers' Llama layout, q/k/v_proj and gate/up_proj apart; `Inventory.weight_layout`
says which an implementation uses).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Optional

from memplan.core.hybrid import (LAYER_BLOCKS, delta_counts, lightning_counts, mlstm_counts, moa_counts, rglru_counts,
                                 rwkv_counts)
from memplan.core.model import ModelSpec
from memplan.memory.dp_stack import shard_bytes, sharded_weight_bytes
from memplan.memory.embedding_groups import embedding_groups, embedding_widths
from memplan.memory.indexer_groups import INDEXER, indexer_groups
from memplan.memory.param_group import HYBRID_SCOPES, ParamGroup, number
from memplan.core.training import TrainingSpec
from memplan.core.symbolic import Poly
from memplan.inventory.types import OUTPUT_LAYER_W
from memplan.memory import optimizers

GATE = "attention output gate weight"  # ModelSpec.attention_output_gate
# an encoder-decoder model's decoder (ModelSpec.encoder_kind seq2seq): its cross-attention's groups, never trained
CROSS, CROSS_QKV_BIAS, CROSS_OUT_BIAS, CROSS_NORM = ("cross-attention weights", "cross-attention Q / K / V biases",
                                                     "cross-attention output bias", "cross-attention layer norm")
CROSS_EXTRA = "cross-attention layers' q / k norms and gates"  # ModelSpec.cross_attention_layers (Mllama)


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
    mlp = "dense" if model.moe_first_dense_layers or model.layer_pattern else "layer"
    kv_bias = "2 q g /a" if model.key_bias else "q g /a"  # Whisper: k_proj without bias
    dv = model.value_head_dim  # MiMo-V2-Flash: V heads d_v wide, o_proj a d_v -> h
    kv_bias, kv, out = (f"q g /a + {dv} g", f"h q g /a + {dv} h g", f"{dv} a h") if dv else (kv_bias, "2 h q g /a", "q h")
    groups = [
        ParamGroup("QKV projection weight", mla_qkv_count(model) if model.is_mla else Poly.parse_sum(f"h q + {kv}"),
                   True, "layer", whole=Poly.parse_sum("h rq + h rkv + h dr" if model.q_lora_rank else "h rkv + h dr")
                   if model.is_mla and model.mla_down_replicated else None),
        ParamGroup("attention output projection weight", Poly.parse(out), True, "layer"),
    ]
    if model.is_mla:
        groups.append(ParamGroup("latent norms", Poly.parse_sum("rq + rkv" if model.q_lora_rank else "rkv"), False,
                                 "layer"))
    groups += indexer_groups(model)  # DeepSeek-V3.2's lightning indexer, A.X-K2's gated norms
    if model.qk_norm and model.norm_params:
        qk = Poly.parse_sum("q + q g /a" if model.qk_norm_width == "full" else "2 q /a")
        groups.append(ParamGroup("query / key norms", qk * (2 if model.has_norm_bias else 1), False, "layer"))
    if model.attention_sinks:
        groups.append(ParamGroup("attention sinks", Poly.parse("a"), True, "layer"))
    if model.attention_output_gate:  # AFMoE: self_attn.gate_proj; Laguna: self_attn.g_proj
        groups.append(ParamGroup(GATE, gate_rows(model) * Poly.parse("h") + Poly.parse("a") * model.attention_gate_bias,
                                 True, "layer"))  # Beam: a bias per head (gate_bias)
    groups += [ParamGroup(group, count, False, "layer") for group, _, count in layer_vectors(model)]
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
        if model.moe_router_scales:  # Gemma 4: router.scale (h) and per_expert_scale (E)
            groups.append(ParamGroup("router scales", Poly.parse_sum("h + E"), False, "moe"))
        if model.moe_block_norms and model.norm_params:  # Gemma 4: the MoE block's own norms
            groups.append(ParamGroup("MoE block norms", Poly.parse(norm) * model.moe_block_norms, False, "moe"))
    groups += gemma4_groups(model)
    if model.cross_attention_layers:  # Mllama: MllamaTextCrossAttention's q_norm, k_norm; cross_attn_attn / mlp_gate
        groups.append(ParamGroup(CROSS_EXTRA, Poly.parse_sum("2 q /a + 2"), False, "cross"))
    if not model.is_moe or model.moe_first_dense_layers or (model.layer_pattern and model.layer_blocks["dense"]):
        prefix = "dense " if model.is_moe else ""
        groups += [
            ParamGroup(prefix + "MLP input projection weight", Poly.parse(mlp_in), True, mlp),
            ParamGroup(prefix + "MLP output projection weight", Poly.parse("h f"), True, mlp),
        ]
        if model.mlp_bias and not model.bias:  # GPT-J: fc_in's f and fc_out's h
            groups.append(ParamGroup(prefix + "MLP biases", Poly.parse_sum(("2 f" if gated else "f") + " + h"), True,
                                     mlp))
    cross = model.encoder_kind == "seq2seq"  # encoder_attn and its norm: counted, never run alone, so never trained
    groups += [ParamGroup(CROSS, Poly.parse("4 h q"), True, "layer", trained=False)] * cross
    groups += [ParamGroup(CROSS_QKV_BIAS, Poly.parse(f"{2 + model.key_bias} q"), True, "layer", trained=False),
               ParamGroup(CROSS_OUT_BIAS, Poly.parse("h"), False, "layer", trained=False)] * (cross and model.bias)
    if model.norm_params:
        groups.append(ParamGroup("layer norms", Poly.parse(norm) * (model.layer_norms - cross), False, "layer"))
        groups += [ParamGroup(CROSS_NORM, Poly.parse(norm), False, "layer", trained=False)] * cross
    if model.attention_bias and not model.bias:
        groups += [ParamGroup("QKV biases", Poly.parse_sum(f"q + {kv_bias}"), True, "layer"),
                   ParamGroup("attention output projection bias", Poly.parse("h"), False, "layer")]
    elif model.qkv_bias and not model.bias:
        groups.append(ParamGroup("QKV biases", Poly.parse_sum(f"q + {kv_bias}"), True, "layer"))
    if model.out_bias and not (model.bias or model.attention_bias):  # GPT-Neo: out_proj's bias alone
        groups.append(ParamGroup("attention output projection bias", Poly.parse("h"), False, "layer"))
    if model.bias:
        mlp_bias = "2 f" if model.mlp == "swiglu" else "f"
        groups += [
            ParamGroup("column-parallel biases (QKV, MLP input)",
                       Poly.parse_sum(f"q + {kv_bias} + {mlp_bias}"), True, "layer"),
            ParamGroup("row-parallel biases (output projection, MLP output)", Poly.parse("2 h"), False, "layer"),
        ]
    groups += embedding_groups(model)
    if model.norm_params and model.final_norm:
        groups.append(ParamGroup("final norm", Poly.parse(norm), False, "last"))
    if model.head_bias:
        groups.append(ParamGroup("output head bias", Poly.parse("v"), True, "last"))
    if model.head_transform:  # BERT: cls.predictions.transform's dense (h x e_out + e_out) and its norm
        e_out = embedding_widths(model)[1]
        groups.append(ParamGroup("output head transform", e_out * Poly.parse("h") + e_out * (
            1 + model.norm_params + model.has_norm_bias), False, "last"))
    groups += [ParamGroup(x.name, number(x.numel), False, x.scope) for x in model.extra_tensors]  # RoCBERT, X-MOD, ...
    return tuple(hybrid_groups(model, groups))


# the attention's groups: a hybrid's "attention" blocks hold them (model_groups' names)
_ATTENTION_GROUPS = ("QKV projection weight", "attention output projection weight", "latent norms", INDEXER,
                     "query / key norms", "attention sinks", GATE, "QKV biases", "attention output projection bias")


def hybrid_groups(model: ModelSpec, groups: list[ParamGroup]) -> list[ParamGroup]:
    """A hybrid's groups (ModelSpec.layer_pattern): the attention's in each attention block, the layer norms one norm
    each, and the Mamba-2 mixer's (transformers Mamba2Mixer, BambaMixer, NemotronHMamba2Mixer, FalconH1Mixer): in_proj
    h x (2 I + 2 G N + H), the depthwise conv1d (I + 2 G N) x kernel (and its bias), dt_bias, A_log and D (H each),
    the gated RMSNorm (I) and out_proj I x h, with I = H P; LFM2's short convolution (transformers Lfm2ShortConv):
    in_proj h x 3 h, the depthwise conv1d h x kernel, out_proj h x h, each with conv_bias's bias (ssm_proj_bias,
    ssm_conv_bias, ssm_out_bias); the Mamba-1 mixer's (``_mamba1``). Other models' groups are as they are."""
    if not model.layer_pattern:
        return groups
    norm = "2 h" if model.has_norm_bias else "h"
    out = [replace(g, scope="attention") if g.name in _ATTENTION_GROUPS else
           replace(g, count=Poly.parse(norm) * (1 + model.sandwich_norms), scope="norm") if g.name == "layer norms" else g
           for g in groups]  # sandwich norms: a norm after each block too
    h = model.hidden_size
    if "C" in model.layer_pattern:
        out += [ParamGroup("short convolution input projection", number(3 * h * (h + model.ssm_proj_bias)), True,
                           "conv"),
                ParamGroup("short convolution", number(h * (model.ssm_conv_kernel + model.ssm_conv_bias)), True,
                           "conv"),
                ParamGroup("short convolution output projection", number(h * (h + model.ssm_out_bias)), True, "conv")]
    out += [ParamGroup(name, number(n), split, "delta") for name, n, split in delta_counts(model)]
    out += [ParamGroup(name, number(n), split, scope) for counts, scope in (
        (rglru_counts, "rglru"), (rwkv_counts, "rwkv"), (lightning_counts, "lightning"), (mlstm_counts, "mlstm"),
        (moa_counts, "moa"))
            for name, n, split in counts(model)]
    if model.ssm_dt_rank is not None:
        return out + _mamba1(model) + (_zamba_shared(model) if "Z" in model.layer_pattern else [])
    if not any(c in model.layer_pattern for c in "SPMY"):
        return out
    out += _zamba_shared(model) if "Y" in model.layer_pattern else []
    H, i, gn = model.ssm_heads, model.ssm_heads * model.ssm_head_dim, 2 * model.ssm_groups * model.ssm_state_size
    proj = 2 * i + gn + H
    out += [ParamGroup("SSM input projection weight", number(model.hidden_size * proj + model.ssm_proj_bias * proj),
                       True, "ssm"),
            ParamGroup("SSM convolution", number((i + gn) * (model.ssm_conv_kernel + model.ssm_conv_bias)), True,
                       "ssm"),
            ParamGroup("SSM heads' dt_bias, A_log, D", number(3 * H), True, "ssm"),
            ParamGroup("SSM output projection weight", number(i * model.hidden_size), True, "ssm")]
    if model.ssm_norm:
        out.append(ParamGroup("SSM gated norm", number(i), True, "ssm"))
    if model.ssm_out_bias:
        out.append(ParamGroup("SSM output projection bias", Poly.parse("h"), False, "ssm"))
    return out


def _mamba1(model: ModelSpec) -> list[ParamGroup]:
    """A Mamba-1 mixer's groups (transformers MambaMixer, FalconMambaMixer, JambaMambaMixer; ZambaMambaMixer's per-head
    x_proj / dt_proj hold as many), I = H P wide, state N, dt rank R: in_proj h x 2 I (ssm_proj_bias: + 2 I), the
    depthwise conv1d I x kernel (+ I), x_proj I x (R + 2 N) without bias, dt_proj R x I with its I-wide bias, A_log
    I x N, D (I), out_proj I x h (ssm_out_bias: + h); Jamba's dt / B / C RMSNorms (ssm_norm) R + 2 N (Falcon-Mamba's
    are weightless buffers)."""
    h, i, n, r = model.hidden_size, model.ssm_heads * model.ssm_head_dim, model.ssm_state_size, model.ssm_dt_rank
    out = [ParamGroup("Mamba-1 input projection", number(2 * i * (h + model.ssm_proj_bias)), True, "mamba1"),
           ParamGroup("Mamba-1 convolution", number(i * (model.ssm_conv_kernel + model.ssm_conv_bias)), True,
                      "mamba1"),
           ParamGroup("Mamba-1 x_proj, dt_proj", number(i * (r + 2 * n) + r * i + i), True, "mamba1"),
           ParamGroup("Mamba-1 A_log, D", number(i * (n + 1)), True, "mamba1"),
           ParamGroup("Mamba-1 output projection weight", number(i * h), True, "mamba1")]
    if model.ssm_norm:
        out.append(ParamGroup("Mamba-1 dt / B / C norms", number(r + 2 * n), False, "mamba1"))
    if model.ssm_out_bias:
        out.append(ParamGroup("Mamba-1 output projection bias", Poly.parse("h"), False, "mamba1"))
    return out


ZAMBA_SHARED = ("Zamba shared block's attention", "Zamba shared block's MLP", "Zamba shared block's norms")


def _zamba_shared(model: ModelSpec) -> list[ParamGroup]:
    """Zamba's shared transformer block (transformers ZambaAttentionDecoderLayer, tied across its uses: held once, on
    the first stage) over the concatenated [x, embedding] input 2 h wide: a norm 2 h wide, q 2 h x a d, k and v
    2 h x g d, o a d x h, a norm h wide, a gated MLP 3 h f; each use (layer_pattern Z) its own h x h linear. A Z
    layer's size (layer_params: what ZeRO-3 gathers to run it) counts the block too (Zamba 2's: the one block it uses
    and its own adapters, the modules its forward calls). Zamba 2 (Zamba2AttentionDecoderLayer, layer_pattern Y):
    shared_blocks blocks, used in turn, and each use's LoRA adapters of rank r (held by the block it uses, one per use
    in all): on the MLP's gate_up h x r + r x 2 f, and with shared_attention_adapter on q, k and v 2 h x r + r x 2 h
    each (their output is attention_hidden_size = 2 h wide whatever k / v's width)."""
    h, d, a = model.hidden_size, model.head_dim or 2 * model.hidden_size // model.num_attention_heads, \
        model.num_attention_heads
    g, r = model.num_kv_heads or a, model.shared_adapter_rank
    m = min(model.shared_blocks, model.layer_pattern.count("Y")) if "Y" in model.layer_pattern else 1  # blocks built
    attention, mlp, norms = ZAMBA_SHARED
    adapters = r * (h + 2 * model.ffn_hidden_size) + model.shared_attention_adapter * 3 * r * 4 * h
    block = [2 * h * (a + 2 * g) * d + a * d * h, 3 * h * model.ffn_hidden_size, 3 * h]
    return [ParamGroup(attention, number(block[0]), True, "first"), ParamGroup(mlp, number(block[1]), True, "first"),
            ParamGroup(norms, number(block[2]), False, "first"),
            ParamGroup("Zamba shared block's output linear", number(h * h), True, "shared")] + (
        [ParamGroup("Zamba 2 shared block's per-use adapters", number(adapters), True, "shared")] if r else []) + (
        [ParamGroup("Zamba 2's other shared blocks", number((m - 1) * (block[0] + block[1])), True, "first"),
         ParamGroup("Zamba 2's other shared blocks' norms", number((m - 1) * block[2]), False, "first")]
        if m > 1 else [])


def attention_params(model: ModelSpec, head_dim: int, kv_heads: int, k_eq_v: bool) -> tuple[int, int]:
    """One layer's attention parameters with heads head_dim wide (V value_head_dim wide where set) and kv_heads K / V
    heads: (Q, output projection and query norm; K, V projections and key norm), biases included (transformers
    Gemma4TextAttention, MiMoV2FlashAttention)."""
    h, a, qk = model.hidden_size, model.num_attention_heads, int(model.qk_norm and model.norm_params)
    bias, dv = model.attention_bias or model.qkv_bias or model.bias, model.value_head_dim or head_dim
    q = h * a * (head_dim + dv) + qk * head_dim + bias * a * head_dim + (model.attention_bias or model.bias) * h
    kv = kv_heads * (head_dim + (not k_eq_v) * dv) * (h + bias) + qk * head_dim
    return q, kv


def gemma4_groups(model: ModelSpec) -> list[ParamGroup]:
    """Gemma 4's parameters beyond a sliding layer's (transformers Gemma4TextModel / Gemma4TextDecoderLayer): each
    full-attention layer's attention with its own head width and K / V heads (keys as values: no v_proj), each K /
    V-sharing layer without k_proj, v_proj and k_norm (and its MLP 2f wide with kv_shared_double_mlp), and the
    per-layer inputs: embed_tokens_per_layer (per_layer_input_vocab x L p), per_layer_model_projection (h x L p)
    and per_layer_projection_norm (p) on the first stage, per_layer_input_gate (h x p), per_layer_projection
    (p x h) and post_per_layer_input_norm (h) in each layer. A model without them gets none."""
    groups = []
    hd = model.head_dim or model.hidden_size // model.num_attention_heads
    base_q, base_kv = attention_params(model, hd, model.g, False)
    full = (model.full_attention_head_dim or hd, model.full_attention_kv_heads or model.g, model.full_attention_k_eq_v)
    full_q, full_kv = attention_params(model, *full)
    delta = full_q + full_kv - base_q - base_kv - model.num_attention_heads * model.sinks_sliding_only  # MiMo: no sinks
    if model.full_layers and delta:
        groups.append(ParamGroup("full-attention layers' attention (beyond a sliding layer's)", number(delta), True,
                                 "full"))
    if model.kv_shared_layers:
        mlp = (3 if model.mlp == "swiglu" else 2) * model.hidden_size * model.f * model.kv_shared_double_mlp
        for scope, kv in (("kv_shared", base_kv), ("kv_shared_full", full_kv)):
            groups.append(ParamGroup(f"K / V-sharing {'full-attention' if scope.endswith('full') else 'sliding'} "
                                     "layers (no K / V of their own" + (", MLP 2f wide)" if mlp else ")"),
                                     number(mlp - kv), True, scope))
    p = model.per_layer_input_size
    if p:
        Lp, rows = model.num_layers * p, model.per_layer_input_vocab or model.vocab_size
        groups += [ParamGroup("per-layer input embedding", number(rows * Lp), True, "first"),
                   ParamGroup("per-layer input projection", number(model.hidden_size * Lp), True, "first"),
                   ParamGroup("per-layer input gate / projection", Poly.parse(f"{2 * p} h"), True, "layer")]
        if model.norm_params:
            groups += [ParamGroup("per-layer input norms", number(p), False, "first"),
                       ParamGroup("per-layer input layer norm", Poly.parse("h"), False, "layer")]
    return groups


def gate_rows(model: ModelSpec) -> Poly:
    """The rows of the gate on the attention output: one per channel (q) or per head (a)."""
    return Poly.parse("q" if model.attention_output_gate == "full" else "a")


def layer_vectors(model: ModelSpec) -> list[tuple[str, str, Poly]]:
    """A layer's small parameters beside its linears and norms, whole on every GPU (group, tensor, count): DiffLlama's
    four lambda vectors head_dim wide, the learned scalars of the MLP's activation (Apertus's xIELU), BitNet's norms
    inside the attention (h) and the MLP (f), Doge's dynamic mask (A: g; dt_proj: q g / a x g, its bias g with
    attention_bias) and residual scales (input_residual, post_attention_residual: 2 h)."""
    lambdas = [("differential attention lambdas", "lambda_q1 / k1 / q2 / k2", Poly.parse("4 q /a"))]
    scalars = [("activation scalars", "activation scalars", Poly.parse(str(model.activation_params)))]
    subs = [("sub-layer norms", "attention / MLP sub-norm weight", Poly.parse_sum("h + f") *
             (2 if model.has_norm_bias else 1))]
    doge = [("dynamic mask and residual scales", "A, dt_proj, input_residual, post_attention_residual",
             Poly.parse_sum(f"{1 + (model.attention_bias or model.bias)} g + q g^2 /a + 2 h"))]
    return (lambdas * model.differential_attention + scalars * (model.activation_params > 0) + subs * model.sub_norms
            + doge * model.dynamic_mask)


def output_layer_group(model: ModelSpec) -> ParamGroup:
    """The output projection v x h (v x e_out, embedding_widths): its own weight when untied; with tied embeddings the
    last stage still keeps a copy when p > 1 (Megatron-LM synchronises the two copies)."""
    return ParamGroup(OUTPUT_LAYER_W, Poly.parse("v") * embedding_widths(model)[1], True, "last")


Count = Callable[[ParamGroup], Any]  # a group's parameters on one GPU for the plan at hand


def counter(values: Mapping[str, Any]) -> Count:
    """Count each group's parameters with the symbols `values` (scalars or arrays)."""
    return lambda group: group.per_gpu(values)


def mla_qkv_count(model: ModelSpec) -> Poly:
    """Multi-head latent attention's Q, K and V projections (transformers DeepseekV3Attention, Megatron-LM
    MLASelfAttention): Q through the r_q latent, q_a_proj h r_q + q_b_proj r_q a (d_n + d_r), or directly
    h a (d_n + d_r), or with mla_query_gate q_gate_proj 2 r_q a (d_n + d_r + d_v); kv_a_proj_with_mqa h (r_kv + d_r);
    kv_b_proj r_kv a (d_n + d_v). The output projection is q h with q = a d_v."""
    q = "h rq + a dn rq + a dr rq" if model.q_lora_rank else "a dn h + a dr h"
    q = "h rq + 2 a dn rq + 2 a dr rq + 2 a dv rq" if model.mla_query_gate else q  # A.X-K2: q_gate_proj 2 r_q wide
    return Poly.parse_sum(q + " + h rkv + h dr + a dn rkv + a dv rkv")


def layer_kinds(model: ModelSpec, layers: Any, is_first: Any, is_last: Any = 0, dense: Any = None) -> dict[str, Any]:
    """How many of a stage's `layers` layers each layer scope's groups are in: every layer ("layer"), the
    dense layers of an MoE model ("dense": the first moe_first_dense_layers, all on the first stage, as
    Config checks, or `dense` of them: a multi-stage schedule's rank, PlanValues.dense_layers) and its MoE layers
    ("moe": the others); Gemma 4's full-attention layers ("full": the
    stage's share of them, exact for the whole model, derived for a stage; Mllama's cross-attention layers, "cross",
    the same) and K / V-sharing layers (the last kv_shared_layers, all on the last stage)."""
    if model.layer_pattern:  # a hybrid: the stage's share of each block (exact for the whole model, derived per stage)
        return {"layer": layers, **{k: layers * n // model.num_layers for k, n in model.layer_blocks.items()}}
    dense = model.moe_first_dense_layers * is_first if dense is None else dense
    shared_full = model.kv_shared_full_layers * is_last
    return {"layer": layers, "moe": layers - dense, "dense": dense, "full": layers * model.full_layers //
            model.num_layers, "kv_shared": model.kv_shared_layers * is_last - shared_full,
            "kv_shared_full": shared_full, "cross": layers * model.cross_attention_layers // model.num_layers}


def block_share(model: ModelSpec, per_scope: Mapping[str, Any]) -> Any:
    """A hybrid layer's average of amounts per block scope (``per_scope``: one block's each), over its pattern."""
    return sum(per_scope[k] * n / model.num_layers for k, n in model.layer_blocks.items())


def stage_params(model: ModelSpec, count: Count, layers: Any, is_first: Any, is_last: Any, p: Any,
                 dense: Any = None) -> Any:
    """Parameters held by one GPU of a stage with `layers` layers (scalars or arrays; `dense`: its dense first
    layers where not all on the first stage, `layer_kinds`)."""
    total: Any = 0
    weights = {**layer_kinds(model, layers, is_first, is_last, dense), "first": is_first, "last": is_last}
    for group in param_groups(model):
        total = total + count(group) * weights[group.scope]
    head_copy = 1 if not model.tied_embeddings else (p > 1)
    return total + (count(output_layer_group(model)) * head_copy + mtp_stage_params(model, count)) * is_last


def mtp_stage_params(model: ModelSpec, count: Count) -> Any:
    """The multi-token-prediction modules' own parameters on one GPU of the last stage (megatron-core
    multi_token_prediction.py MultiTokenPredictionLayer: enorm, hnorm, the final norm (h each), eh_proj (2h x h,
    column-parallel) and one transformer layer, an MoE one in an MoE model; the embedding and output head are the
    main model's, shared). Not in total_params: DeepSeek-V3's published 671 B excludes its MTP module. torchtitan's
    DeepSeek-V3 (``mla_down_replicated``: its sharding config) keeps eh_proj whole on every TP rank (measured over gloo:
    tests/test_titan_mtp_tp.py). The norms are counted as a group (``count``), so that a count of the routed experts
    only (stage.py's expert states) leaves them out."""
    if not model.mtp_layers:
        return 0
    layer = sum(count(g) for g in param_groups(model) if g.scope in ("layer", "moe" if model.is_moe else "layer"))
    eh_proj = Poly.parse("2 h h")
    own = (count(ParamGroup("MTP eh_proj", eh_proj, True, "last", whole=eh_proj if model.mla_down_replicated else None))
           + count(ParamGroup("MTP norms", Poly.parse("3 h"), False, "last")))
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
    # Gemma 4: a full-attention layer's own; Mllama: a cross-attention layer's
    full = sum((count(g) for g in param_groups(model) if g.scope in ("full", "cross")), 0)
    if model.layer_pattern:  # a hybrid: its largest layer, block by block (LAYER_BLOCKS)
        block = {scope: sum((count(g) for g in param_groups(model) if g.scope == scope or
                             scope == "shared" and g.name in ZAMBA_SHARED), 0)  # the shared block, gathered per use
                 for scope in (*HYBRID_SCOPES, "moe", "dense")}
        sizes = [sum(block["moe" if b == "ffn" and model.is_moe else "dense" if b == "ffn" else b] for b in blocks)
                 for blocks in (LAYER_BLOCKS[c] for c in set(model.layer_pattern))]
        largest = sizes[0]
        for size in sizes[1:]:  # scalars or arrays (a plan's t)
            largest = largest + (size - largest) * (size > largest)
        return total + largest
    return total + moe + (dense - moe) * (dense > moe) + full * (full > 0)


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


@dataclass(frozen=True)
class StateBytes:
    weights: Any
    gradients: Any
    optimizer: Any  # master weights + optimizer moments

    @property
    def total(self) -> Any:
        return self.weights + self.gradients + self.optimizer


def state_bytes(params: Any, training: TrainingSpec, d: Any, zero: Any, gathered_params: Any = 0,
                optimizer_unsharded: Any = None, trained: Any = None) -> StateBytes:
    """Weights, gradients and optimizer bytes for `params` parameters on one GPU, the ZeRO-sharded
    parts split over `d` ranks (the data-parallel size, or the shard group with HSDP).

    `gathered_params` is the transient full copy ZeRO-3 gathers (one layer) during compute;
    `optimizer_unsharded` the master weights + optimizer states before sharding (`optimizer_bytes`;
    default: a full-size copy per moment, as AdamW and SGD keep); `trained`: of `params`, those with gradients and
    states (default all; ParamGroup.trained)."""
    trained = params if trained is None else trained
    if optimizer_unsharded is None:
        optimizer_unsharded = optimizer_bytes(training, trained)
    z = zero
    weights = shard_bytes(params * sharded_weight_bytes(training), d, z >= 3) + (z >= 3) * gathered_params * training.weight_bytes
    gradients = shard_bytes(trained * training.grad_bytes, d, z >= 2)
    optimizer = shard_bytes(optimizer_unsharded, d, z >= 1)
    return StateBytes(weights, gradients, optimizer)
