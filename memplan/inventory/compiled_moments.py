"""The backward moments of torchtitan's compiled Llama 3 block (``compiled_titan_moments``; wired in by
memplan/inventory/compiled.py ``apply``): what Inductor's generated backward holds at each of its non-dominated
moments, under AC none, full and selective-op.

Measured: validation/compiled_backward.py compiles torchtitan 0.3.0's block as its apply_compile does (after the AC
wrapper), with torch 2.13's Inductor on CPU (dynamic s, b), at two widths (h 48, a 6, g 2, f 154; h 64, a 4, g 1,
f 224: the same moments on the front at both), the block called with the dataloader's positions as torchtitan's
Trainer calls it (validation/titan.py ``loader_positions``, made before the measured window: the training loop holds
them), and

* replays the generated backward's own ``call`` (its buffers allocated by ``empty_strided_cpu``, reused through
  ``reinterpret_tensor``, freed by ``del``; kernels no-ops) under FakeTensorMode with s and b symbolic: after every
  kernel, GEMM and fallback op, what is alive as a s b + d s + c bytes (d is 0 in every mode: the RoPE rows are
  gathered per sample); the non-dominated samples are the moments below, each buffer named here by the tensor it
  holds at that moment (Inductor reuses a freed buffer for another tensor of its size);
* runs it on real tensors under torch.profiler's allocation events at two shapes: the measured peak, the CPU kernels'
  own scratch left out (oneDNN's bf16 GEMMs, sdpa's CPU backward: allocated and freed inside one aten op), equals the
  replay's byte for byte (tests/data/titan_compiled_backward.json, tests/test_compiled_moments.py).

What the moments show (per token of s b, bf16 unless said): Inductor frees each saved tensor at its last use.  AC
none: the SwiGLU moment holds every save but SwiGLU's product (its fused silu / mul backward writes one of its two
gradients into w3's output's storage, 2f less than eager), the RoPE rows gathered at the positions (``rope_rows``,
complex64, 4d) among them; the attention moment the attention's RoPE backward on dQ (an fp32 copy and the rotated
complex64 product, 4q each, and a conjugated copy of the rows, 4d, the saved rows freed) beside dQ, dK, dV, wo's
input gradient and both of the FFN's input gradients (Inductor keeps them for ffn_norm's weight-gradient kernel);
later moments, where most weight gradients exist, peak where tokens are few.  Full AC and selective-op: the generated
backward recomputes RoPE first (q and k as fp32 pairs, 4q and 4kv, and the rows' conjugated copy; selective-op also
q's rotated complex64 product) and keeps it until the attention's backward, so it sits beside SwiGLU's backward, their
largest moment (full re-makes what none keeps, the same ids counted, and the fused QKV's output; selective-op wo's
output, ffn_norm and w3); SwiGLU's two gradients are fresh storages; from the fused QKV's weight-gradient GEMM on both
hold the same (``LATER``), the FFN's three weight-gradient GEMMs last.

Derived, not measured: the weight gradients are FSDP2's unsharded bf16 ones until the reduce-scatter and the
previous layer's fp32 reduce-scatter input is held as in the eager block (memplan/inventory/titan_moments.py, whose
terms and FSDP2 moment are reused); TP's splits (heads, FFN columns / t, the residual's sequence / t, the norms'
gathered sides whole); CUDA: triton fuses differently from the C++ backend (its reductions, which buffers it reuses)
and FlexAttention's backward replaces sdpa's, so on a GPU these moments are the CPU code's, derived.  q is the
attention's width a d, which is h in every Llama 3 (the trace cannot tell them apart).
"""

from __future__ import annotations

import dataclasses

from memplan.core.model import ModelSpec
from memplan.core.training import Recompute
from memplan.inventory.titan_moments import (held_inputs, reduce_scatter_moment, residual_grad, weight_grads)
from memplan.inventory.types import Moment, Term, transient

SRC = ("measured: torchtitan 0.3.0's Llama 3 block compiled by torch 2.13's Inductor on CPU, its generated backward "
       "replayed with s, b symbolic and run under torch.profiler at two shapes (validation/compiled_backward.py, "
       "tests/test_compiled_moments.py); TP, FSDP2 and CUDA (triton's fusion, FlexAttention) derived")
