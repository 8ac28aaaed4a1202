"""The backward moments of torchtitan's compiled dense Qwen3 block (``compiled_qwen3_moments``; wired in by
memplan/inventory/compiled.py ``apply``): what Inductor's generated backward holds at each of its non-dominated
moments, under AC none, full and selective-op, as memplan/inventory/compiled_moments.py has them for Llama 3's block
(its assembly, FSDP2's terms and Llama's transients reused; these tables and Qwen3's own transients here).

Measured: validation/compiled_backward.py ``qwen3`` compiles torchtitan 0.3.0's dense Qwen3 block (q_norm, k_norm,
CosSinRoPE; validation/titan.py build_block) as its apply_compile does (after the AC wrapper), with torch 2.13's
Inductor on CPU (dynamic s, b), at two widths (h 40, a 6, g 2, d 8, f 154; h 64, a 8, g 4, d 12, f 224: q = a d
differs from h in both), the block called with the dataloader's positions, replays the generated backward under
FakeTensorMode with s, b symbolic (the saved cos and sin rows, two views of one gathered storage, made as one) and
runs it on real tensors under torch.profiler at s 32, b 2 and s 64, b 3 (tests/data/titan_compiled_backward_qwen3.json,
tests/test_compiled_qwen3.py).

What differs from Llama 3's moments (per token of s b): the first two AC none moments (SwiGLU's backward, w3's input
gradient) are Llama's own; the attention's moment is the q / k norms' and RoPE's fused backward (dQ and dK as fp32
pairs, 4q and 4 g d, the fused QKV output's gradient and k_norm's per-head sums beside sdpa's dQ, dK, dV), the RoPE rows
freed after it; q_norm's and k_norm's inputs and rstd are kept until their weight-gradient kernel, which comes after
wo's weight-gradient GEMM (their partial sums, fp32 2d, and weight gradients, bf16 2d).

Derived, not measured: FSDP2's unsharded weight gradients and the previous layer's held reduce-scatter input (as for
Llama 3's block); CUDA: triton fuses differently from the C++ backend and FlexAttention's backward replaces sdpa's.
"""

from __future__ import annotations

import dataclasses

from memplan.core.model import ModelSpec
from memplan.core.training import Recompute
from memplan.inventory import compiled_moments as llama
from memplan.inventory.compiled_qwen3 import QK_IDS
from memplan.inventory.titan_moments import weight_grads
from memplan.inventory.types import Moment, Term, transient

MOMENTS_SRC = ("measured: torchtitan 0.3.0's dense Qwen3 block compiled by torch 2.13's Inductor on CPU, its generated "
               "backward replayed with s, b symbolic and run under torch.profiler at two shapes and two widths "
               "(validation/compiled_backward.py qwen3, tests/test_compiled_qwen3.py); FSDP2 and CUDA (triton's "
               "fusion, FlexAttention) derived")
QK = QK_IDS[:4]  # q_norm / k_norm's saves (the RoPE rows are compiled_moments' rope_rows)
ALL = llama.TITAN_IDS + llama.SAC_ONLY + QK


def _freed(*keep: str) -> tuple[str, ...]:
    """Every saved id but ``keep``."""
    return tuple(i for i in ALL if i not in keep)


# (moment id, what, freed ids, transients): the non-dominated samples of the replay (compiled_moments' tables' form;
# the first two AC none moments are Llama 3's own), per AC mode, each buffer named by the tensor it holds then (traced
# at g 2 and 4: with one KV head, g 1, k_norm's per-head fp32 buffers have the norms' rstd size and Inductor reuses
# them otherwise, 4 B per token either way; Qwen3's models have g 4 or 8)
_GRADS = "norm_rowsum grad_attn_residual grad_q_fp32 grad_qkv_out grad_k_fp32 grad_norm_out grad_norms grad_ffn"
_ROPE_BACKWARD = "grad_q grad_kv grad_q_fp32 grad_k_fp32 grad_qkv_out k_norm_stat grad_ffn"
_WQKV = ("wqkv_weight_grad", "the fused QKV's weight-gradient GEMM", _freed("layer_input", "ln1_rstd", "qkv_input"),
         "norm_rowsum grad_attn_residual grad_qkv_out grad_norm_out grad_norms grad_ffn grad_wo grad_qk_norms grad_wqkv")
