"""FLOPs of a model and a plan (K22 appendix A, generalised): a layer's weight matmuls and attention
core, the logits, model FLOPs (what MFU counts, K22 Eq. 7) and hardware FLOPs (with recomputation); also what a
layer's kernels execute (attention_time_flops: a causal flash kernel skips half the square) and how many GEMM
kernels it launches (gemms_per_layer).

Mixture of experts: a layer's FLOPs are its active parameters' (the k routed experts, the shared ones and
the router: layer_matmul_flops), its elementwise bytes those of the k f_e + f_s wide MLP a token goes
through; the experts' grouped GEMMs are charged as dense GEMMs at matmul_efficiency (routing, token
permutation and load imbalance are not modelled, nor measured)."""

from __future__ import annotations

from typing import Any, Optional

from memplan.core.model import ModelSpec
from memplan.core.training import Recompute
from memplan.inventory import budget_recompute
from memplan.memory.states import mla_qkv_count
from memplan.memory.term_bytes import PlanValues
from memplan.timing.arrays import as_float64

# A causal flash kernel skips the score blocks above the diagonal: it executes about half of the
# full-square 4bs^2h attention FLOPs (FlashAttention-2, Dao 2023, section 3.1.1 "causal masking").
CAUSAL_FLASH_FRACTION = 0.5
# The model FLOPs MFU counts take the causal mask's half of the square too (causal=True: Megatron-LM's
# num_floating_point_operations halves the attention term for it; FlashAttention-2's own utilisation figures
# do the same). K22 Eq. 7 counts the full square (causal=False): against a causal kernel's time it gives
# MFU above 100 % at long s (a 128K-token search showed 115.8 %).
CAUSAL_ATTENTION_FRACTION = 0.5


def attention_time_flops(model: ModelSpec) -> float:
    """The attention-core FLOPs one sequence's forward executes: the full square 4s^2h for the
    unfused kernels (the causal mask is applied after QK^T), about half of it for a causal flash
    kernel (CAUSAL_FLASH_FRACTION)."""
    full = layer_attention_flops(model)
    return full * CAUSAL_FLASH_FRACTION if model.attention == "flash" else full


def gemms_per_layer(model: ModelSpec, impl: str = "megatron") -> int:
    """Weight-GEMM kernels in one layer's forward (the backward runs two per forward GEMM, dgrad and
    wgrad): Megatron-LM and the reference torch layer fuse Q, K, V into one GEMM (and SwiGLU's gate
    and up into linear_fc1): QKV, projection, fc1, fc2. transformers' Llama layer runs q, k, v, o,
    gate, up and down separately (GPT-2's c_attn is fused); torchtitan 0.3.0's Llama 3 fuses Q, K, V (wqkv) only."""
    if impl in ("megatron", "torch") or model.mlp != "swiglu":
        return 4
    if impl == "torchtitan" and not model.is_moe:  # its Llama 3 block: wqkv (fused), wo, w1, w3, w2
        return 5
    if model.is_moe:  # q, k, v, o; the router and the experts' two grouped GEMMs; the shared experts' three
        return 7 + 3 * (model.moe_shared_ffn_hidden_size > 0)
    return 7


# --- FLOPs (K22 appendix A, generalised) ------------------------------------------------------
def active_ffn_width(model: ModelSpec) -> float:
    """The MLP width one token goes through, averaged over the layers: f in a dense layer; k f_e + f_s in a
    mixture-of-experts layer (its k routed experts and the shared ones, not the E - k others)."""
    if not model.is_moe:
        return float(model.f)
    moe = model.moe_top_k * model.fe + model.moe_shared_ffn_hidden_size
    return (model.moe_layers * moe + model.moe_first_dense_layers * model.f) / model.num_layers


def layer_matmul_flops(model: ModelSpec) -> float:
    """Forward FLOPs of one layer's weight matmuls for one sequence (no t split), with the attention
    width q = a x head_dim (h unless head_dim says otherwise): QKV 2sh(q + 2qg/a) + projection
    2sqh + MLP 2*2shf (GeLU) or 3*2shf (SwiGLU). K22 (q = h, g = a, f = 4h): 24sh^2.

    A mixture-of-experts layer counts its ACTIVE parameters: the k routed experts a token goes through and
    the shared experts, 3*2sh(k f_e + f_s) (SwiGLU), and the router 2shE, not the E - k other experts
    (Megatron-LM megatron/training/training.py `num_floating_point_operations`: the routed-experts term
    is moe_ffn_hidden_size x moe_router_topk x the gated factor, the shared experts' term
    moe_shared_expert_intermediate_size, per MoE layer; it leaves out the router's 2shE, which memplan
    keeps). With dense layers first the figure is the mean over the layers (L times it is the model's)."""
    s, h, q, a, g = (float(x) for x in (model.seq_length, model.hidden_size, model.q, model.num_attention_heads,
                                         model.g))
    mlp_matrices = 3 if model.mlp == "swiglu" else 2
    router = 2 * s * h * model.num_experts * model.moe_layers / model.num_layers if model.is_moe else 0.0
    qkv = 2 * s * h * (q + 2 * q * g / a)
    if model.is_mla:  # its latent projections: 2 FLOPs per weight and token (states.mla_qkv_count)
        qkv = 2 * s * float(mla_qkv_count(model).evaluate(model.symbols()))
    return qkv + 2 * s * q * h + mlp_matrices * 2 * s * h * active_ffn_width(model) + router