NOTE = ("--compile (torchtitan): the compiled blocks' backward moments " + SRC.removeprefix("measured: ") +
        " (memplan/inventory/compiled_moments.py)")
TITAN_IDS = ("layer_input", "ln1_rstd", "qkv_input", "q", "k", "v", "sdpa_logsumexp", "attn_out", "o_proj_out",
             "ln2_rstd", "mlp_input", "silu_input", "up_out", "fc2_input", "rope_rows")  # compiled.py TITAN_LAYER's ids
SAC_ONLY = ("qkv_out", "wo_rs")  # compiled.py's selective-op-only saves (freed where the none moments hold neither)
ATTENTION = ("q", "k", "v", "sdpa_logsumexp", "rope_rows")  # the RoPE rows' last use: RoPE's backward on dQ, dK
FFN = ("mlp_input", "silu_input", "up_out", "fc2_input")


def _freed(*keep: str) -> tuple[str, ...]:
    """Every saved id but ``keep``."""
    return tuple(i for i in TITAN_IDS + SAC_ONLY if i not in keep)


# (moment id, what, freed ids, transients): the non-dominated samples of the replay, per AC mode
NONE = (
    ("swiglu", "SwiGLU's fused silu / mul backward", ("fc2_input",) + SAC_ONLY,
     "dy grad_w2_input grad_swiglu grad_w2"),
    ("w3_input_grad", "w3's input gradient GEMM", ("silu_input", "fc2_input") + SAC_ONLY,
     "dy grad_swiglu grad_mlp_input grad_w2_w3"),
    ("attention", "the attention's RoPE backward on dQ", ATTENTION + FFN + SAC_ONLY,
     "grad_mlp_inputs norm_rowsum grad_attn_residual rope_rows_conj grad_wo_input grad_q grad_kv grad_q_fp32 "
     "grad_q_rotated grad_ffn"),
    ("norm_weight_grads", "the norms' weight-gradient kernel", ATTENTION + FFN + SAC_ONLY,
     "grad_mlp_inputs norm_rowsum grad_attn_residual grad_norm_out grad_qkv_out norm_partials grad_norms grad_ffn"),
    ("wo_weight_grad", "wo's weight-gradient GEMM", _freed("layer_input", "ln1_rstd", "qkv_input", "attn_out"),
     "norm_rowsum grad_attn_residual grad_norm_out grad_qkv_out grad_norms grad_ffn grad_wo"),
    ("wqkv_weight_grad", "the fused QKV's weight-gradient GEMM", _freed("layer_input", "ln1_rstd", "qkv_input"),
     "norm_rowsum grad_attn_residual grad_norm_out grad_qkv_out grad_norms grad_ffn grad_wo grad_wqkv"),
)
# full and selective-op: after the attention's backward both hold the same, the weight-gradient GEMMs last
LATER = (
    ("wqkv_weight_grad", "the fused QKV's weight-gradient GEMM", _freed(
        "layer_input", "ln1_rstd", "qkv_input", "o_proj_out", "ln2_rstd", "mlp_input", "fc2_input"),
     "dy grad_qkv_out grad_swiglu_2 grad_mlp_inputs grad_input grad_norm_out grad_wo grad_wqkv"),
    ("norm_weight_grads", "the norms' weight-gradient kernel", _freed(
        "layer_input", "ln1_rstd", "o_proj_out", "ln2_rstd", "mlp_input", "fc2_input"),
     "dy grad_swiglu_2 grad_mlp_inputs grad_input grad_norm_out norm_partials grad_norms grad_wo grad_wqkv"),
    ("w2_weight_grad", "w2's weight-gradient GEMM", _freed("mlp_input", "fc2_input"),
     "dy grad_swiglu_2 grad_input grad_norms grad_wo grad_wqkv grad_w2"),
    ("w3_weight_grad", "w3's weight-gradient GEMM", _freed("mlp_input"),
     "grad_swiglu_2 grad_input grad_norms grad_wo grad_wqkv grad_w2_w3"),
    ("w1_weight_grad", "w1's weight-gradient GEMM", _freed("mlp_input"),
     "grad_w1_out grad_input grad_norms grad_wo grad_wqkv grad_ffn"),
)
FULL = (
    ("swiglu", "SwiGLU's fused silu / mul backward (the forward recomputed, RoPE's fp32 q, k and conjugated rows "
     "kept for the attention's backward)", ("rope_rows",) + SAC_ONLY,
     "dy qkv_rerun q_fp32 k_fp32 rope_rows_conj grad_w2_input grad_swiglu_2"),
    ("wo_weight_grad", "wo's weight-gradient GEMM", _freed(
        "layer_input", "ln1_rstd", "qkv_input", "attn_out", "o_proj_out", "ln2_rstd", "mlp_input", "fc2_input"),
     "dy grad_qkv_out grad_swiglu_2 grad_mlp_inputs norm_rowsum grad_attn_residual grad_norm_out grad_wo"),
) + LATER
SELECTIVE = (
    ("swiglu", "SwiGLU's fused silu / mul backward (RoPE's q and k, wo, ffn_norm and w3 recomputed)", _freed(
        "layer_input", "sdpa_logsumexp", "attn_out", "k", "v", "o_proj_out", "ln2_rstd", "mlp_input", "silu_input",
        "up_out", "fc2_input"), "dy rope_rows_conj q_fp32 q_rotated k_fp32 grad_w2_input grad_swiglu_2"),
    ("wo_weight_grad", "wo's weight-gradient GEMM", _freed(
        "layer_input", "attn_out", "o_proj_out", "ln2_rstd", "mlp_input", "fc2_input"),
     "dy grad_swiglu_2 grad_mlp_inputs norm_rowsum grad_attn_residual grad_wo_input grad_norm_out grad_qkv_out "
     "grad_wo"),
) + LATER
MODES = {Recompute.NONE: NONE, Recompute.FULL: FULL, Recompute.SELECTIVE: SELECTIVE}


