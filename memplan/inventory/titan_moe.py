"""torchtitan 0.3.0's Qwen3 MoE layer (`--impl torchtitan` on a Qwen3 MoE model, `--ep E`): what its MoE keeps for
the backward per AC mode, as Inventory terms in place of the dense SwiGLU's (memplan/inventory/titan.py has the
rest of the layer: attention, the norms, the block input).

torchtitan's MoE (models/common/moe.py, token_dispatcher.py; Qwen3's `_build_qwen3_moe_layers`: softmax router with
route_norm, no shared experts, the aux-loss-free load-balancing bias), measured on CPU with torchtitan's real block,
validation/titan_moe.py (tests/test_titan_moe.py), per token of the rank's s b (T tokens; N = k T routed copies):

* ``none``: the router keeps the softmax scores (T x E; saved by softmax), the top-k expert ids (int64 k, saved by
  gather), the gathered top-k scores (k) and route_norm's denominator (1) (both saved by the division); the
  dispatcher's local reorder keeps the argsort of the ids (int64 k, the scores' index), the scores in that order
  (k, saved by combine's multiply), the token indices (int64 k: the tokens' index and scatter_add's) and the routed
  copies of the tokens (k h, the grouped GEMMs' input); GroupedExperts (``torch._grouped_mm``, on CPU too in torch
  2.13) keeps w1's output, silu's, w3's and their product (4 x k fe); combine keeps the experts' output in fp32 (4 k h,
  saved by the scores' multiply).  Not modelled: the grouped GEMMs' int32 offsets (4 E / ep bytes a layer).
* ``selective-op`` (torchtitan's SelectiveAC with its shipped default config: its save list holds topk and
  all_to_all_single; matmuls counted per block, every second recomputed; the router gate forced recomputed and not
  counted, ``force_recompute_mm_shapes_by_fqns = ["moe.router.gate"]`` in distributed/activation_checkpoint.py): the
  block input, wqkv's output (matmul 1; wo, matmul 2, recomputed), attention's output and log-sum-exp, topk's values
  (fp32: the scores plus the fp32 expert_bias buffer) and ids (int64); not the gate's output (T x E), and the grouped
  GEMMs are not in the list (recomputed).
* ``full``: the block input only (titan.py's dense term).

Router dtype: torchtitan runs the gate under ``torch.autocast(dtype=float32)``. CPU autocast refuses fp32, so on CPU
(measured) the gate, softmax and scores are bf16; on CUDA (derived from torch 2.13's autocast, not measured) they
are fp32 and the gate linear keeps fp32 copies of its input (T x h) and of its weight (E x h, a layer) under ``none``.

Expert parallelism (``--ep E``: torchtitan's AllToAllTokenDispatcher; measured on 2 ranks over gloo with torch's
functional all_to_all_single, validation/titan_moe.py ``measure_moe_ep``): the routed tokens a rank's experts
receive (R) are k s b under balanced routing (torchtitan's round-robin ``_debug_force_load_balance``; memplan's
assumption, and the routing-dependent sizes are exactly the R-sized terms: the received copies, the experts' four
tensors, the permutation index); at worst every rank sends all its copies to one rank's experts (R = ep k s b, not
modelled). ``none`` adds the rank-major to expert-major permutation index (int64 R); the sent copies are then not
kept (all_to_all_single saves nothing). ``selective-op`` adds the saved all-to-all outputs: the received copies
(R h), the combined copies back (k s b h) and the token counts exchanged (int64 E).  The states (memplan's
ZeRO 3 with the experts' groups over ep: memplan/memory/stage.py) measured with torchtitan's own parallelize_qwen3 on
2 ranks over gloo (validation/titan_moe.py ``measure_ep_states``): fp32 parameters, gradients and AdamW moments
16 B / d per parameter at ep 1 and 2 (efsdp = d / ep), the running layer unsharded with the rank's E / ep experts;
with HSDP (4 ranks, 2 replicas, ep 2) 16 B / dp_shard (efsdp = dp_shard / ep), each replica a copy.

Tensor parallelism (``--tp T``, torchtitan's ``set_moe_sharding_config`` with sequence parallelism, applied by
parallelize_qwen3; measured per rank over gloo with tensor_parallel_degree 2 at ep 1 and 2, validation/titan_moe.py
``measure_moe_tp``, tests/test_titan_moe_tp.py): attention and the norms as the dense TP rule (memplan/inventory/
titan.py).  torchtitan 0.3.0 has no expert-TP option; its layout follows ep (``moe_etp``): at ep 1 the experts'
hidden dim is sharded over tp (w1 / w3 Shard(1), w2 Shard(2): etp = t) and the MoE's input is all-gathered over the
sequence, so the router's and the dispatcher's tensors and ffn_norm's output cover the whole s b tokens, the
experts' four are fe / t wide, and under selective-op the MoE's output reduce-scattered to the sequence is kept
(``moe.rs``: the save list holds reduce_scatter_tensor); at ep > 1 the MoE reuses the tp ranks for EP (efsdp = dp_shard
cp tp / ep), its experts whole (etp 1) and every token-sized tensor the rank's s b / t tokens (R = k s b / t).  Both
are one flag: the token-sized terms are ``etp_gathered`` (etp / t: 1 at ep 1, 1 / t at ep > 1).  The states: the
experts over ep x etp, FSDP2 over efsdp (measured on 2 and 4 ranks; memplan/memory/stage.py).

Context parallelism (``--cp C``: torchtitan's apply_cp_to_forward on the attention, measured on one rank of a fake cp
group, validation/titan_moe.py ``measure_moe_cp``): the attention as the dense CP rule (the whole sequence's K and V
all-gathered for FlexAttention), the MoE over the rank's s / C tokens: every per-token term / C (memplan's cp split),
the per-layer ones (the all-to-all's counts, the CUDA gate weight's fp32 copy) ``tokenless``: cp does not split
them.  With EP, TP or on CUDA: derived.

With --pp torchtitan splits the MoE layers as the dense ones (the stages' saved tensors measured over gloo: validation/titan_pp.py;
the stages' states with EP derived: memplan/memory/dp_stack.py titan_pipelined on the rank's experts).
"""

