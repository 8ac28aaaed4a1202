"""The backward moments of torchtitan 0.3.0's dense decoder layer (Llama 3, dense Qwen3) and of its Qwen3 MoE
layer: what is alive inside the layer's backward beyond the saved tensors, as the step timeline's Moment objects
(``titan_layer_moments``; used by memplan/inventory/titan.py ``titan_inventory``).

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

* ``attention_norm_backward`` (CPU kernels only): the same composite backward of attention_norm, the layer's last,
  every weight gradient made (wqkv, wo, w1, w2, w3 and the norms'), every save but its fp32 input freed (the block
  input kept by a checkpoint stays): the peak under CP, where each rank's tokens are few beside the whole weights;
* ``rerun_w2_reduce_scatter`` (TP, a re-run layer: full, selective-op): the recomputed forward's last op, w2's
  reduce-scatter to the sequence (``rerun_w2_moment``): the peak of a re-run layer at TP 2 at every shape measured.

TP (sequence parallel) and CP measured per rank on 2 gloo ranks with torchtitan's own parallelize code
(validation/titan_tp_moments.py, recorded in tests/data/titan_tp_moments.json, tests/test_titan_tp_moments.py: 3
shapes x 3 AC modes each, every moment's bytes and each rank's peak byte for byte): under TP heads, FFN columns and
weight gradients / t, the residual gradient sequence-sharded, the norms' weight gradients whole; under CP every
token-sized term / cp but dK and dV, the whole sequence's (the all-gathered K and V's gradients, reduce-scattered
afterwards), and the weight gradients whole (``tokenless``: a CP rank holds every weight).  The Qwen3 MoE layer's
under CP 2 measured the same way (its AC modes, the checks of tests/test_titan_moments.py); TP with CP together and
the Qwen3 MoE layer's under TP: derived.

torchtitan's Qwen3 MoE layer (``moe_moments``; measured on CPU with torchtitan's real block, balanced routing,
validation/titan_moments.py ``measure_moe_moments``, tests/test_titan_moments.py at two shapes and every AC mode, byte
for byte but the grouped GEMMs' int32 offsets, 4 E B, which titan_moe.py does not model; among the candidates of its
trace under FakeTensorMode with s and b symbolic, ``trace_moments`` with a MoeShape, opt-in): the SwiGLU moment is
replaced by two of the MoE, per token of the rank's s b (k the top-k, T k the routed copies):

* ``moe_combine_backward``: the combine's ``routed_output.float() * scores`` backward, the first of the layer: the
  incoming gradient (2h), its gather to the routed copies cast to fp32 (4 k h), the two fp32 products (the experts'
  output's gradient and the scores' before their sum over h: 2 x 4 k h) and that sum (4 k, fp32), every kept
  tensor still alive.  By hand for qwen3-30b-a3b (h 2048, k 8): 4,096 + 65,536 + 131,072 + 32 = 200,736 B per
  token on top of what the layer keeps (tests/test_titan_moments.py).  In a recomputed layer (full, selective-op)
  the checkpoint's recomputed saves (the fp32 output, the scores) are dropped once unpacked, before the sum: the
  measured peak there is 4 k B per token below (the moment counted as the none one's, an upper bound);
* ``moe_experts_backward``: w1's grouped GEMM's backward, the last of the experts: the scores' gradient (k, the
  router's dtype), both grouped GEMMs' input gradients (w1's and w3's, 2 x 2 k h), silu's backward output (2 k f_e)
  and all three expert weight gradients (3 E h f_e / ep / etp, bf16), the combine's fp32 output, the sorted scores
  and the experts' four activations freed (the peak where tokens are few beside the experts' weights);
* ``ffn_norm_backward`` and ``attention_backward`` as the dense ones, the weight gradients made being the experts'
  and the router gate's (E h, whole) in place of the SwiGLU's; every MoE term freed;
* FSDP2's reduce-scatter and the previous layer's held fp32 input: the attention's matrices, the rank's experts
  and the gate (derived.  With EP torchtitan's fully_shard gives a block two parameter groups, the experts' on the
  efsdp mesh; torch 2.13 fires the experts' post_backward once their backward is done and pops every held input
  there, so the previous layer's whole input is held through the combine's and the experts' moments and this
  layer's experts' input after them: memplan counts a whole layer's throughout, an upper bound in ffn_norm's and
  the attention's moments; the experts' reduce-scatter runs there too, so the end-of-layer moment counting the
  whole layer's gradients is an upper bound as well).

* ``moe_rerun_combine`` (a recomputed layer: full, selective-op): the recomputed forward's combine, after the bf16
  cast of its fp32 product, every tensor none keeps re-made: the incoming gradient (2h), the residual stream after
  the attention (2h), the routing map (E, bool), the scaled scores (k), the counts per expert (int64 E; E / ep more
  with EP), w2's output (2 k h), with EP the all-to-all's output and its autograd wrapper (2 x 2 k h), the output's
  zeros (2h), the fp32 product (4 k h) and its cast (2 k h); selective-op's cached outputs handed on but those of
  ops after the combine (AFTER_COMBINE).  With EP it is above ``moe_combine_backward`` (by 4h + E - 2k B per token
  and the counts), at ep 1 below it (by 4 k h less that).

Expert parallelism measured on 2 ranks over gloo (ep 2, every AC mode: validation/titan_moe.py ``measure_moe_ep``
with ``moments``, recorded in tests/test_titan_moments.py, re-measured opt-in), byte for byte as at ep 1. Under TP
at ep 1 the token-sized MoE transients cover the MoE's whole s b (its input all-gathered), at ep > 1 the rank's s b
/ t (``etp_gathered``, as titan_moe.py's terms); CP measured on 2 gloo ranks at cp 2 (tests/test_titan_tp_moments.py);
TP and CUDA (the router's fp32 scores) derived. Not modelled:
attention_norm's backward (every weight gradient made; above these where tokens are few, measured at E 16, s 8,
where FSDP2's reduce-scatter, 6 B per parameter, is above it in turn), the router's backward (T x E). DeepSeek-V3's
layers: memplan/inventory/titan_dsv3_moments.py, built from these.
"""