NONE = llama.NONE[:2] + (
    ("attention", "the q / k norms' and RoPE's fused backward", ("q", "k", "v", "sdpa_logsumexp") + llama.FFN
     + llama.SAC_ONLY, f"grad_mlp_inputs norm_rowsum grad_attn_residual {_ROPE_BACKWARD}"),
    ("norm_weight_grads", "the norms' weight-gradient kernel", llama.ATTENTION + llama.FFN + llama.SAC_ONLY,
     "grad_mlp_inputs norm_rowsum grad_attn_residual grad_q_fp32 grad_qkv_out grad_k_fp32 grad_norm_out "
     "norm_partials grad_norms grad_ffn"),
    ("wo_weight_grad", "wo's weight-gradient GEMM", _freed("layer_input", "ln1_rstd", "qkv_input", "attn_out", *QK),
     f"{_GRADS} grad_wo"),
    ("qk_norm_weight_grads", "q_norm's and k_norm's weight-gradient kernel",
     _freed("layer_input", "ln1_rstd", "qkv_input", *QK), f"{_GRADS} grad_wo qk_partials grad_qk_norms"),
    _WQKV,
)
# full: the forward recomputed (q_norm's and k_norm's inputs views of the recomputed QKV output, the RoPE rows
# recomputed inside the fused kernels), then as none from the attention's backward on, the QKV output's copy held
_ATTN = ("layer_input", "ln1_rstd", "qkv_input", "q_norm_rstd", "k_norm_rstd", "attn_out")
FULL = (
    ("swiglu", "SwiGLU's fused silu / mul backward (the forward recomputed)",
     ("q_norm_input", "k_norm_input", "rope_rows") + llama.SAC_ONLY, "dy qkv_rerun grad_w2_input grad_swiglu_2"),
    ("w2_weight_grad", "w2's weight-gradient GEMM", ("q_norm_input", "k_norm_input", "rope_rows", "silu_input",
                                                     "up_out") + llama.SAC_ONLY, "dy qkv_rerun grad_swiglu_2 grad_w2"),
    ("w3_input_grad", "w3's input gradient GEMM", ("q_norm_input", "k_norm_input", "rope_rows", "silu_input",
                                                   "up_out", "fc2_input") + llama.SAC_ONLY,
     "dy qkv_rerun grad_swiglu_2 grad_mlp_input grad_w2_w3"),
    ("attention", "the q / k norms' and RoPE's fused backward (RoPE recomputed in it)", _freed(*_ATTN, "o_proj_out"),
     f"qkv_rerun grad_mlp_inputs norm_rowsum grad_attn_residual {_ROPE_BACKWARD}"),
    ("norm_weight_grads", "the norms' weight-gradient kernel", _freed(*_ATTN, "o_proj_out"),
     "qkv_rerun grad_mlp_inputs norm_rowsum grad_attn_residual grad_q_fp32 grad_qkv_out grad_k_fp32 grad_norm_out "
     "norm_partials grad_norms grad_ffn"),
    ("wo_weight_grad", "wo's weight-gradient GEMM", _freed(*_ATTN), f"qkv_rerun {_GRADS} grad_wo"),
    ("qk_norm_weight_grads", "q_norm's and k_norm's weight-gradient kernel", _freed(*_ATTN[:-1]),
     f"qkv_rerun {_GRADS} grad_wo qk_partials grad_qk_norms"),
    _WQKV,
)
# selective-op: wo, ffn_norm, w3 and SwiGLU recomputed before SwiGLU's backward; attention_norm, q_norm, k_norm and
# RoPE before the attention's (its saved output and log-sum-exp, the fused QKV output kept)
_SAC = ("layer_input", "qkv_out", "attn_out", "o_proj_out", "ln2_rstd")
_SAC_GRADS = "grad_attn_residual grad_q_fp32 grad_k_fp32 grad_qkv_out grad_norm_out grad_norms grad_ffn grad_wo"
SELECTIVE = (
    ("swiglu", "SwiGLU's fused silu / mul backward (wo, ffn_norm, w3 recomputed)",
     _freed(*_SAC, "sdpa_logsumexp", "silu_input", "mlp_input", "up_out", "fc2_input"),
     "dy grad_w2_input grad_swiglu_2"),
    ("w2_weight_grad", "w2's weight-gradient GEMM", _freed(*_SAC, "sdpa_logsumexp", "mlp_input", "fc2_input"),
     "dy grad_swiglu_2 grad_w2"),
    ("attention", "sdpa's backward (attention_norm, q_norm, k_norm and RoPE recomputed: q, k as fp32 pairs)",
     _freed(*_SAC, "q_norm_rstd", "q_norm_input", "q", "k", "v", "sdpa_logsumexp"),
     "grad_mlp_inputs norm_rowsum grad_attn_residual q_fp32 k_fp32 k_norm_stat grad_q grad_kv grad_ffn"),
    ("norm_weight_grads", "the norms' weight-gradient kernel",
     _freed(*_SAC, "mlp_input", "ln1_rstd", "qkv_input", "q_norm_rstd", "k_norm_rstd"),
     "grad_mlp_inputs norm_rowsum grad_attn_residual grad_q_fp32 grad_k_fp32 grad_qkv_out grad_norm_out "
     "norm_partials grad_norms grad_ffn"),
    ("wo_weight_grad", "wo's weight-gradient GEMM", _freed("qkv_out", "attn_out", "q_norm_rstd", "k_norm_rstd",
                                                           "qkv_input"), _SAC_GRADS),
    ("qk_norm_weight_grads", "q_norm's and k_norm's weight-gradient kernel",
     _freed("qkv_out", "q_norm_rstd", "k_norm_rstd"), f"{_SAC_GRADS} qk_partials grad_qk_norms"),
    ("wqkv_weight_grad", "the fused QKV's weight-gradient GEMM", ALL,
     "grad_attn_residual grad_qkv_out grad_norm_out grad_norms grad_ffn grad_wo grad_qk_norms grad_wqkv"),
)
MODES = {Recompute.NONE: NONE, Recompute.FULL: FULL, Recompute.SELECTIVE: SELECTIVE}


