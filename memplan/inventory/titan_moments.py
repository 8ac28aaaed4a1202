"""The backward moments of torchtitan 0.3.0's dense decoder layer (Llama 3, dense Qwen3): what is alive inside the
layer's backward beyond the saved tensors, as the step timeline's Moment objects (``titan_layer_moments``; used by
memplan/inventory/titan.py ``titan_inventory``).

Traced from torchtitan's real block (validation/titan_moments.py: validation/transients.py's live storages after
every op of the block's backward under FakeTensorMode, s and b symbolic; the front of non-dominated candidates) and
measured with real tensors on CPU (tests/test_titan_moments.py).  Every AC mode gives the same moments: the
recomputed block (full, selective-op) holds what none keeps, and full and selective-op the block input besides
(selective-op's cached outputs, wqkv's, w2's and under TP the reduce-scattered ones, are handed to the recompute and
freed: SEL_HANDED_ON).  Per token, bf16 unless said; the layer's bf16 weight gradients are alive from their op until
FSDP2's post-backward reduce-scatters them (torch .grad in the harness, FSDP2's unsharded gradients on a GPU):

* ``swiglu_backward``: mul's backward has made the gradients of silu(w1) and of w3 (2f each) beside w2's input
  gradient (2f) and the layer output's gradient (2h, alive until the residual add's backward), the product freed;
  w2's weight gradient (h f);
* ``ffn_norm_backward`` (CPU kernels only): torch's composite F.rms_norm's backward holds five fp32 h-wide tensors
  beside its fp32 input, the FFN's saves freed, the FFN's weight gradients and the norm weight's made (the peak
  where f is small beside h).  On CUDA the fused kernel's backward: derived as not above the SwiGLU moment, not
  modelled;
* ``attention_backward``: sdpa's backward has made dQ (2ad), dK, dV (2gd each) beside wo's input gradient (2ad) and
  the residual gradient (2h), the FFN's saves freed; its and wo's weight gradients made.  On CUDA FlexAttention's
  backward adds its fp32 delta (4a; torch 2.13's inductor lowering, derived);
* every moment above (FSDP2): the previous unit's fp32 reduce-scatter input, which torch 2.13's ``post_backward``
  keeps in ``comm_ctx.reduce_scatter_states`` (``reduce_scatter_max_input_buffers`` 1) until the next unit's
  post-backward: 4 B per parameter of a layer, the one back-propagated before (at the model's last layer it is the
  final norm + LM head unit's, 4 (v h + h) B: not modelled, a layer's counted).  Measured in a whole step over gloo
  (validation/titan_step.py, tests/test_titan_step.py), device-independent code;
* ``fsdp_reduce_scatter``: the layer's backward done, FSDP2's foreach_reduce holds the unsharded bf16 gradients and
  the fp32 reduce-scatter input of the whole layer (6 B per parameter) beside the input's gradient, every save freed
  (derived from torch 2.13's code: on CPU without FSDP2 nothing is reduce-scattered).  Its overlap with the next
  layer's backward on a GPU (the reduce-scatter stream) is not modelled.

TP (derived): heads, FFN columns and weight gradients / t, the residual gradient sequence-sharded; CP (derived):
dK and dV of the whole sequence (the all-gathered K and V's gradients, reduce-scattered afterwards).  The MoE
layers' and DeepSeek-V3's moments are not modelled (TITAN_LEFT).
"""

from __future__ import annotations

from memplan.core.model import ModelSpec
from memplan.inventory.titan_moe import DENSE_FFN
from memplan.inventory.types import Moment, Term, transient

# the moment of FSDP2's reduce-scatter copy-in ending a layer's backward (the layer resharded: memory/dp_stack.py TITAN_HELD)
REDUCE_SCATTER = "fsdp_reduce_scatter"
RS_HELD_ID = "rs_held"  # the previous unit's reduce-scatter input held in a layer's backward (its terms' id prefix)
# the tensors selective-op keeps that its recompute hands on or frees: freed at every layer-backward moment
SEL_HANDED_ON = ("wqkv.out", "wo.rs", "w2.out", "w2.rs")
TRACED = ("measured: torchtitan 0.3.0 Llama 3 block's backward on CPU, live storages after every op "
          "(tests/test_titan_moments.py), and traced under FakeTensorMode with s and b symbolic "
          "(validation/titan_moments.py)")
DERIVED = "derived: torchtitan 0.3.0's and torch 2.13's code, not measured"
RS_HELD = ("measured: a whole torchtitan FSDP2 step over gloo on 2 ranks (validation/titan_step.py, "
           "tests/test_titan_step.py); torch 2.13's fully_shard post_backward, device-independent")