from __future__ import annotations

import dataclasses

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
TP_CP_MEASURED = ("measured: torchtitan 0.3.0 Llama 3 block's backward on CPU, on 2 gloo ranks under TP 2 and CP 2 "
                  "(validation/titan_tp_moments.py, tests/test_titan_tp_moments.py)")
MOE_TRACED = ("measured: torchtitan 0.3.0 Qwen3 MoE block's backward on CPU, balanced routing, live storages after "
              "every op, at ep 1 and on 2 ranks over gloo at ep 2 (tests/test_titan_moments.py) and at cp 2 "
              "(tests/test_titan_tp_moments.py); TP and CUDA derived")
DERIVED_MOE = "derived (torch 2.13's per-parameter-group post_backward with EP: not measured)"
# the routed experts' weight gradients on a rank: E / ep experts, their hidden dim / etp (titan_moe.py moe_etp)
EXPERTS = "3 E h fe /ep /etp"
# selective-op's cached outputs made after the MoE's combine in the forward (TP at ep 1: its reduce-scattered output;
# DeepSeek-V3: the shared experts' cached matmul outputs), still cached in the recomputed forward's combine
AFTER_COMBINE = ("moe.rs", "mm.shared.w1", "mm.shared.w3", "mm.shared.w2", "shared.w2.rs")
# the MoE terms freed by the time w1's grouped GEMM runs its backward (their ops' backward done)
EXPERTS_FREED = ("moe.combine_fp32", "moe.scores_sorted", "moe.swiglu.mul", "moe.silu.out", "moe.w3.out", "moe.w1.out")
RS_HELD = ("measured: a whole torchtitan FSDP2 step over gloo on 2 ranks (validation/titan_step.py, "
           "tests/test_titan_step.py); torch 2.13's fully_shard post_backward, device-independent")