from __future__ import annotations

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.inventory.compiled_moe import compile_left
from memplan.inventory.compiled_qwen3 import left as qwen3_left
from memplan.inventory.types import Term, saved

# the memplan recompute flags of a term kept in these AC modes (memplan/inventory/types.py Term.kept: none =
# Recompute.NONE, selective-op = SELECTIVE, full = FULL)
MODE_FLAGS = {("none",): dict(sel=True), ("none", "selective-op"): {}, ("selective-op",): dict(only_selective=True),
              ("full", "selective-op"): dict(only_selective=True, full=True)}
MOE_MEASURED = ("measured: torchtitan 0.3.0 Qwen3 MoE block on CPU, balanced routing (validation/titan_moe.py; "
                "tests/test_titan_moe.py)")
TP_MEASURED = ("measured: torchtitan 0.3.0 parallelize_qwen3 with tensor_parallel_degree 2 (ep 1 and 2) on 2 ranks "
               "over gloo (validation/titan_moe.py measure_moe_tp; tests/test_titan_moe_tp.py)")
EP_MEASURED = ("measured: torchtitan 0.3.0 AllToAllTokenDispatcher on 2 ranks over gloo, balanced routing "
               "(validation/titan_moe.py measure_moe_ep)")
CUDA_ROUTER = ("derived: torch 2.13's CUDA autocast runs torchtitan's router gate in fp32 (CPU autocast cannot: "
               "measured there in bf16), not measured")
# the dense feed-forward's terms (memplan/inventory/titan.py llama3_layer_terms) an MoE layer does not have
DENSE_FFN = frozenset({"w1.out", "silu.out", "w3.out", "swiglu.mul", "w2.out", "w2.rs"})


# under TP (TP_MEASURED) a token-sized MoE tensor covers the whole sequence at ep 1 (the MoE's input all-gathered) and
# the rank's s b / t tokens at ep > 1 (sequence-sharded): etp t / t, 1 / t (`moe_etp`: the plan's etp says which)
TOKENS = dict(tp=True, etp_gathered=True)


