"""The backward moments of torchtitan's compiled Qwen3 MoE block (``compiled_moe_moments``; wired in by
``apply``, after memplan/inventory/compiled_moe.py's): what Inductor's generated backward holds at its experts' moments,
under AC none, full and selective-op (ep = tp = cp = 1).

Measured: validation/compiled_moe_backward.py compiles torchtitan 0.3.0's Qwen3 MoE block (validation/compiled_moe.py:
h 40, q 48, a 6, g 2, d 8, fe 24, E 10, k 4; the router's own top-k, no forced balance) as its apply_compile does
(after the AC wrapper, ``capture_scalar_outputs`` on), with torch 2.13's Inductor on CPU (dynamic s, b), called with
the dataloader's positions, and replays / measures it with validation/compiled_backward.py (as the Llama block's,
memplan/inventory/compiled_moments.py).  The routed sizes bind no data-dependent symbol: at ep 1 the routed copies
are k s b rows whatever the routing, the token counts per expert only the grouped GEMMs' offsets' values (an E-sized
int32 tensor); the replay runs the expert GEMMs as the fake ``aten._grouped_mm`` (k s b rows, or the E experts'
weights for a weight gradient).  Each moment below is a row of the replay's front (non-dominated samples, a s b + c
bytes) and the largest is the peak measured with torch.profiler at s 32, b 2 and s 64, b 3 (the CPU kernels' own
scratch left out) byte for byte (tests/data/compiled_moe_backward.json, tests/test_compiled_moe_moments.py).

What the moments show (per token of s b, bf16 unless said; k the top-k): the backward starts at the MoE.  AC none:
``moe_w2_weight_grad``, w2's grouped weight gradient (E h fe) made beside the gradient of the routed copies' output
(the incoming gradient gathered to them, times their scores: k h), of w2's input (k fe), of the router gate's input
(h) and its weight (E h), a contiguous copy of the attention's fp32 log-sum-exp (a), every save the router used
freed; ``moe_w1_input_grad``, the experts' last grouped GEMM: all three expert weight gradients (3 E h fe) beside both
routed-input gradients (2 k h), the experts' activations freed but w3's output, whose storage now holds its gradient.
Full and selective-op: the generated backward first recomputes the forward up to the experts (full: the whole
attention, its fused QKV output and the router's softmax in fp32 with its sum; selective-op: wo, ffn_norm, the sort
and the routed copies, from the saved attention output and top-k ids), the same ids counted, then
``moe_silu_backward`` holds the recomputed w1, w3 outputs and product beside the routed output's and w2's input's
gradients and silu's two (2 k fe), and ``moe_w3_weight_grad`` the three expert weight gradients beside w3's output's
gradient (k fe), the scores' gradient (k) and w1's routed-input gradient (k h).

Not modelled: the later moments of the attention's backward (at the test's widths below the experts' at both shapes;
they hold no k-wide tensor, and beyond the experts' weight gradients only the attention's and the gate's, ~38 MB for
qwen3-30b-a3b against the experts' moments' 2 k h B per token, 268 MB at 4,096 tokens: derived).  Derived, not
measured: FSDP2's unsharded bf16 weight gradients and the previous layer's held fp32 reduce-scatter input, as in the
eager block (memplan/inventory/titan_moments.py); CUDA: triton fuses differently, the router's scores are fp32 under
autocast (their gradient taken in that dtype) and FlexAttention's backward replaces sdpa's (its log-sum-exp copy
kept here).
"""

from __future__ import annotations

import dataclasses

from memplan.core.model import ModelSpec
from memplan.core.training import Recompute
from memplan.inventory.titan_moments import (held_inputs, moe_parts, reduce_scatter_moment, residual_grad,
                                             weight_grads)
from memplan.inventory.types import Inventory, Moment, Term, transient

SRC = ("measured: torchtitan 0.3.0's Qwen3 MoE block compiled by torch 2.13's Inductor on CPU, its generated backward "
       "replayed with s, b symbolic and run under torch.profiler at two shapes (validation/compiled_moe_backward.py, "
       "tests/test_compiled_moe_moments.py); FSDP2 and CUDA (triton's fusion, the router in fp32, FlexAttention) "
       "derived")
# the saves the router and the combine use, freed by the MoE's first kernels (AC none)
ROUTER = ("moe_input", "moe.scores", "moe.topk_ids", "moe.topk_scores", "moe.route_scale", "moe.sort_idx",
          "moe.combine_scores", "moe.w2.out", "sdpa_logsumexp")
EXPERTS = ("moe.w1.out", "moe.w3.out", "moe.swiglu.mul")
# full and selective-op: what the recomputed forward does not re-make by the experts' backward
RERUN_FREED = ("q_norm_input", "k_norm_input", "rope_rows", "moe.scores", "moe.topk_scores", "moe.combine_scores",
               "moe.token_idx", "moe.w2.out", "moe.combine_zeros")
SEL_FREED = RERUN_FREED + ("ln1_rstd", "qkv_input", "q_norm_rstd", "k_norm_rstd", "q", "k", "v")

