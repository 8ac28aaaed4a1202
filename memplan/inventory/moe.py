"""A Megatron-LM mixture-of-experts layer's saved tensors (`--impl megatron` / `megatron-local`), as data.

megatron-core 0.16.1's MoELayer (megatron/core/transformer/moe/): the TopKRouter, the token dispatcher
(MoEAlltoAllTokenDispatcher / MoEAllGatherTokenDispatcher), the experts (SequentialMLP in the local spec,
TEGroupedMLP with grouped GEMM in the Transformer Engine spec) and the shared experts. Measured on CPU per term
against megatron-core's own MoELayer in the local spec (validation/mcore.py, tests/test_validate_mcore_moe.py:
alltoall and allgather dispatchers, ep = 1 and 2, capacity factor with padding, shared experts, aux loss), with
the routing made exactly balanced (validation/mcore_cpu.py _balanced_routing). What one MoE layer keeps, per GPU:

- the MLP input (ln2's output): saved by the router's gating linear (RouterGatingLinearFunction) and by the shared
  experts' fc1 (one storage: the dense MLP's fc1_input term);
- the router (moe_utils.topk_routing_with_score_function, softmax after top-k): the top-k indices (int64, s b k) and
  the softmax of the k chosen logits (fp32, s b k; with --moe-router-pre-softmax, required for k = 1, the softmax
  of all E logits, s b E); with the aux loss (--moe-aux-loss-coeff > 0; Megatron-LM's default 0 has none) the fp32
  softmax of all E logits (s b E) and the tokens per expert (E int64) and the loss (fp32 scalar); with the z-loss
  (--moe-z-loss-coeff) logsumexp's input, the logits (s b E), its output (s b) and the loss, in the router's dtype;
  the probabilities handed on (below) are in the router's dtype (--moe-router-dtype fp32: 4 bytes);
- the permutation (moe_utils.permute): without capacity the routing map (bool, s b E) and the probabilities
  scattered to E columns (s b E) that masked_select keeps, and the permutation index (int64, one per routed copy);
  with padding to capacity (drop_and_pad) the routing map (kept by the router's token dropping) and two indices
  (tokens, probabilities) of C k s b entries; with a capacity factor and no padding both routing maps;
- megatron-core 0.19 (`megatron_core_version`, measured against 0.19.2 from recorded figures:
  tests/test_mcore_019_moe.py): the alltoall dispatcher's permute keeps an int64 argsort over tokens x E (s b E)
  in place of the routing map and the scattered probabilities (the allgather dispatcher's is 0.16.1's);
- the routed copies of the tokens (k s b h: the alltoall dispatcher's sorted output, or the permuted tokens)
  and their probabilities (k s b), the experts' input; each expert's MLP for its tokens: fc1's output (2 f_e
  for SwiGLU), and in the unfused CPU path x_linear + offset, SiLU(gate), the product (kept by the probabilities'
  multiply) and fc2's input (the product times the probabilities), each f_e wide. Summed over the experts that
  is k s b tokens (balanced), whatever ep: a GPU's E/ep experts receive its share of every rank's tokens;
- shared experts: the dense MLP of width f_s on every token (tensor-parallel as the dense MLP).

What the dispatcher gathers or exchanges (the allgather dispatcher's ep s b h tokens, the all-to-all's output
before sorting) is not saved: those are forward transients. With Megatron-LM's CUDA defaults
(--bias-swiglu-fusion) the experts' activation is weighted_bias_swiglu_impl (fusions/fused_bias_swiglu.py), which
keeps only its 2 f_e input and the probabilities; Transformer Engine's grouped experts (TEGroupedMLP, `--impl
megatron`) keep the same tensors (GroupedLinear keeps its input, the permuted tokens): derived from code, not
measured.

CUDA-only variants, derived from code, not measured (tests/test_megatron_moe_variants.py holds the hand derivations):
--moe-grouped-gemm (GROUPED_SRC; --recompute-modules moe_act in memplan/inventory/recompute.py), --moe-permute-fusion
(_fused_permute_terms), --moe-shared-expert-overlap (OVERLAP_SRC) and the flex dispatcher with DeepEP (_flex_terms);
--device cpu refuses them.

Load imbalance: the routed-token terms are multiplied by `moe_imbalance` (the busiest GPU's share relative to the
average) or, with a capacity factor C, by min(imbalance, C) (tokens beyond the capacity dropped: the bound when the
GPU's experts share its load evenly) and by C when padded to capacity. With `moe_expert_loads` (the busiest GPU's
experts' loads) each expert keeps min(load, C) of the average, as megatron-core's apply_router_token_dropping caps
each expert at C k s b / E of each source GPU's tokens: measured at ep = 1 with uneven routing (tests/
test_validate_mcore_moe.py test_capacity_drops_per_expert); at ep > 1 (the loads of the GPU's E/ep experts, checked
in memplan/core/specs.py) the receiver's figure is the same rule and the sender's copies (the permutation index)
are the balanced bound min(1, C), an upper bound (measured once at ep = 2, not in the suite). Dense-first layers (moe_first_dense_layers) keep the dense MLP: each MLP term is weighted by
its kind's share of the layers (as memplan/inventory/traced.py weighs layer groups), so a stage's total is exact for the
model and its per-layer figure the layers' mean.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Iterable

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.core.symbolic import Poly
from memplan.inventory.types import Moment, Term, saved

MOE_SRC = "mcore MoE CPU: megatron-core 0.16.1 MoELayer (local spec, SequentialMLP), measured (validation/mcore.py)"
MOE_DERIVED = ("mcore MoE code: megatron-core 0.16.1 MoELayer with Megatron-LM's CUDA fusions (weighted_bias_swiglu_impl) "
               "/ Transformer Engine TEGroupedMLP, derived from code, not measured")
GROUPED_SRC = ("mcore MoE code: megatron-core 0.16.1 TEGroupedMLP.forward (Transformer Engine GroupedLinear saves its "
               "input; bias_act_func) / GroupedMLP.forward (grouped_gemm gmm; its torch.compile'd "
               "activation_func_with_probs saves fc1's output and the probabilities), derived from code, not measured")
PERMUTE_SRC = ("mcore MoE code: megatron-core 0.16.1 moe_utils.permute / unpermute / sort_chunks_by_idxs with fused=True "
               "(Transformer Engine >= 2.5 moe_permute_with_probs / moe_permute: _moe_permute_mask_map saves "
               "make_row_id_map's int32 [tokens, 2 E + 1]; _moe_chunk_sort saves an int32 map of its rows), derived "
               "from code, not measured")
OVERLAP_SRC = ("mcore MoE code: megatron-core 0.16.1 SharedExpertMLP with moe_shared_expert_overlap (pre_forward_comm "
               "all-gathers the input with gather_from_sequence_parallel_region, the linears run without their own "
               "sequence-parallel gather: fc1 saves the gathered s b h; post_forward_comm reduce-scatters fc2's "
               "output), derived from code, not measured")
FLEX_SRC = ("mcore MoE code: megatron-core 0.16.1 MoEFlexTokenDispatcher with _DeepepManager (setup_metadata's torch.topk "
            "over the probabilities expanded to the etp x ep ranks, fused_a2a.FusedDispatch keeping DeepEP's handle, "
            "_indices_to_multihot, moe_utils.permute), derived from code, not measured; per received token bounded by "
            "one per routed copy")
CUDA_ONLY = ("--moe-grouped-gemm, --moe-permute-fusion, --moe-shared-expert-overlap and --moe-token-dispatcher flex need "
             "CUDA (Transformer Engine, the grouped_gemm package, CUDA streams, DeepEP): not with --device cpu")
SRC_019 = ("mcore MoE CPU: megatron-core 0.19.2 moe_utils.permute (its E s b int64 argsort, sliced, indexes the "
           "probabilities), measured on CPU, recorded (tests/data/mcore_0_19_2_moe.json)")
# the dense MLP's terms that an MoE layer does not have (fc1_input, the MLP input, it keeps)
DENSE_MLP = ("gelu_input", "swiglu_input", "swiglu_up", "swiglu_silu_out", "fc2_input")


def routed_factor(model: ModelSpec) -> Fraction:
    """The busiest GPU's routed tokens relative to balanced routing. With its experts' loads (moe_expert_loads):
    the mean over them of min(load, C), each expert keeping at most its capacity (megatron-core 0.16.1
    apply_router_token_dropping: per expert, C k s b / E of each source GPU's tokens), the mean load without a
    capacity. With moe_imbalance only: the imbalance, bounded by the capacity factor (exact when the busiest GPU's
    experts share its load evenly; unevenly they drop more). Padded to capacity: C."""
    r, cap = model.moe_imbalance, model.moe_capacity_factor
    if cap is not None and model.moe_pad_to_capacity:
        r = cap
    elif model.moe_expert_loads is not None:
        r = _kept(model.moe_expert_loads, cap)
    elif cap is not None:
        r = min(r, cap)
    return Fraction(r).limit_denominator(10_000)


def _kept(loads: tuple[float, ...], cap) -> float:
    """The mean kept share of experts with these loads (relative to the average expert), each capped at C."""
    return sum(x if cap is None else min(x, cap) for x in loads) / len(loads)


def _sent_factor(model: ModelSpec) -> Fraction:
    """A GPU's own routed copies that leave it (the sender's permutation): all k s b of them, fewer when
    dropped: per expert the mean of min(load, C) over all E experts when moe_expert_loads gives all E (ep = 1),
    else the balanced bound min(1, C) (an upper bound: its copies to hot experts drop too); C k s b padded."""
    cap = model.moe_capacity_factor
    if cap is None:
        return Fraction(1)
    if model.moe_pad_to_capacity:
        return Fraction(cap).limit_denominator(10_000)
    loads = model.moe_expert_loads
    all_experts = loads is not None and len(loads) == model.num_experts
    return Fraction(_kept(loads, cap) if all_experts else min(1.0, cap)).limit_denominator(10_000)


def moe_layer_terms(terms: Iterable[Term], model: ModelSpec, unfused: bool, measured: bool) -> list[Term]:
    """`terms` (a Megatron layer's inventory) with the MLP of the MoE layers: the dense MLP's terms weighted by
    the dense layers' share, the router / dispatcher / experts' terms by the MoE layers' share."""
    flex = model.moe_token_dispatcher == "flex"
    if measured and (model.moe_grouped_gemm or model.moe_permute_fusion or model.moe_shared_expert_overlap or flex):
        raise MemplanError(CUDA_ONLY)
    if (model.moe_permute_fusion or flex) and model.megatron_core_version == "0.19":
        raise MemplanError("--moe-permute-fusion and --moe-token-dispatcher flex are modelled for megatron-core 0.16.1 "
                           "(--megatron-core-version 0.16)")
    L = model.num_layers
    dense, moe = Fraction(model.moe_first_dense_layers, L), Fraction(model.moe_layers, L)
    out: list[Term] = []
    for t in terms:
        if t.id in DENSE_MLP:
            if dense:
                out.append(weighted(t, dense))
            continue
        out.append(t)
        if t.id == "fc1_input":
            out[-1] = dataclasses.replace(t, name="MLP input (router's / shared experts' input; dense MLP fc1's)")
            out += [weighted(x, moe) for x in _moe_terms(model, unfused, measured)]
    return out


def weighted(t: Term, share: Fraction, kind: str = "") -> Term:
    """``t`` in ``share`` of the layers (its elements scaled, its name saying so); ``kind`` ("dense" / "moe"): which
    layers, where a stage's share replaces the model's (Term.layer_kind)."""
    if share == 1:
        return t
    return dataclasses.replace(t, elements=t.elements * share, name=f"{t.name} (in {share} of the layers)",
                               layer_kind=kind)


def one_layer(t: Term, model: ModelSpec) -> Term:
    """A `weighted` term of the dense layers or the MoE layers (Term.layer_kind) as the tensor of one such layer: its
    kind's share of the model's layers undone."""
    if not t.layer_kind:
        return t
    L, dense = model.num_layers, model.moe_first_dense_layers
    return dataclasses.replace(t, elements=t.elements * Fraction(L, dense if t.layer_kind == "dense" else L - dense))


def _moe_terms(model: ModelSpec, unfused: bool, measured: bool) -> list[Term]:
    src = MOE_SRC if measured else MOE_DERIVED
    r, sent = routed_factor(model), _sent_factor(model)
    allgather = model.moe_token_dispatcher == "allgather"
    gated = model.mlp == "swiglu"
    probs = router_dtype(model)

    experts = GROUPED_SRC if model.moe_grouped_gemm else src  # the experts' computation

    def routed(id, name, elements, dtype="act", scale=r, src=src, **kw):
        term = saved(id, name, "MoE experts", elements, dtype, k22=False, src=src, **kw)
        return dataclasses.replace(term, elements=term.elements * scale)

    router = "MoE router"
    out = [saved("moe_topk_indices", "router top-k indices (int64)", router, "k s b", "int64", sp=True, k22=False,
                 src=src)]
    out += _router_terms(model, src)
    # with a capacity factor the token dropping keeps its routing map, and (not padded) 0.16.1's permute
    # (masked_select) another; 0.19.2's alltoall dispatcher keeps its permute's argsort over tokens x E instead (its
    # allgather dispatcher still selects the probabilities with masked_select, as 0.16.1's)
    v19 = model.megatron_core_version == "0.19" and not allgather
    # TE's fused permute (--moe-permute-fusion) keeps its int32 row_id_map in place of the index(es) and, in the
    # alltoall dispatcher, of the permute's routing map and scattered probabilities (the allgather dispatcher still
    # selects its probabilities with masked_select)
    fused, flex = model.moe_permute_fusion, model.moe_token_dispatcher == "flex"
    maps = (model.moe_capacity_factor is not None) + (not (v19 or model.moe_pad_to_capacity or (fused and not allgather)
                                                           or flex))
    two = maps == 2
    # the allgather dispatcher permutes the tokens gathered over the etp x ep group: its routing map, probabilities
    # and index cover etp ep s b / t tokens for the GPU's E / ep experts (the router's own tensors, and with
    # capacity its token-dropping map, are the GPU's s b / t tokens': equal at etp = t, counted as gathered)
    split = dict(tp=True, etp_gathered=True) if allgather else dict(sp=True)
    if maps:
        out.append(saved("moe_routing_map", "routing map (bool, tokens x E)" + (
            ", twice (token dropping, permute)" if two else ""), router, "2 E s b" if two else "E s b", "mask",
            k22=False, src=src, storages=maps, **split))
    if flex:
        out += _flex_terms(fused, routed)
    elif fused:
        out += _fused_permute_terms(model, allgather, split, routed)
        if allgather and not model.moe_pad_to_capacity:
            out.append(saved("moe_probs_dense", "probabilities scattered to E columns (kept by masked_select)", router,
                             "E s b", probs, k22=False, src=src, **split))
    elif model.moe_pad_to_capacity:
        out.append(routed("moe_permute_index", "permutation indices of tokens and of probabilities (int64, "
                          "padded to capacity)", "2 k s b", "int64", scale=sent, sp=True))
    else:
        out += [saved("moe_sort_index", "argsort of the routing map over tokens x E (int64; the probabilities' "
                      "index keeps a view of it)", router, "E s b", "int64", k22=False, src=SRC_019, **split) if v19
                else saved("moe_probs_dense", "probabilities scattered to E columns (kept by masked_select)", router,
                           "E s b", probs, k22=False, src=src, **split),
                routed("moe_permute_index", "permutation index (int64, one per routed copy)", "k s b", "int64",
                       scale=r if allgather else sent, **split)]
    out += [
        routed("moe_permuted_tokens", "routed token copies, the experts' input (k per token)", "k s b h",
               tp=True, etp_gathered=True),
        routed("moe_permuted_probs", "routing probabilities of the routed copies" + (" (fp32: DeepEP's)" if flex else ""),
               "k s b", "fp32" if flex else probs, tp=True, etp_gathered=True),
        routed("moe_fc1_output", "experts' fc1 output (the activation's input)", "2 k s b fe" if gated else "k s b fe",
               tp=True, src=experts),
    ]
    if unfused:
        if gated:
            out += [routed("moe_swiglu_up", "experts' x_linear + glu_linear_offset", "k s b fe", tp=True, src=experts),
                    routed("moe_silu_out", "experts' SiLU(gate)", "k s b fe", tp=True, src=experts)]
        out.append(routed("moe_act_out", "experts' activation output (kept by the probabilities' multiply)",
                          "k s b fe", tp=True, src=experts))
    out.append(routed("moe_fc2_input", "experts' fc2 input (activation times probability)", "k s b fe", tp=True,
                      src=experts))
    if model.moe_shared_ffn_hidden_size:
        shared = "MoE shared experts"
        if model.moe_shared_expert_overlap:
            out.append(saved("shared_fc1_gathered_input", "shared experts' fc1 input, all-gathered on their stream "
                             "(s b h, t > 1; at t = 1 the MLP input itself)", shared, "s b h", needs_tp=True,
                             k22=False, src=OVERLAP_SRC))
        out.append(saved("shared_fc1_output", "shared experts' fc1 output", shared,
                      "2 s b fs" if gated else "s b fs", tp=True, k22=False, src=src))
        if unfused and gated:
            out += [saved("shared_swiglu_up", "shared experts' x_linear + glu_linear_offset", shared, "s b fs", tp=True,
                       k22=False, src=src),
                    saved("shared_silu_out", "shared experts' SiLU(gate)", shared, "s b fs", tp=True, k22=False, src=src)]
        out.append(saved("shared_fc2_input", "shared experts' fc2 input", shared, "s b fs", tp=True, k22=False, src=src))
    return [dataclasses.replace(t, elements=t.elements.assign("k", model.moe_top_k)) for t in out]


def _fused_permute_terms(model: ModelSpec, allgather: bool, split: dict, routed) -> list[Term]:
    """What Transformer Engine's fused permutation keeps (--moe-permute-fusion): make_row_id_map's int32 map, 2 E + 1
    per token (its unpermute saves the same tensor), over the GPU's s b tokens (alltoall) or the etp ep s b / t
    gathered ones for the E / ep local experts (allgather: (2 E / ep + 1) etp ep s b / t); the alltoall dispatcher's
    two sorts by local expert (dispatch_postprocess, combine_preprocess; the unfused split / cat keeps nothing) an
    int32 map per received copy each. megatron-core skips those sorts with one local expert (ep = E) or padding."""
    name = "fused permute's row_id_map (int32, 2 E + 1 per token; its unpermute saves the same)"
    if allgather:
        return [saved("moe_row_id_map", name, "MoE router", "2 E s b + ep s b", "fp32", k22=False, src=PERMUTE_SRC,
                      **split)]
    out = [saved("moe_row_id_map", name, "MoE router", "2 E s b + s b", "fp32", sp=True, k22=False, src=PERMUTE_SRC)]
    if not model.moe_pad_to_capacity:
        term = routed("moe_sort_chunks_map", "fused sorts by local expert: an int32 map per received copy, twice "
                      "(dispatch, combine; none at ep = E)", "2 k s b", "fp32", tp=True, etp_gathered=True)
        out.append(dataclasses.replace(term, source=PERMUTE_SRC))
    return out


UNFUSED_SWIGLU = ("moe_swiglu_up", "moe_silu_out", "moe_act_out", "shared_swiglu_up", "shared_silu_out")


def unfused_moe_swiglu(terms: Iterable[Term], model: ModelSpec, impl: str, src: str) -> list[Term]:
    """`terms` (a CUDA Megatron-LM inventory of an MoE model) with --no-bias-swiglu-fusion: the experts' and the shared
    experts' unfused SwiGLU tensors (as measured on CPU) after their fc1 output. SequentialMLP's experts (MLP) and
    TEGroupedMLP's bias_act_func read the switch; the legacy GroupedMLP (--moe-grouped-gemm with --transformer-impl
    local) does not: its torch.compile'd activation_func_with_probs keeps fc1's output and the probabilities only."""
    legacy = model.moe_grouped_gemm and impl == "megatron-local"
    have = {t.id for t in terms}
    new = {t.id: dataclasses.replace(t, source=f"{src}; {t.source}")
           for t in moe_layer_terms([saved("fc1_input", "", "", "s b h", src="")], model, True, False)[1:]
           if t.id in UNFUSED_SWIGLU and t.id not in have and not (legacy and t.id.startswith("moe_"))}
    out: list[Term] = []
    for t in terms:
        out.append(t)
        prefix = {"moe_fc1_output": "moe_", "shared_fc1_output": "shared_"}.get(t.id)
        if prefix:
            out += [x for id, x in new.items() if id.startswith(prefix)]
    return out


def _flex_terms(fused: bool, routed) -> list[Term]:
    """What the flex dispatcher with DeepEP keeps per MoE layer (megatron-core 0.16.1 MoEFlexTokenDispatcher): its group is
    the etp x ep ranks, the GPU's s b / t tokens routed to k etp of them. setup_metadata's torch.topk over the
    probabilities expanded to those ranks keeps its int64 indices (k etp s b / t); FusedDispatch and FusedCombine keep
    DeepEP's handle: is_token_in_rank (bool) and send_head (int32) per token and rank (etp ep s b / t each), recv_src_idx
    (int32 per received token); _indices_to_multihot keeps probs[mask]'s mask (bool, k etp per received token) and
    index_put_'s two int64 indices per routed copy; the permute of the received tokens keeps, unfused, their routing map
    (bool) and multihot probabilities (fp32: DeepEP's) over the E / ep local experts and the int64 index, fused the int32
    row_id_map (2 E / ep + 1 per received token). A GPU receives a token once however many of its experts it chose:
    at most one per routed copy (k s b etp / t, the bound used). DeepEP's own buffers are not counted (below)."""
    def flex(id, name, elements, dtype, **kw):
        return dataclasses.replace(routed(id, name, elements, dtype, tp=True, etp_gathered=True, **kw), source=FLEX_SRC)

    one = Fraction(1)
    out = [flex("moe_flex_topk_indices", "flex: top-k indices over the probabilities expanded to the etp x ep ranks "
                "(int64, k etp per token)", "k s b", "int64", scale=one),
           flex("moe_deepep_token_in_rank", "DeepEP handle: is_token_in_rank (bool, per token and rank)", "ep s b", "mask",
                scale=one),
           flex("moe_deepep_send_head", "DeepEP handle: send_head (int32, per token and rank)", "ep s b", "fp32",
                scale=one),
           flex("moe_deepep_recv_src_idx", "DeepEP handle: recv_src_idx (int32 per received token)", "k s b", "fp32"),
           flex("moe_flex_multihot_mask", "_indices_to_multihot: probs[mask]'s mask (bool, k etp per received token)",
                "k k s b etp", "mask"),
           flex("moe_flex_multihot_index", "_indices_to_multihot: index_put_'s row and expert indices (int64, per "
                "routed copy)", "2 k s b", "int64")]
    if fused:
        return out + [flex("moe_row_id_map", "fused permute's row_id_map (int32, 2 E / ep + 1 per received token)",
                           "2 k s b E /ep + k s b", "fp32")]
    return out + [flex("moe_routing_map", "received tokens' routing map (bool, E / ep local experts)", "k s b E /ep",
                       "mask"),
                  flex("moe_probs_dense", "received tokens' multihot probabilities (fp32, kept by masked_select)",
                       "k s b E /ep", "fp32"),
                  flex("moe_permute_index", "permutation index (int64, one per routed copy)", "k s b", "int64")]


def router_dtype(model: ModelSpec) -> str:
    """The dtype of the router's logits and of the probabilities it hands the dispatcher: fp32 with
    --moe-router-dtype fp32 (TopKRouter.gating casts the linear's output), else the activations'."""
    return "fp32" if model.moe_router_dtype == "fp32" else "act"


def pre_softmax(model: ModelSpec) -> bool:
    """Softmax over all E logits before the top-k: --moe-router-pre-softmax, which megatron-core 0.16.1
    requires for k = 1 (TransformerConfig.__post_init__ refuses k = 1 without it)."""
    return model.moe_router_pre_softmax or model.moe_top_k == 1


def _router_terms(model: ModelSpec, src: str) -> list[Term]:
    """What TopKRouter.routing saves beside the top-k indices (moe_utils.topk_routing_with_score_function,
    z_loss_func, the aux loss), per the GPU's s b tokens (measured: tests/test_validate_mcore_moe.py)."""
    router, logits = "MoE router", router_dtype(model)
    if pre_softmax(model):  # softmax(logits, dtype=fp32) over all E, then top-k of the scores
        out = [saved("moe_topk_probs", "router softmax of all E logits before the top-k (fp32)", router, "E s b",
                     "fp32", sp=True, k22=False, src=f"{src}; --moe-router-pre-softmax")]
    else:  # top-k of the logits, then softmax(dtype=fp32) of the k chosen
        out = [saved("moe_topk_probs", "router softmax of the k chosen logits (fp32)", router, "k s b", "fp32",
                     sp=True, k22=False, src=src)]
    if model.moe_z_loss_coeff is not None:  # z_loss_func: logsumexp(logits) keeps its input and output
        z = f"{src}; with --moe-z-loss-coeff"
        out += [saved("moe_z_logits", "z-loss: the router logits (logsumexp's input)", router, "E s b", logits,
                      sp=True, k22=False, src=z),
                saved("moe_z_lse", "z-loss: logsumexp of the logits", router, "s b", logits, sp=True, k22=False,
                      src=z),
                saved("moe_z_loss", "z-loss value (scalar, MoEAuxLossAutoScaler)", router, "1", logits, k22=False,
                      src=z)]
    if model.moe_aux_loss_coeff > 0:
        aux = f"{src}; with --moe-aux-loss-coeff > 0"
        out += [saved("moe_aux_scores", "aux loss: softmax of all E logits (fp32)", router, "E s b", "fp32", sp=True,
                      k22=False, src=aux),
                saved("moe_aux_counts", "aux loss: tokens per expert (int64)", router, "E", "int64", k22=False,
                      src=aux),
                saved("moe_aux_loss", "aux loss value (fp32 scalar, MoEAuxLossAutoScaler)", router, "1", "fp32",
                      k22=False, src=aux)]
    return out


def moe_moments(moments: Iterable[Moment], model: ModelSpec, terms: Iterable[Term]) -> list[Moment]:
    """The layer backward's moments of an MoE model: the MLP's f-wide gradients become those of the routed
    copies through f_e-wide experts (k f_e r per token, r the routed factor), unless the dense layers' f is wider;
    the MoE terms are gone where the dense MLP's are (derived from the backward order, not measured)."""
    r = routed_factor(model)
    routed = Poly.parse(f"{model.moe_top_k} fe") * r
    width = model.moe_top_k * model.fe * r
    if model.moe_first_dense_layers and model.f >= width:
        routed = Poly.parse("f")
    terms = tuple(terms)
    moe_ids = tuple(t.id for t in terms if t.block.startswith("MoE"))
    out = [_combine_moment(model, terms)]
    for m in moments:
        if m.scope != "layer":
            out.append(m)
            continue
        transients = tuple(dataclasses.replace(t, elements=t.elements.substitute("f", routed)) for t in m.transients)
        freed = m.freed + moe_ids if "fc2_input" in m.freed else m.freed
        out.append(dataclasses.replace(m, transients=transients, freed=freed,
                                       source=f"{m.source}; MoE: the MLP's gradients sized for the k routed copies "
                                              "of each token through f_e-wide experts"))
    return out


COMBINE_SRC = ("derived from megatron-core 0.16.1 MoELayer.forward / token_dispatcher.py (token_combine, "
               "combine_postprocess: all-to-all or reduce-scatter, then unpermute), not measured")


def _combine_moment(model: ModelSpec, terms: tuple[Term, ...]) -> Moment:
    """Where an MoE layer's forward peaks: at the combine, every save of the layer made (the MLP's output dropout's
    mask not yet), with the experts' output for their routed copies (k s b h r, h wide: etp times the tokens before
    the expert-TP reduce-scatter), the dispatcher's combine buffer (alltoall: the copies sent back to their GPU, k s b
    h; allgather: the experts' outputs unpermuted to the ep s b h gathered tokens before the reduce-scatter) and the
    unpermuted output (s b h)."""
    r, sent = routed_factor(model), _sent_factor(model)
    k = model.moe_top_k

    def x(id, name, elements, scale=Fraction(1), **kw):
        term = saved(id, name, "transient", elements, k22=False, src=COMBINE_SRC, **kw)
        return dataclasses.replace(term, elements=term.elements * scale)

    transients = [x("moe_expert_output", "experts' output for their routed copies", f"{k} s b h", r, tp=True,
                    etp_gathered=True)]
    if model.moe_token_dispatcher == "allgather":
        transients.append(x("moe_combine_gathered", "experts' output unpermuted to the gathered tokens (before the "
                            "reduce-scatter)", "ep s b h"))
    else:
        transients.append(x("moe_combine_received", "routed copies back from the all-to-all", f"{k} s b h", sent,
                            sp=True))
    if model.moe_shared_expert_overlap:  # combine_postprocess: the shared experts' fc2, then its reduce-scatter
        transients.append(x("shared_fc2_output_gathered", "shared experts' fc2 output before the reduce-scatter (on "
                            "their stream, t > 1)", "s b h", needs_tp=True))
    transients.append(x("moe_unpermuted", "unpermuted MoE output", "s b h", sp=True))
    later = tuple(t.id for t in terms if t.id == "mlp_dropout_mask")
    return Moment("moe_combine_forward", "MoE forward: the experts' output and the dispatcher's combine buffers",
                  "forward", "layer", tuple(transients), later, recomputed=False, source=COMBINE_SRC)