def held_inputs(parts: tuple[tuple[str, str, bool], ...], norms: int) -> tuple[Term, ...]:
    """FSDP2's fp32 reduce-scatter input of the layer back-propagated before (``parts``: the layer's matrices as (id
    suffix, elements, split over t))."""
    return tuple(transient(RS_HELD_ID + suffix, "FSDP2's fp32 reduce-scatter input of the layer back-propagated "
                           "before, kept until this one's post-backward (at a stage's last layer the final norm + LM "
                           "head's: memory/timeline.py)" + (f" ({suffix[1:]})" if suffix else ""), elements, "fp32",
                           tp=tp, src=RS_HELD if not suffix else f"{RS_HELD}; the MoE layer's parts {DERIVED_MOE}",
                           tokenless=True)
                 for suffix, elements, tp in parts) + (
        transient("rs_held_norms", "the same of its norms' gradients", f"{norms}", "fp32", src=RS_HELD,
                  tokenless=True),)


def moe_parts(model: ModelSpec) -> tuple[tuple[tuple[str, str, bool], ...], int]:
    """A Qwen3 MoE layer's matrices as FSDP2 reduce-scatters them (the attention's, / t; the routed experts', E / ep
    of them, / etp; the router gate's, whole) and its norms' elements."""
    h, q, d = model.hidden_size, model.q, model.q // model.num_attention_heads
    attn = q * h + 2 * model.g * d * h + q * h
    return ((("", f"{attn}", True), ("_experts", EXPERTS, False), ("_gate", f"{model.num_experts * h}", False)),
            2 * h + (2 * d if model.qk_norm else 0))


def weight_grads(id: str, name: str, elements: str, tp: bool = True, src: str = TRACED) -> Term:
    return transient(id, f"{name} (bf16; FSDP2's unsharded gradients until the reduce-scatter)", elements, tp=tp,
                     src=src, tokenless=True)