def _transients(model: ModelSpec) -> dict[str, Term]:
    """Each tensor the moments hold beyond the saved ones, by the key MODES names it with."""
    h, a, g, f, q = model.hidden_size, model.num_attention_heads, model.g, model.f, model.q
    d, kv = q // a, g * (q // a)

    def t(id, name, elements, dtype="act", tp=True, sp=False, storages=1):
        return transient(id, name, elements, dtype, tp=tp, sp=sp, src=SRC, storages=storages)

    def grads(id, name, elements, tp=True):
        return dataclasses.replace(weight_grads(id, name, elements, tp), source=SRC)

    return {
        "dy": dataclasses.replace(residual_grad(h), source=SRC),
        "grad_w2_input": t("grad_w2_input", "gradient of w2's input", f"{f} s b"),
        "grad_swiglu": t("grad_swiglu", "silu(w1)'s gradient (w3's written into w3's output's storage)", f"{f} s b"),
        "grad_w1_out": t("grad_w1_out", "gradient of w1's output", f"{f} s b"),
        "grad_swiglu_2": t("grad_swiglu", "gradients of silu(w1) and of w3's output", f"{2 * f} s b", storages=2),
        "grad_mlp_input": t("grad_mlp_input", "w3's input gradient", f"{h} s b", tp=False),
        "grad_mlp_inputs": t("grad_mlp_inputs", "w1's and w3's input gradients (kept for ffn_norm's weight gradient)",
                             f"{2 * h} s b", tp=False, storages=2),
        "norm_rowsum": t("norm_rowsum", "an RMSNorm backward's per-token sum (fp32)", "s b", "fp32", tp=False, sp=True),
        "grad_attn_residual": t("grad_attn_residual", "gradient of the residual stream after the attention",
                                f"{h} s b", tp=False, sp=True),
        "rope_rows_conj": t("rope_rows_conj", "the RoPE rows gathered at the positions, conjugated (complex64)",
                            f"{d} s b", "fp32", tp=False),
        "qkv_rerun": t("qkv_rerun", "the fused QKV's output recomputed", f"{q + 2 * kv} s b"),
        "grad_wo_input": t("grad_wo_input", "gradient of wo's input (the attention output)", f"{q} s b"),
        "grad_q": t("grad_q", "dQ of sdpa's backward", f"{q} s b"),
        "grad_kv": t("grad_kv", "dK, dV of sdpa's backward", f"{2 * kv} s b", storages=2),
        "grad_q_fp32": t("grad_q_fp32", "dQ as fp32 pairs (RoPE's backward)", f"{q} s b", "fp32"),
        "grad_q_rotated": t("grad_q_rotated", "dQ times the conjugated rows (complex64)", f"{q} s b", "fp32"),
        "q_fp32": t("q_fp32", "q recomputed as fp32 pairs (RoPE)", f"{q} s b", "fp32"),
        "q_rotated": t("q_rotated", "q recomputed, rotated (complex64)", f"{q} s b", "fp32"),
        "k_fp32": t("k_fp32", "k recomputed as fp32 pairs (RoPE)", f"{kv} s b", "fp32"),
        "grad_norm_out": t("grad_norm_out", "gradient of attention_norm's output", f"{h} s b", tp=False),
        "grad_qkv_out": t("grad_qkv_out", "gradient of the fused QKV output", f"{q + 2 * kv} s b"),
        "grad_input": t("grad_input", "gradient of the block input", f"{h} s b", tp=False, sp=True),
        "norm_partials": t("norm_partials", "the norms' weight-gradient partial sums (fp32)", f"{2 * h}", "fp32",
                           tp=False, storages=2),
        "grad_norms": grads("grad_norm_weights", "the norms' weight gradients", f"{2 * h}", tp=False),
        "grad_w2": grads("grad_w2_weight", "w2's weight gradient", f"{h * f}"),
        "grad_w2_w3": grads("grad_w2_w3_weights", "w2's and w3's weight gradients", f"{2 * h * f}"),
        "grad_ffn": grads("grad_ffn_weights", "the gradients of w1, w2, w3", f"{3 * h * f}"),
        "grad_wo": grads("grad_wo_weight", "wo's weight gradient", f"{q * h}"),
        "grad_wqkv": grads("grad_wqkv_weight", "the fused QKV's weight gradient", f"{(q + 2 * kv) * h}"),
    }