def _term(id: str, name: str, elements: str, dtype: str, modes: tuple[str, ...], src: str, **kw) -> Term:
    return saved(id, name, "MoE", elements, dtype, k22=False, src=src, **MODE_FLAGS[modes], **(TOKENS | kw))


def titan_moe_terms(model: ModelSpec, device: str) -> list[Term]:
    """The MoE's kept tensors of one torchtitan Qwen3 MoE layer (module docstring), k bound to the model's top-k."""
    cuda = device == "cuda"
    r = "fp32" if cuda else "act"  # the router's scores: fp32 on CUDA (autocast), bf16 on CPU
    rsrc = CUDA_ROUTER if cuda else MOE_MEASURED
    src, none, sel, both = MOE_MEASURED, ("none",), ("selective-op",), ("none", "selective-op")
    k = str(model.moe_top_k)
    terms = [
        _term("moe.scores", "router softmax scores (tokens x E)", "E s b", r, none, rsrc),
        _term("moe.topk_values", "topk values (fp32: scores + the fp32 expert_bias)", f"{k} s b", "fp32", sel, src),
        _term("moe.topk_ids", "top-k expert ids (int64)", f"{k} s b", "int64", both, src),
        _term("moe.topk_scores", "gathered top-k scores", f"{k} s b", r, none, rsrc),
        _term("moe.route_norm", "route_norm's denominator", "s b", r, none, rsrc),
        _term("moe.sort_idx", "argsort of the expert ids (int64)", f"{k} s b", "int64", none, src),
        _term("moe.scores_sorted", "top-k scores in expert order", f"{k} s b", r, none, rsrc),
        _term("moe.token_idx", "token index of each routed copy (int64)", f"{k} s b", "int64", none, src),
        _term("moe.routed_input", "routed token copies, the grouped GEMMs' input (under EP the received R)",
              f"{k} s b h", "act", none, src),
        *[_term(f"moe.{i}", f"experts' {n} (R x fe)", f"{k} s b fe", "act", none, src, etp_gathered=False)
          for i, n in (("w1.out", "w1 output"), ("silu.out", "silu output"), ("w3.out", "w3 output"),
                       ("swiglu.mul", "silu(w1) * w3"))],
        _term("moe.combine_fp32", "experts' output in fp32 (combine's score multiply)", f"{k} s b h", "fp32", none,
              src),
        _term("moe.ep_permute_idx", "rank-major to expert-major permutation index (int64 R), EP only", f"{k} s b",
              "int64", none, EP_MEASURED, needs_ep=True),
        _term("moe.ep_a2a_dispatch", "all_to_all_single output: the received copies (R x h), EP only", f"{k} s b h",
              "act", sel, EP_MEASURED, needs_ep=True),
        _term("moe.ep_a2a_combine", "all_to_all_single output: the copies combined back (k s b x h), EP only",
              f"{k} s b h", "act", sel, EP_MEASURED, needs_ep=True),
        _term("moe.ep_a2a_counts", "all_to_all_single output: tokens per local expert from each rank (int64 E), "
              "EP only", "E", "int64", sel, EP_MEASURED, needs_ep=True, tp=False, etp_gathered=False, tokenless=True),
        _term("moe.rs", "MoE output reduce-scattered over the sequence (bf16), TP at ep 1 only", "h s b", "act", sel,
              TP_MEASURED, needs_tp=True, without_ep=True, tp=False, etp_gathered=False, sp=True),
    ]
    if cuda:
        terms += [_term("moe.gate_in_fp32", "router gate input in fp32 (autocast's copy)", "s b h", "fp32", none,
                        CUDA_ROUTER),
                  _term("moe.gate_weight_fp32", "router gate weight in fp32 (autocast's copy, per layer)", "E h",
                        "fp32", none, CUDA_ROUTER, tp=False, etp_gathered=False, tokenless=True)]
    return terms


def moe_etp(ep: int, tp: int) -> int:
    """The experts' tensor-parallel degree torchtitan 0.3.0 gives a Qwen3 MoE (it has no option for it: its
    ``set_moe_sharding_config``): at ep 1 the experts' hidden dim is sharded over the tp ranks (etp = tp), at ep > 1
    the experts are sharded over ep only, the MoE reusing the tp ranks for its tokens (etp = 1)."""
    return tp if ep == 1 else 1