def _made(model: ModelSpec) -> dict[str, Term]:
    """The transients of QWEN3's moments that Llama 3's block has not (compiled_moments._transients has the rest)."""
    d = model.q // model.num_attention_heads
    kv = model.g * d

    def t(id, name, elements, dtype="act", storages=1):
        return transient(id, name, elements, dtype, tp=False, src=MOMENTS_SRC, storages=storages)

    return {"grad_k_fp32": t("grad_k_fp32", "dK as fp32 (RoPE's backward)", f"{kv} s b", "fp32"),
            "k_norm_stat": t("k_norm_stat", "k_norm's per-head statistic (fp32)", f"{model.g} s b", "fp32"),
            "qk_partials": t("qk_partials", "q_norm's and k_norm's weight-gradient partial sums (fp32)", f"{2 * d}",
                             "fp32", storages=2),
            "grad_qk_norms": dataclasses.replace(weight_grads("grad_qk_norm_weights", "q_norm's and k_norm's weight "
                                                              "gradients", f"{2 * d}", tp=False), source=MOMENTS_SRC)}


def compiled_qwen3_moments(model: ModelSpec, recompute: Recompute, recompute_layers: bool,
                           ids: tuple[str, ...]) -> tuple[Moment, ...]:
    """The compiled dense Qwen3 block's backward moments (MODES), each with the previous layer's held reduce-scatter
    input, and FSDP2's reduce-scatter moment (compiled_moments.compiled_titan_moments)."""
    d = model.q // model.num_attention_heads
    return llama.compiled_titan_moments(model, recompute, recompute_layers, ids, MODES, _made(model), 2 * d,
                                        MOMENTS_SRC)