def titan_layer_moments(model: ModelSpec, device: str, layer: tuple[Term, ...]) -> tuple[Moment, ...]:
    """The layer's backward moments (module docstring) for ``layer``'s term ids, on ``device``: the dense layer's, or
    with ``model.is_moe`` torchtitan's Qwen3 MoE layer's (``moe_moments``)."""
    h, a, g, f, q = model.hidden_size, model.num_attention_heads, model.g, model.f, model.q
    d = q // a
    ids = tuple(t.id for t in layer)
    moe = model.is_moe
    ffn = tuple(i for i in ids if i.startswith(("ffn_norm.", "moe.")) or i in DENSE_FFN)
    handed_on = SEL_HANDED_ON + tuple(t.id for t in layer if t.id.startswith("moe.") and t.only_selective)
    dy = residual_grad(h)
    attn = q * h + 2 * g * d * h + q * h
    norms = 2 * h + (2 * d if model.qk_norm else 0)
    if moe:
        parts, norms = moe_parts(model)
        ffn_grads = (weight_grads("grad_experts_weights", "the routed experts' w1, w2, w3 gradients", EXPERTS,
                                  False, MOE_TRACED),
                     weight_grads("grad_gate_weight", "the router gate's weight gradient",
                                  f"{model.num_experts * h}", False, MOE_TRACED))
        wo = (weight_grads("grad_wo_weight", "wo's weight gradient", f"{q * h}", src=MOE_TRACED),)
        moments = moe_moments(model, device, dy, ffn_grads[0], handed_on)
    else:
        parts = (("", f"{attn + 3 * h * f}", True),)
        ffn_grads = (weight_grads("grad_ffn_weights", "the gradients of w1, w2, w3", f"{3 * h * f}"),)
        wo = ()
        # under TP a re-run layer's recomputed forward ends with w2's reduce-scatter, before the SwiGLU's backward
        moments = [rerun_w2_moment(h, dy, handed_on), swiglu_moment(h, f, dy, handed_on)]
    held = held_inputs(parts, norms)
    moments = [dataclasses.replace(m, transients=m.transients + held) for m in moments]
    norm_grad = weight_grads("grad_ffn_norm_weight", "ffn_norm's weight gradient", f"{h}", tp=False)
    src = MOE_TRACED if moe else TRACED
    if device == "cpu":  # torch's composite CPU F.rms_norm: its backward's fp32 temporaries
        moments.append(ffn_norm_moment(h, dy, ffn_grads + (norm_grad,) + held,
                                       tuple(i for i in ffn if i != "ffn_norm.x_fp32") + handed_on, src))
    attention = (dy, transient("grad_wo_input", "gradient of wo's input (the attention output)", f"{q} s b", tp=True,
                               src=TRACED),
                 transient("grad_q", "dQ of the attention backward", f"{q} s b", tp=True, src=TRACED),
                 transient("grad_kv", "dK, dV of the attention backward (the whole sequence's under CP)",
                           f"{2 * g * d} cp s b", tp=True, src=TRACED, storages=2))
    attention += (wo + ffn_grads if moe else (weight_grads("grad_ffn_wo_weights", "the gradients of w1, w2, w3 and wo",
                                                       f"{3 * h * f + q * h}"),)) + (norm_grad,)
    if device == "cuda":
        attention += (transient("flex_delta", "fp32 delta of FlexAttention's backward (CUDA)", f"{a} s b", "fp32",
                                tp=True, src=DERIVED),)
    moments.append(Moment("attention_backward", "layer backward: the attention core's dQ, dK, dV", "backward",
                          "layer", attention + held, ffn + handed_on, source=src))
    if device == "cpu" and not moe:  # attention_norm's, the layer's last: every weight gradient made (MoE: not
        # modelled); the ids of the reduce-scatter moment's gradients, the same tensors (memory/stream_fsdp.py WGRADS)
        every = (weight_grads("grad_layer", "every matrix's gradient (wqkv, wo, w1, w2, w3)",
                              f"{attn + 3 * h * f}", src=TP_CP_MEASURED),
                 weight_grads("grad_layer_norms", "the norms' weight gradients", f"{norms}", tp=False,
                              src=TP_CP_MEASURED))
        last = tuple(i for i in ids if i not in ("attention_norm.x_fp32", "input")) + handed_on
        moments.append(ffn_norm_moment(h, dy, every + held, last, TP_CP_MEASURED, "attention_norm_backward",
                                       "attention_norm"))
    moments.append(reduce_scatter_moment(h, parts, norms, ids))
    return tuple(moments)


def rerun_w2_moment(h: int, dy: Term, handed_on: tuple[str, ...]) -> Moment:
    """TP (sequence parallel) in a re-run layer (full, selective-op): the recomputed forward's last op, w2's
    reduce-scatter to the sequence, with every tensor none keeps re-made (selective-op's cached outputs handed on
    as they are re-used), beside the incoming gradient and its all-gather over the sequence (w2's backward's, made
    before the recompute), the residual stream after the attention and ffn_norm's sequence-sharded output (the
    block's forward holds both while the FFN runs), w2's partial sums over the whole sequence, their copy in chunks
    for the reduce-scatter (DTensor's Shard(1): split + cat) and the reduce-scatter's output and its autograd
    wrapper.  Measured on 2 gloo ranks (validation/titan_tp_moments.py)."""
    def tp_only(id: str, name: str, elements: str, sp: bool = True, storages: int = 1) -> Term:
        return dataclasses.replace(transient(id, name, elements, sp=sp, src=TP_CP_MEASURED, storages=storages),
                                   needs_tp=True)

    return Moment("rerun_w2_reduce_scatter", "layer backward, the recomputed forward: w2's reduce-scatter (TP)",
                  "backward", "layer", (
                      dy, tp_only("rerun_grad_gathered", "the incoming gradient all-gathered over the sequence",
                                  f"{h} s b", sp=False),
                      tp_only("rerun_residual", "the residual stream after the attention, and ffn_norm's "
                              "sequence-sharded output", f"{2 * h} s b", storages=2),
                      tp_only("rerun_w2_partial", "w2's partial sums over the whole sequence and their copy in "
                              "chunks for the reduce-scatter", f"{2 * h} s b", sp=False, storages=2),
                      tp_only("rerun_w2_rs", "the reduce-scatter's output and its autograd wrapper", f"{2 * h} s b",
                              storages=2)),
                  handed_on, source=TP_CP_MEASURED, applies="rerun")


