"""The backward moments of torchtitan 0.3.0's DeepSeek-V3 layers (memplan/inventory/titan_dsv3.py's terms): what is
alive inside a dense first layer's and an MoE layer's backward beyond the saved tensors, as the step timeline's Moment
objects (``dsv3_layer_moments``), built from the dense block's and Qwen3 MoE's (memplan/inventory/titan_moments.py).

DeepSeek-V3's layer terms are the two kinds' weighted by their share of the layers (titan_dsv3.py); a moment happens in
one kind's layers (``Moment.layers``), so it frees every weighted feed-forward term and holds that kind's own still
alive (unweighted) among its transients, as the traced hybrids' moments do (memplan/inventory/traced.py).

Measured on CPU with torchtitan's real blocks (validation/titan_dsv3.py, balanced routing; tests/test_titan_moments.py,
every AC mode), byte for byte but the grouped GEMMs' int32 offsets (4 E B a layer, not modelled), per token:

* an MoE layer: the shared experts' backward runs first (their SwiGLU's moment is below the combine's: not
  modelled), then Qwen3 MoE's two (``moe_combine_backward``, ``moe_experts_backward``) with the shared experts' input
  gradient (2h, over the MoE's whole input under TP: derived) and weight gradients (3 h f_s) made, their saved
  tensors freed; ffn_norm's composite backward (CPU) with the routed experts', the router gate's and the shared
  experts' weight gradients;
* a dense first layer: the SwiGLU's (``dense_swiglu_backward``) and ffn_norm's (``dense_ffn_norm_backward``) as
  Llama 3's, f the dense width.

Derived: the attention's backward (``attention_backward``, every layer): FlexAttention's dQ, dK (a (d_n + d_r) each),
dV (a d_v) beside wo's input gradient (a d_v), its fp32 delta on CUDA (a); validation's stand-in recomputes the
attention with the math sdpa in its backward (s^2 scores), so it is not FlexAttention's and not measured.  It and
FSDP2's reduce-scatter (and the previous layer's held reduce-scatter input) count an MoE layer's weight gradients in
every layer: the dense first layers' are fewer (an upper bound there; they are back-propagated last).  TP, EP, CP
and CUDA derived.  With --pp the step timeline reads ``Moment.layers`` as positions on a stage: right on the first
stage, which holds the dense layers (torchtitan's split; the most loaded one under 1F1B and GPipe), while a later
stage's first n_dense positions take the dense layers' moments in place of the MoE ones (a lower bound there).
"""

from __future__ import annotations

import dataclasses

from memplan.core.model import ModelSpec
from memplan.core.training import Recompute
from memplan.inventory.titan_moments import (AFTER_COMBINE, DERIVED, EXPERTS, ffn_norm_moment, held_inputs, moe_moments,
                                             reduce_scatter_moment, residual_grad, swiglu_moment, weight_grads)
from memplan.inventory.types import Moment, Term, transient

DSV3_TRACED = ("measured: torchtitan 0.3.0 DeepSeek-V3 blocks' backward on CPU, balanced routing, live storages after "
               "every op (validation/titan_dsv3.py; tests/test_titan_moments.py); TP, EP, CP and CUDA derived")
MLA_DERIVED = ("derived: FlexAttention's backward in torch 2.13 (dQ, dK, dV; validation's stand-in recomputes the math "
               "sdpa, not measured)")


def _matrices(model: ModelSpec) -> tuple[tuple[str, str, bool], ...]:
    """An MoE layer's matrices on a rank as (id suffix, elements, split over t): MLA's (the latent down projections
    whole under TP: ModelSpec.mla_down_replicated), the routed experts', the router gate's, the shared experts'."""
    h, a, E = model.hidden_size, model.num_attention_heads, model.num_experts
    dn, dr, dv, rq, rkv = (model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim, model.q_lora_rank,
                           model.kv_lora_rank)
    split = a * (dn + dr) * (rq or h) + a * (dn + dv) * rkv + h * a * dv  # wq_b (or wq), wkv_b, wo
    whole = (rq * h if rq else 0) + (rkv + dr) * h  # wq_a, wkv_a
    return (("", f"{split + 3 * h * model.moe_shared_ffn_hidden_size}", True), ("_latent", f"{whole}", False),
            ("_experts", EXPERTS, False), ("_gate", f"{E * h}", False))