# (moment id, what, freed ids, transients): rows of the replay's front, per AC mode
NONE = (
    ("moe_w2_weight_grad", "w2's grouped weight-gradient GEMM", ROUTER,
     "dy lse_copy grad_gate grad_gate_input grad_routed_out grad_w2_input grad_w2"),
    ("moe_w1_input_grad", "w1's grouped input-gradient GEMM, every expert weight gradient made",
     ROUTER + ("moe.w1.out", "moe.swiglu.mul", "moe.routed_input"),
     "dy lse_copy grad_gate grad_gate_input grad_experts grad_routed_inputs"),
)
FULL = (
    ("moe_silu_backward", "SwiGLU's fused silu / mul backward (the forward recomputed up to the experts)",
     RERUN_FREED, "dy qkv_rerun scores_fp32 softmax_sum grad_routed_out grad_w2_input grad_w1_w3_out"),
    ("moe_w3_weight_grad", "w3's grouped weight-gradient GEMM, every expert weight gradient made",
     RERUN_FREED + EXPERTS, "dy qkv_rerun scores_fp32 softmax_sum grad_w3_out grad_scores grad_routed_input "
     "grad_experts"),
)
SELECTIVE = (
    ("moe_silu_backward", "SwiGLU's fused silu / mul backward (wo, ffn_norm, the dispatch and the experts recomputed)",
     SEL_FREED, "dy grad_routed_out grad_w2_input grad_w1_w3_out"),
    ("moe_w3_weight_grad", "w3's grouped weight-gradient GEMM, every expert weight gradient made",
     SEL_FREED + EXPERTS, "dy grad_w3_out grad_scores grad_routed_input grad_experts"),
)
MODES = {Recompute.NONE: NONE, Recompute.FULL: FULL, Recompute.SELECTIVE: SELECTIVE}


def _transients(model: ModelSpec, device: str) -> dict[str, Term]:
    """Each tensor the moments hold beyond the saved ones, by the key MODES names it with."""
    h, a, g, q = model.hidden_size, model.num_attention_heads, model.g, model.q
    k, fe, E = model.moe_top_k, model.fe, model.num_experts
    kv = g * (q // a)
    router = "fp32" if device == "cuda" else "act"  # the router's dtype (compiled_moe.py: fp32 on CUDA, derived)

    def t(id, name, elements, dtype="act", storages=1):
        return transient(id, name, elements, dtype, src=SRC, storages=storages)

    def grads(id, name, elements):
        return dataclasses.replace(weight_grads(id, name, elements, tp=False), source=SRC)

    return {
        "dy": dataclasses.replace(residual_grad(h), source=SRC),
        "lse_copy": t("sdpa_lse_copy", "the attention's log-sum-exp copied contiguous (fp32)", f"{a} s b", "fp32"),
        "qkv_rerun": t("qkv_rerun", "the fused QKV's output recomputed", f"{q + 2 * kv} s b"),
        "scores_fp32": t("moe_scores_fp32", "the router's softmax scores recomputed (fp32, tokens x E)", f"{E} s b",
                         "fp32"),
        "softmax_sum": t("moe_softmax_sum", "the softmax's per-token sum (fp32)", "s b", "fp32"),
        "grad_gate_input": t("moe_grad_gate_input", "gradient of the router gate's input", f"{h} s b"),
        "grad_routed_out": t("moe_grad_routed_out", "gradient of the routed copies' output (the incoming gradient "
                             "gathered to them, times their scores)", f"{k * h} s b"),
        "grad_w2_input": t("moe_grad_w2_input", "gradient of the experts' w2 input", f"{k * fe} s b"),
        "grad_w1_w3_out": t("moe_grad_w1_w3_out", "silu / mul's backward: the gradients of w1's and w3's outputs",
                            f"{2 * k * fe} s b", storages=2),
        "grad_w3_out": t("moe_grad_w3_out", "gradient of w3's output", f"{k * fe} s b"),
        "grad_scores": t("moe_grad_scores", "the scores' gradient (the router's dtype)", f"{k} s b", router),
        "grad_routed_input": t("moe_grad_routed_input", "w1's routed-input gradient", f"{k * h} s b"),
        "grad_routed_inputs": t("moe_grad_routed_inputs", "w1's and w3's routed-input gradients", f"{2 * k * h} s b",
                                storages=2),
        "grad_gate": grads("grad_gate_weight", "the router gate's weight gradient", f"{E * h}"),
        "grad_w2": grads("grad_w2_weights", "the experts' w2 weight gradient", f"{E * h * fe}"),
        "grad_experts": grads("grad_experts_weights", "the experts' w1, w2, w3 weight gradients", f"{3 * E * h * fe}"),
    }


def compiled_moe_moments(model: ModelSpec, device: str, recompute: Recompute, recompute_layers: bool = False,
                         ids: tuple[str, ...] = ()) -> tuple[Moment, ...]:
    """The compiled Qwen3 MoE block's backward moments under ``recompute`` (module docstring), each with the previous
    layer's held reduce-scatter input, and FSDP2's reduce-scatter moment (memplan/inventory/titan_moments.py); under
    full AC with ``recompute_layers`` (selective-layer) the none moments in the layers kept whole."""
    made = _transients(model, device)
    parts, norms = moe_parts(model)
    held = held_inputs(parts, norms)
    sets = [(MODES[recompute], "any")]
    if recompute == Recompute.FULL:
        sets = [(FULL, "recomputed")] + ([(NONE, "plain")] if recompute_layers else [])
    moments = []
    for table, applies in sets:
        suffix = "_whole" if applies == "plain" else ""
        for id, what, freed, names in table:
            moments.append(Moment(f"compiled_{id}{suffix}", f"layer backward (compiled MoE): {what}", "backward",
                                  "layer", tuple(made[n] for n in names.split()) + held, freed, source=SRC,
                                  applies=applies))
    return tuple(moments) + (reduce_scatter_moment(model.hidden_size, parts, norms, ids),)


def apply(inventory: Inventory, model: ModelSpec, device: str, recompute: Recompute,
          recompute_layers: bool = False) -> Inventory:
    """The compiled MoE inventory (memplan/inventory/compiled_moe.py ``apply``) with the compiled block's moments."""
    ids = tuple(t.id for t in inventory.terms if t.scope == "layer")
    return dataclasses.replace(inventory, moments=inventory.moments + compiled_moe_moments(
        model, device, recompute, recompute_layers, ids))