def residual_grad(h: int) -> Term:
    """The gradient of a layer's output, alive through its backward (the residual stream)."""
    return transient("grad_residual", "gradient of the layer output (residual stream; sequence-sharded under TP)",
                     f"{h} s b", sp=True, src=TRACED)


def swiglu_moment(h: int, f: int, dy: Term, handed_on: tuple[str, ...], id: str = "swiglu_backward") -> Moment:
    """mul's backward in a dense SwiGLU of width ``f`` (module docstring), the previous layer's held input apart."""
    return Moment(id, "layer backward: SwiGLU product's gradients (silu(w1), w3) beside w2's", "backward", "layer", (
        dy, transient("grad_w2_input", "gradient of w2's input", f"{f} s b", tp=True, src=TRACED),
        transient("grad_swiglu", "gradients of silu(w1) and of w3's output", f"{2 * f} s b", tp=True, src=TRACED,
                  storages=2),
        weight_grads("grad_w2_weight", "w2's weight gradient", f"{h * f}")), ("swiglu.mul",) + handed_on, source=TRACED)


def ffn_norm_moment(h: int, dy: Term, made: tuple[Term, ...], freed: tuple[str, ...], src: str,
                    id: str = "ffn_norm_backward", norm: str = "ffn_norm") -> Moment:
    """ffn_norm's composite CPU backward: its five fp32 h-wide tensors beside ``made`` (the weight gradients, the held
    reduce-scatter input)."""
    return Moment(id, f"layer backward: {norm}'s composite backward (fp32, CPU kernels)", "backward", "layer",
                  (dy, transient("ffn_norm_backward_fp32", "rms_norm's backward: five fp32 h-wide tensors",
                                 f"{5 * h} s b", "fp32", sp=True, src=TRACED, storages=5)) + made, freed, source=src)


def reduce_scatter_moment(h: int, parts: tuple[tuple[str, str, bool], ...], norms: int,
                          ids: tuple[str, ...]) -> Moment:
    """FSDP2's reduce-scatter ending a layer's backward (module docstring): ``parts`` the layer's matrices."""
    grads = tuple(transient("grad_layer" + suffix, "the layer's unsharded gradients (bf16)" + (
        f" ({suffix[1:]})" if suffix else ""), elements, tp=tp, src=DERIVED, tokenless=True)
        for suffix, elements, tp in parts)
    copies = tuple(transient("reduce_scatter_input" + suffix, "FSDP2's fp32 reduce-scatter input of them" + (
        f" ({suffix[1:]})" if suffix else ""), elements, "fp32", tp=tp, src=DERIVED, tokenless=True)
        for suffix, elements, tp in parts)
    return Moment(REDUCE_SCATTER, "layer backward done: FSDP2's reduce-scatter of its gradients", "backward", "layer", (
        transient("grad_input", "gradient of the layer input (sequence-sharded under TP)", f"{h} s b", sp=True,
                  src=DERIVED),
        *grads[:1],
        transient("grad_layer_norms", "the norms' gradients (bf16)", f"{norms}", src=DERIVED, tokenless=True),
        *copies[:1],
        transient("reduce_scatter_input_norms", "the same of the norms' gradients", f"{norms}", "fp32", src=DERIVED,
                  tokenless=True),
        *grads[1:], *copies[1:]), ids, source=DERIVED)