def compiled_titan_moments(model: ModelSpec, recompute: Recompute, recompute_layers: bool = False,
                           ids: tuple[str, ...] = TITAN_IDS, modes: dict | None = None, made: dict | None = None,
                           norms: int = 0, src: str = SRC) -> tuple[Moment, ...]:
    """The compiled block's backward moments under ``recompute`` (module docstring), each with the previous layer's
    held reduce-scatter input, and FSDP2's reduce-scatter moment (memplan/inventory/titan_moments.py).  Under full
    AC with ``recompute_layers`` (selective-layer: some layers whole) the none moments in the layers kept whole.
    ``modes``, ``made``, ``norms``, ``src``: another block's tables (as MODES), transients beside _transients', norm
    weights beside the two RMSNorms' and source (memplan/inventory/compiled_qwen3.py: the dense Qwen3 block's)."""
    h, g, f, q = model.hidden_size, model.g, model.f, model.q
    kv = g * (q // model.num_attention_heads)
    made = {k: dataclasses.replace(t, source=src) for k, t in (_transients(model) | (made or {})).items()}
    modes = modes or MODES
    parts = (("", f"{q * h + 2 * kv * h + q * h + 3 * h * f}", True),)
    norms += 2 * h
    held = held_inputs(parts, norms)
    sets = [(modes[recompute], "any")]
    if recompute == Recompute.FULL:
        sets = [(modes[Recompute.FULL], "recomputed")] + ([(modes[Recompute.NONE], "plain")] if recompute_layers else [])
    moments = []
    for table, applies in sets:
        suffix = "" if applies != "plain" else "_whole"
        for id, what, freed, names in table:
            moments.append(Moment(f"compiled_{id}{suffix}", f"layer backward (compiled): {what}", "backward", "layer",
                                  tuple(made[n] for n in names.split()) + held, freed, source=src,
                                  applies=applies))
    return tuple(moments) + (reduce_scatter_moment(h, parts, norms, ids),)