def dsv3_layer_moments(model: ModelSpec, device: str, layer: tuple[Term, ...], dense: tuple[Term, ...],
                       moe: tuple[Term, ...]) -> tuple[Moment, ...]:
    """The layers' backward moments (module docstring): ``layer`` the inventory's (weighted) layer terms, ``dense``
    and ``moe`` a dense and an MoE layer's own feed-forward terms (unweighted)."""
    h, a, L, nd = model.hidden_size, model.num_attention_heads, model.num_layers, model.moe_first_dense_layers
    dn, dr, dv, fs = model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim, model.moe_shared_ffn_hidden_size
    ids = tuple(t.id for t in layer)
    ffn_ids = tuple(dict.fromkeys(t.id for t in dense + moe))
    norm_ids = tuple(i for i in ids if i.startswith("ffn_norm."))
    handed_on = tuple(t.id for t in layer if t.only_selective and not t.kept_by_full)
    dy = residual_grad(h)
    parts = _matrices(model)
    norms = 2 * h + (model.q_lora_rank or 0) + model.kv_lora_rank
    held = held_inputs(parts, norms)
    moe_layers, dense_layers = tuple(range(nd, L)), tuple(range(nd))

    def own(kind: tuple[Term, ...], freed: tuple[str, ...]) -> tuple[Term, ...]:
        """The kind's own feed-forward tensors alive (kept under none, not freed by the moment)."""
        return tuple(t for t in kind if t.kept(Recompute.NONE) and t.id not in freed)

    shared = tuple(t.id for t in moe if t.id.startswith("shared."))
    shared_made = (transient("shared_grad_input", "the shared experts' input gradient (w1's and w3's summed; the MoE's "
                             "whole input under TP: derived)", f"{h} s b", src=DSV3_TRACED),
                   weight_grads("grad_shared_weights", "the shared experts' w1, w2, w3 gradients", f"{3 * h * fs}",
                            src=DSV3_TRACED))
    experts = weight_grads("grad_experts_weights", "the routed experts' w1, w2, w3 gradients", EXPERTS, False,
                           DSV3_TRACED)
    gate = weight_grads("grad_gate_weight", "the router gate's weight gradient", f"{model.num_experts * h}", False,
                    DSV3_TRACED)
    moments = []
    for m in moe_moments(model, device, dy, experts, handed_on):
        freed = m.freed + shared  # the shared experts' backward runs first; in the recomputed forward they come after
        made = () if m.applies == "rerun" else shared_made
        # the recomputed forward's combine: the shared experts' cached outputs still in selective-op's cache (their
        # weighted terms, (L - n_dense) / L of them: not the MoE layer's own, which no moment's transient can be
        # under selective-op alone)
        weighted = tuple(i for i in ffn_ids if not (m.applies == "rerun" and i in AFTER_COMBINE))
        moments.append(dataclasses.replace(m, transients=m.transients + made + own(moe, freed) + held,
                                           freed=freed + weighted, layers=moe_layers, source=DSV3_TRACED))
    swiglu = swiglu_moment(h, model.f, dy, handed_on, "dense_swiglu_backward")
    if nd:
        moments.append(dataclasses.replace(swiglu, transients=swiglu.transients + own(dense, swiglu.freed) + held,
                                           freed=swiglu.freed + ffn_ids, layers=dense_layers, source=DSV3_TRACED))
    norm_grad = weight_grads("grad_ffn_norm_weight", "ffn_norm's weight gradient", f"{h}", tp=False)
    freed = ffn_ids + tuple(i for i in norm_ids if i != "ffn_norm.x_fp32") + handed_on  # ffn_norm's backward
    moe_grads = (experts, gate, shared_made[1])
    if device == "cpu":  # torch's composite CPU F.rms_norm: its backward's fp32 temporaries
        moments += [dataclasses.replace(ffn_norm_moment(h, dy, grads + (norm_grad,) + held, freed, DSV3_TRACED, id),
                                        layers=at)
                    for id, grads, at in (("ffn_norm_backward", moe_grads, moe_layers),
                                          ("dense_ffn_norm_backward", (weight_grads(
                                              "grad_ffn_weights", "the gradients of w1, w2, w3", f"{3 * h * model.f}",
                                              src=DSV3_TRACED),), dense_layers)) if at]
    attention = (dy, transient("grad_wo_input", "gradient of wo's input (the attention output)", f"{a * dv} s b",
                               tp=True, src=MLA_DERIVED),
                 transient("grad_q", "dQ of FlexAttention's backward", f"{a * (dn + dr)} s b", tp=True,
                           src=MLA_DERIVED),
                 transient("grad_k", "dK of FlexAttention's backward (the whole sequence's under CP)",
                           f"{a * (dn + dr)} cp s b", tp=True, src=MLA_DERIVED),
                 transient("grad_v", "dV of FlexAttention's backward (the whole sequence's under CP)",
                           f"{a * dv} cp s b", tp=True, src=MLA_DERIVED),
                 weight_grads("grad_wo_weight", "wo's weight gradient", f"{h * a * dv}", src=MLA_DERIVED),
                 *moe_grads, norm_grad)
    if device == "cuda":
        attention += (transient("flex_delta", "fp32 delta of FlexAttention's backward (CUDA)", f"{a} s b", "fp32",
                                tp=True, src=DERIVED),)
    moments.append(Moment("attention_backward", "layer backward: the attention core's dQ, dK, dV (an MoE layer's "
                          "weight gradients made)", "backward", "layer", attention + held,
                          ffn_ids + norm_ids + handed_on + ("attn.out_contiguous",), source=MLA_DERIVED))
    moments.append(reduce_scatter_moment(h, parts, norms, ids))
    return tuple(moments)