def check_titan_mtp(mtp_layers: int, pipelined: bool, cp: int) -> None:
    """torchtitan 0.3.0 trains multi-token-prediction layers without pipeline or context parallelism (its
    MTPDecoder.Config.update_from_config raises NotImplementedError): estimate and search refuse them here."""
    if mtp_layers and (pipelined or cp > 1):
        raise MemplanError(f"--mtp with {'--pp' if pipelined else '--cp'}: torchtitan 0.3.0 refuses multi-token "
                           f"prediction with {'pipeline' if pipelined else 'context'} parallelism")


def check_titan_moe(model: ModelSpec, ep: int, etp, tp: int, cp: int, pp: int, compiled: bool, float8, replicate: int,
                    routing_options: bool, gpus: int = 0) -> None:
    """What `--impl torchtitan` models of MoE: --ep on a Qwen3 MoE model with FSDP2 data parallelism, HSDP
    (``replicate`` > 1), --tp (sequence parallel, the experts' etp `moe_etp`), --cp and the pipeline schedules but the
    split-backward ones (--pp: torchtitan's sparse mesh is (pp, dp_replicate, efsdp, ep), efsdp = dp_shard cp tp / ep:
    EP borrows the shard group's and the TP group's ranks; memplan/memory/pipeline_multi.py multi_refusal); DeepSeek-V3
    the same (its --pp: memplan/memory/pipeline.py titan_split, its multi-stage chunks pipeline_multi.chunk_dense);
    the rest refused in one line; ``gpus`` (0: not
    known yet) the world, whose dp_shard cp tp = gpus / (pp replicate) ep must divide."""
    if not model.is_moe:
        if ep > 1:
            raise MemplanError("--ep is expert parallelism: the model has no experts")
        if compiled and model.qk_norm and qwen3_left(tp):  # a dense Qwen3 (check_titan_layout: qk_norm is Qwen3's)
            raise MemplanError(qwen3_left(tp))
        return
    left = [name for name, on in ((compile_left(model, ep, tp, cp), compiled and bool(compile_left(model, ep, tp, cp))),
                                  ("--float8", bool(float8)),
                                  ("the --moe-* routing options (torchtitan routes balanced here)", routing_options))
            if on]
    check_titan_mtp(model.mtp_layers, pp > 1, cp)
    if left:
        raise MemplanError("--impl torchtitan with MoE: memplan models FSDP2 / HSDP with --ep, --tp, --cp, --pp and (a "
                           "Qwen3 MoE or DeepSeek-V3 at ep = tp = cp = 1) --compile only yet, not "
                           + ", ".join(left))
    if etp is not None and etp != moe_etp(ep, tp):
        raise MemplanError(f"--etp {etp}: torchtitan 0.3.0 has no expert tensor-parallel option; its experts are "
                           f"sharded over tp at ep 1 (etp = tp) and not at ep > 1 (etp 1): here etp {moe_etp(ep, tp)}")
    if model.num_experts % ep:
        raise MemplanError(f"--ep {ep} does not divide the {model.num_experts} experts (torchtitan shards them on "
                           "dim 0)")
    if ep == 1 and model.fe % tp:
        raise MemplanError(f"--tp {tp} does not divide the experts' FFN width {model.fe} (torchtitan shards it over "
                           "tp at ep 1)")
    if (model.moe_shared_ffn_hidden_size or 0) % tp:
        raise MemplanError(f"--tp {tp} does not divide the shared experts' FFN width {model.moe_shared_ffn_hidden_size} "
                           "(torchtitan shards it over tp)")
    shard = gpus // (pp * replicate)
    if gpus and not gpus % (pp * replicate) and shard % ep:  # GPUs pp and HSDP do not divide: the plan's own check
        raise MemplanError(f"--ep {ep} does not divide the {shard} ranks of an FSDP shard group times tp (torchtitan's "
                           "efsdp = dp_shard x cp x tp / ep; pp and dp_replicate are outside it)")