def titan_layer_moments(model: ModelSpec, device: str, layer: tuple[Term, ...]) -> tuple[Moment, ...]:
    """The dense layer's backward moments (module docstring) for ``layer``'s term ids, on ``device``."""
    h, a, g, f, q = model.hidden_size, model.num_attention_heads, model.g, model.f, model.q
    d = q // a
    ids = tuple(t.id for t in layer)
    ffn = tuple(i for i in ids if i.startswith("ffn_norm.") or i in DENSE_FFN)
    dy = transient("grad_residual", "gradient of the layer output (residual stream; sequence-sharded under TP)",
                   f"{h} s b", sp=True, src=TRACED)

    def weights(id: str, name: str, n: int, tp: bool = True) -> Term:
        return transient(id, f"{name} (bf16; FSDP2's unsharded gradients until the reduce-scatter)", f"{n}", tp=tp,
                         src=TRACED)

    matrices = q * h + 2 * g * d * h + q * h + 3 * h * f
    norms = 2 * h + (2 * d if model.qk_norm else 0)
    held = (transient(RS_HELD_ID, "FSDP2's fp32 reduce-scatter input of the layer back-propagated before, kept until "
                      "this one's post-backward (at a stage's last layer the final norm + LM head's: memory/timeline.py)",
                      f"{matrices}", "fp32", tp=True, src=RS_HELD),
            transient("rs_held_norms", "the same of its norms' gradients", f"{norms}", "fp32", src=RS_HELD))
    moments = [Moment("swiglu_backward", "layer backward: SwiGLU product's gradients (silu(w1), w3) beside w2's",
                      "backward", "layer", (
                          dy, transient("grad_w2_input", "gradient of w2's input", f"{f} s b", tp=True, src=TRACED),
                          transient("grad_swiglu", "gradients of silu(w1) and of w3's output", f"{2 * f} s b", tp=True,
                                    src=TRACED, storages=2),
                          weights("grad_w2_weight", "w2's weight gradient", h * f)) + held,
                      ("swiglu.mul",) + SEL_HANDED_ON, source=TRACED)]
    if device == "cpu":  # torch's composite CPU F.rms_norm: its backward's fp32 temporaries
        moments.append(Moment(
            "ffn_norm_backward", "layer backward: ffn_norm's composite backward (fp32, CPU kernels)", "backward",
            "layer", (dy, transient("ffn_norm_backward_fp32", "rms_norm's backward: five fp32 h-wide tensors",
                                    f"{5 * h} s b", "fp32", sp=True, src=TRACED, storages=5),
                      weights("grad_ffn_weights", "the gradients of w1, w2, w3", 3 * h * f),
                      weights("grad_ffn_norm_weight", "ffn_norm's weight gradient", h, tp=False)) + held,
            tuple(i for i in ffn if i != "ffn_norm.x_fp32") + SEL_HANDED_ON, source=TRACED))
    attention = (dy, transient("grad_wo_input", "gradient of wo's input (the attention output)", f"{q} s b", tp=True,
                               src=TRACED),
                 transient("grad_q", "dQ of the attention backward", f"{q} s b", tp=True, src=TRACED),
                 transient("grad_kv", "dK, dV of the attention backward (the whole sequence's under CP: derived)",
                           f"{2 * g * d} cp s b", tp=True, src=TRACED, storages=2),
                 weights("grad_ffn_wo_weights", "the gradients of w1, w2, w3 and wo", 3 * h * f + q * h),
                 weights("grad_ffn_norm_weight", "ffn_norm's weight gradient", h, tp=False))
    if device == "cuda":
        attention += (transient("flex_delta", "fp32 delta of FlexAttention's backward (CUDA)", f"{a} s b", "fp32",
                                tp=True, src=DERIVED),)
    moments.append(Moment("attention_backward", "layer backward: the attention core's dQ, dK, dV", "backward",
                          "layer", attention + held, ffn + SEL_HANDED_ON, source=TRACED))
    moments.append(Moment(REDUCE_SCATTER, "layer backward done: FSDP2's reduce-scatter of its gradients",
                          "backward", "layer", (
                              transient("grad_input", "gradient of the layer input (sequence-sharded under TP)",
                                        f"{h} s b", sp=True, src=DERIVED),
                              transient("grad_layer", "the layer's unsharded gradients (bf16)", f"{matrices}", tp=True,
                                        src=DERIVED),
                              transient("grad_layer_norms", "the norms' gradients (bf16)", f"{norms}", src=DERIVED),
                              transient("reduce_scatter_input", "FSDP2's fp32 reduce-scatter input of them",
                                        f"{matrices}", "fp32", tp=True, src=DERIVED),
                              transient("reduce_scatter_input_norms", "the same of the norms' gradients", f"{norms}",
                                        "fp32", src=DERIVED)), ids, source=DERIVED))
    return tuple(moments)