def moe_moments(model: ModelSpec, device: str, dy: Term, experts: Term, handed_on: tuple[str, ...]) -> list[Moment]:
    """The MoE's own backward moments in a torchtitan Qwen3 MoE layer (module docstring), per token of the rank's s b
    (at ep 1 under TP the MoE's whole s b: ``etp_gathered``, as titan_moe.py's token-sized terms)."""
    k, h, fe = model.moe_top_k, model.hidden_size, model.fe
    r = "fp32" if device == "cuda" else "act"  # the router's scores (titan_moe.py: fp32 on CUDA under autocast)

    def tokens(id: str, name: str, elements: str, dtype: str = "act", storages: int = 1) -> Term:
        return dataclasses.replace(transient(id, name, elements, dtype, tp=True, src=MOE_TRACED, storages=storages),
                                   etp_gathered=True)

    combine = (dy, tokens("moe_grad_fp32", "combine's gradient, the routed copies' (k s b x h) in fp32", f"{k * h} s b",
                          "fp32"),
               tokens("moe_grad_products", "the score multiply's two fp32 products (the experts' output's gradient, "
                      "the scores' before their sum over h)", f"{2 * k * h} s b", "fp32", 2),
               tokens("moe_grad_scores_fp32", "the scores' gradient (fp32, summed over h)", f"{k} s b", "fp32"))
    expert = (dy, tokens("moe_grad_scores", "the scores' gradient (the router's dtype), held until the router's "
                         "backward", f"{k} s b", r),
              tokens("moe_grad_routed", "the input gradients of w1's and w3's grouped GEMMs (R x h each)",
                     f"{2 * k * h} s b", storages=2),
              transient("moe_grad_w1_out", "silu's backward: the gradient of w1's output (R x fe)", f"{k * fe} s b",
                        tp=True, src=MOE_TRACED), experts)
    def once(id: str, name: str, elements: str, ep: bool = False) -> Term:  # a layer's (int64), not a token's
        return dataclasses.replace(transient(id, name, elements, "int64", src=MOE_TRACED), tokenless=True, needs_ep=ep)

    rerun = (dy, transient("moe_rerun_residual", "the residual stream after the attention (x + its output)",
                           f"{h} s b", sp=True, src=MOE_TRACED),
             tokens("moe_rerun_routing_map", "the one-hot routing map (tokens x E, bool)", "E s b", "mask"),
             tokens("moe_rerun_scores", "the top-k scores times route_scale", f"{k} s b", r),
             once("moe_rerun_counts", "tokens per expert (int64 E)", "E"),
             once("moe_rerun_counts_local", "tokens per local expert from the all-to-all (int64 E / ep), EP only",
                  "E /ep", True),
             tokens("moe_rerun_w2_out", "w2's grouped GEMM output (R x h)", f"{k * h} s b"),
             dataclasses.replace(tokens("moe_rerun_a2a", "the combine all-to-all's output and its autograd wrapper "
                                        "(k s b x h each), EP only", f"{2 * k * h} s b", storages=2), needs_ep=True),
             tokens("moe_rerun_out", "combine's output buffer (zeros like the MoE's tokens)", f"{h} s b"),
             tokens("moe_rerun_product", "the score multiply's fp32 product", f"{k * h} s b", "fp32"),
             tokens("moe_rerun_cast", "its bf16 cast", f"{k * h} s b"))
    # selective-op's cached outputs of ops after the combine are not handed on yet (the reduce-scattered MoE output)
    cached = tuple(i for i in handed_on if i not in AFTER_COMBINE)
    return [Moment("moe_rerun_combine", "layer backward, the recomputed forward: the MoE combine's score multiply "
                   "cast back to bf16", "backward", "layer", rerun, cached, source=MOE_TRACED, applies="rerun"),
            Moment("moe_combine_backward", "layer backward: the MoE combine's fp32 score multiply", "backward",
                   "layer", combine, handed_on, source=MOE_TRACED),
            Moment("moe_experts_backward", "layer backward: w1's grouped GEMM, every expert weight gradient made",
                   "backward", "layer", expert, EXPERTS_FREED + handed_on, source=MOE_TRACED)]