def titan_selective_flops(model: ModelSpec) -> float:
    """The matmul FLOPs per sequence torchtitan's per-op selective AC re-runs in a layer's backward: its policy saves
    every other matmul of the block (wqkv, w1, w2) and recomputes wo (2sqh) and w3 (2shf) (memplan/timing/layer.py
    _titan_selective), no t split."""
    s, h = float(model.seq_length), float(model.hidden_size)
    return 2 * s * float(model.q) * h + 2 * s * h * active_ffn_width(model)


def layer_attention_flops(model: ModelSpec) -> float:
    """Forward FLOPs of QK^T and attention over V for one sequence: 4s^2q, 4s^2h in K22 (appendix A);
    multi-head latent attention 2s^2 a (d_n + d_r) + 2s^2 a d_v (its queries and keys are d_n + d_r wide, its
    values d_v; Megatron-LM's num_floating_point_operations counts the same, halved for the causal mask)."""
    s, q = float(model.seq_length), float(model.q)
    if model.is_mla:
        a = float(model.num_attention_heads)
        return 2 * s * s * a * (model.qk_nope_head_dim + model.qk_rope_head_dim + model.v_head_dim)
    return 4 * s * s * q


def logits_flops(model: ModelSpec) -> float:
    """Forward FLOPs of the output layer for one sequence: 2shv (K22 appendix A)."""
    return 2.0 * model.seq_length * model.hidden_size * model.vocab_size


def mtp_flops(model: ModelSpec, causal: bool = False) -> tuple[float, float]:
    """Forward FLOPs of the model's multi-token-prediction layers for one sequence (model.mtp_layers: torchtitan's
    MTPTransformerBlock, megatron-core's MultiTokenPredictionLayer), as (weight matmuls, attention core): each layer's
    eh_proj 2s(2h)h, its transformer block's matmuls (an MoE layer in an MoE model: DeepSeek-V3 copies its last
    layer's) and the shared output head's 2shv; its attention core as a layer's (halved with `causal`). Not
    recomputed: torchtitan's AC wraps model.layers only. Derived (tests/test_titan_mtp.py counts it by hand)."""
    n = model.mtp_layers
    if not n:
        return 0.0, 0.0
    block = model.model_copy(update={"moe_first_dense_layers": 0}) if model.is_moe else model  # an MoE layer's
    s, h = float(model.seq_length), float(model.hidden_size)
    matmuls = layer_matmul_flops(block) + 2 * s * 2 * h * h + logits_flops(model)
    return n * matmuls, n * layer_attention_flops(model) * (CAUSAL_ATTENTION_FRACTION if causal else 1.0)


def model_flops(model: ModelSpec, global_batch: Any, causal: bool = False) -> Any:
    """Model FLOPs of one step, 3 x forward (backward = 2 x forward), the MTP layers' (mtp_flops) included. For a
    K22 GPT (f = 4h, g = a) this is 72 B L s h^2 (1 + s/(6h) + v/(12hL)), K22 Eq. 7; with `causal`, the attention
    square counted as the causal mask leaves it, half (CAUSAL_ATTENTION_FRACTION): 72 B L s h^2
    (1 + s/(12h) + v/(12hL)), what MFU counts."""
    return model_flops_per_sequence(model, causal) * as_float64(global_batch)


def model_flops_per_sequence(model: ModelSpec, causal: bool = False) -> float:
    attention = layer_attention_flops(model) * (CAUSAL_ATTENTION_FRACTION if causal else 1.0)
    forward = model.num_layers * (layer_matmul_flops(model) + attention) + logits_flops(model) + sum(
        mtp_flops(model, causal))
    return 3.0 * forward


def hardware_flops(model: ModelSpec, plan: PlanValues, global_batch: Any, impl: str = "megatron",
                   budget: Optional[float] = None) -> Any:
    """Model FLOPs plus recomputation: selective re-runs the attention matmuls (4Bs^2h per layer,
    K22 section 5), full re-runs the layer's forward. (K22 Eq. 8 prints 1 + s/(3h) for selective;
    the 4Bs^2h per layer described in its text gives 1 + s/(6h) + s/(18h) instead.) torchtitan's selective-op AC
    re-runs wo and w3 instead (titan_selective_flops); its memory-budget AC at `budget` what the partitioner re-runs
    in every layer (memplan/inventory/budget_recompute.py: traced)."""
    # Recomputed layers per chunk x p m chunks, per sequence.
    layers = as_float64(plan.recomputed_layers)
    selective = as_float64(plan.recompute == Recompute.SELECTIVE) * layers
    full = as_float64(plan.recompute == Recompute.FULL) * layers
    attention = layer_attention_flops(model)
    recomputed = titan_selective_flops(model) if impl == "torchtitan" else attention
    extra = as_float64(plan.p * plan.m) * (selective * recomputed + full * (layer_matmul_flops(model) + attention))
    if budget is not None:
        r = budget_recompute.recompute(model, budget)
        extra = extra + model.num_layers * (r["matmul_flops"] * float(model.seq_length) + r["attention"] * attention)
    return model_flops(model, global_batch) + extra * as_float64(global_batch)
