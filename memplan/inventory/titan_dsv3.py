"""torchtitan 0.3.0's DeepSeek-V3 (`--impl torchtitan` on a DeepSeek-V3 model: models/deepseek_v3, MLA attention,
``n_dense_layers`` dense first layers, MoE layers with shared experts): one layer's kept tensors per AC mode, as
Inventory terms (memplan/inventory/titan.py ``titan_inventory`` adds the final norm, the loss and the states'
layout; memplan/inventory/titan_moe.py the routed experts' terms, shared with Qwen3 MoE).

Measured on CPU with torchtitan's real block (validation/titan_dsv3.py, tests/test_titan_dsv3.py: a dense and an
MoE layer at tiny sizes, the 671B flavour's kinds: q latent, sigmoid router with 8 expert groups of which 4 are
chosen, route_norm, one shared expert), per token of the rank's s b (widths: r_q = q_lora_rank, r_kv =
kv_lora_rank, d_n, d_r, d_v the head widths, a heads, f the dense FFN, f_s the shared experts' together, E experts):

* ``none``: attention_norm and ffn_norm as in Llama 3 (CPU: x in fp32, rstd, x * rstd in fp32, the bf16 output);
  q_norm on the r_q latent and kv_norm on the r_kv one, the same four each; q and k as the two ``torch.cat`` make
  them (a (d_n + d_r) each: k's rope part the one shared rotated k_pe expanded to the heads); wkv_b's output (a (d_n
  + d_v): the attention keeps v, a view of it, so the whole storage stays); the attention's output (a d_v), its fp32
  log-sum-exp (a) and the contiguous copy wo takes; the dense layers' SwiGLU (w1, silu, w3, their product: 4 x f),
  the MoE layers' shared experts' (4 x f_s) and routed terms (titan_moe.py: the router's sigmoid scores in place of
  Qwen3's softmax, same size).  RoPE keeps its cache rows gathered at the dataloader's positions (d_r / 2
  complex64, 4 d_r B: memplan/inventory/titan.py ``rope_gathered``; without positions it would keep nothing but a
  view of its buffer).
* ``selective-op`` (torchtitan's SelectiveAC): the block input, attention's output and log-sum-exp (flex_attention
  is in its save list), every topk's outputs (the group-limited routing's too: each group's top-2 scores, fp32 and
  int64 2 x 8, the 4 chosen groups, 4 + 4, then the top-k), and the odd-numbered matmuls of the block in forward
  order (``mm_sequence``; every second one recomputed, the count restarting per block; the router gate not counted
  and recomputed: SelectiveAC's shipped ``force_recompute_mm_shapes_by_fqns = ["moe.router.gate"]``): with a q
  latent wq_a (1), wkv_a (3), wo (5), then w3 (7), in a dense layer its own, in an MoE layer the shared experts';
  without one (the debug and 16B flavours) wq (1), wkv_b (3), then w1 (5) and w2 (7).
* ``full``: the block input only.

Dense first layers: a dense layer's FFN terms weighted by n_dense / L, an MoE layer's (routed and shared) by
(L - n_dense) / L (as memplan/inventory/moe.py weighs Megatron-LM's), so the layers' total is exact; each tagged with
its kind (Term.layer_kind), so that with --pp a stage counts its own: torchtitan's pipeline_llm deals layers.0 .. out
first, so the first stage holds the dense layers (memplan/memory/term_bytes.py kind_share; measured over gloo with
torchtitan's pipelined model, 1F1B and GPipe: validation/titan_pp.py, tests/test_titan_dsv3_pp.py); under the
multi-stage Interleaved1F1B / LoopedBFS each rank's chunk its own (memplan/memory/pipeline_multi.py chunk_dense,
memplan/memory/stage.py multi_counts; measured the same way: tests/test_titan_dsv3_multistage.py).

The attention: torchtitan attends with compiled FlexAttention; validation stands in one op that keeps its autograd
op's save set (q, k, v as passed, out, log-sum-exp: derived from torch 2.13's FlexAttentionAutogradOp, not measured).
The router's groups: memplan's ModelSpec has no field for them; torchtitan's 671B flavour's (8 groups, 4 chosen) are
taken (ROUTER_GROUPS).  Multi-token prediction: torchtitan's flavours build ``num_mtp_layers = 0`` by default
(model_registry); asked for (``--mtp N``), its MTPDecoder trains them without PP or CP and refuses them with either
(``NotImplementedError`` in update_from_config): memplan/inventory/titan_mtp.py; without --mtp
memplan/inventory/titan.py ``titan_model`` drops a model's MTP layers, said in the output.

States: FSDP2 (+ EP) as for Qwen3 MoE (memplan/memory/stage.py), measured with torchtitan's own
``parallelize_deepseekv3`` on 2 ranks over gloo at ep 1 and 2 (validation/titan_dsv3.py ``measure_dsv3_ep_states``):
16 B / d per parameter, the running MoE layer unsharded with the rank's E / ep experts.

Tensor parallelism (``--tp T``: torchtitan's ``set_deepseek_v3_sharding_config`` with sequence parallelism, applied by
``parallelize_deepseekv3``; measured per rank with tensor_parallel_degree 2 at ep 1 and 2 over gloo, every storage of
the dense and the MoE layer under none / selective-op / full, and the states: validation/titan_dsv3_tp.py,
tests/test_titan_dsv3_tp.py).  The attention's input is all-gathered over the sequence; wq_a, wkv_a, q_norm and
kv_norm are replicated and run on the whole sequence (their terms whole: the latents' norms, matmuls 1 and 3 under
selective-op), wq_b / wq / wkv_b colwise (q, k, wkv_b's output, the attention's output, lse and wo's input on the
rank's a / t heads), wo rowwise (under selective-op its partial sums whole and its reduce-scattered output kept:
``wo.rs``); the dense FFN as Llama 3's (``w2.rs``); the MoE as Qwen3 MoE's under TP (titan_moe.py: the routed terms
over all tokens at ep 1, the rank's s b / t at ep > 1; the group-limited topk outputs with them), the shared experts
colwise / rowwise on their input all-gathered over the sequence at any ep (their four / t, under selective-op w3 / t
and w2's reduce-scattered output ``shared.w2.rs``); at ep > 1 ffn_norm's own sequence-sharded output is the router's
and the routed experts' input beside the shared experts' all-gathered copy (``moe.input_sharded``).  States: the
latent down projections whole on every TP rank (ModelSpec ``mla_down_replicated``, set by titan.py ``titan_model``),
the rest as the dense TP rule.

Context parallelism (``--cp C``: apply_cp_to_forward on its FlexAttention; measured on one rank of a fake cp group,
``measure_dsv3_cp``): every term the rank's s / C tokens, the attention keeping the whole sequence's K (a (d_n + d_r))
and V (a d_v, made contiguous) all-gathered in place of the rank's k and wkv_b's output (``cp_gathered_kv_mla``).
CP with TP or EP, and CUDA: derived.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.inventory.moe import weighted
from memplan.inventory.titan import (TitanTerm, cuda_norm, is_dsv3, llama3_layer_terms, rope_gathered, titan_inventory,
                                     titan_term)
from memplan.inventory.titan_dsv3_moments import dsv3_layer_moments
from memplan.inventory.titan_moe import MODE_FLAGS, TOKENS, titan_moe_terms
from memplan.inventory.titan_mtp import NOTE as MTP_NOTE
from memplan.inventory.titan_mtp import mtp_terms
from memplan.inventory.types import Inventory, Term, saved

DSV3_MEASURED = ("measured: torchtitan 0.3.0 DeepSeek-V3 block on CPU, FlexAttention's save set in a stand-in "
                 "(validation/titan_dsv3.py; tests/test_titan_dsv3.py)")
TP_SRC = ("measured: torchtitan 0.3.0 parallelize_deepseekv3 with tensor_parallel_degree 2 (ep 1 and 2) on 2 ranks over "
          "gloo, FlexAttention's save set in a stand-in (validation/titan_dsv3_tp.py; tests/test_titan_dsv3_tp.py)")
CP_MEASURED = ("measured: torchtitan 0.3.0 apply_cp_to_forward on its DeepSeek-V3 block, one rank of a fake cp group, "
               "FlexAttention's save set in a stand-in (validation/titan_dsv3_tp.py measure_dsv3_cp)")
DSV3_CUDA = f"{DSV3_MEASURED}; on CUDA the fused RMSNorm derived from torch 2.13's code, not measured"
# torchtitan's 671B flavour: router_num_expert_groups, router_num_limited_groups (not ModelSpec fields)
ROUTER_GROUPS = (8, 4)
NOTE = ("torchtitan DeepSeek-V3 (models/deepseek_v3): the MLA attention, the dense first layers and the shared "
        "experts measured with its real blocks on CPU (FlexAttention's save set in a stand-in: derived), the routed "
        "experts' terms those of its common MoE (memplan/inventory/titan_moe.py), the router's groups its 671B "
        "flavour's (8, 4 chosen); no multi-token-prediction layers (its flavours build num_mtp_layers 0 by default; "
        "--mtp N adds them, refused with PP or CP as torchtitan refuses them); with --pp each stage's own dense and MoE layers, "
        "the stages' saved tensors measured with its pipelined model over gloo (validation/titan_pp.py); "
        "the FSDP2 + EP states measured with its own parallelize_deepseekv3 on 2 ranks over gloo; with --tp (the "
        "latent projections replicated on the whole sequence) and --cp each rank's terms and states measured "
        "(validation/titan_dsv3_tp.py), TP with CP or on CUDA derived")


def mm_sequence(model: ModelSpec, moe: bool) -> list[tuple[str, str, int]]:
    """The block's matmuls in forward order (SelectiveAC counts aten.mm per block): (id, name, output width)."""
    a, dn, dr, dv = model.num_attention_heads, model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim
    h, rq, rkv = model.hidden_size, model.q_lora_rank, model.kv_lora_rank
    seq = [("wq_a", "q down projection", rq), ("wq_b", "q up projection", a * (dn + dr))] if rq else [
        ("wq", "q projection", a * (dn + dr))]
    seq += [("wkv_a", "kv down projection (the r_kv latent and k_pe)", rkv + dr),
            ("wkv_b", "kv up projection", a * (dn + dv)), ("wo", "attention output projection", h)]
    if moe:  # the router gate is not counted: SelectiveAC's default force_recompute_mm_shapes_by_fqns
        fs = model.moe_shared_ffn_hidden_size
        return seq + [("shared.w1", "shared experts' w1", fs), ("shared.w3", "shared experts' w3", fs),
                      ("shared.w2", "shared experts' w2", h)]
    return seq + [("w1", "w1", model.f), ("w3", "w3", model.f), ("w2", "w2", h)]


def _ffn(prefix: str, name: str, width: int) -> list[TitanTerm]:
    return [TitanTerm(f"{prefix}{i}", f"{name}{n} (bf16)", 2 * width, ("none",), "tp")
            for i, n in (("w1.out", "w1 output"), ("silu.out", "silu output"), ("w3.out", "w3 output"),
                         ("swiglu.mul", "silu(w1) * w3"))]


ATTENTION_MMS = frozenset({"wq_a", "wq_b", "wq", "wkv_a", "wkv_b", "wo"})
# under TP (set_deepseek_v3_sharding_config): the up projections, w1 and w3 colwise (/ t); wq_a and wkv_a replicated
# on the whole sequence, wo and w2 rowwise (their outputs the partial sums over the whole sequence): whole
COLWISE = frozenset({"wq_b", "wq", "wkv_b", "w1", "w3", "shared.w1", "shared.w3"})


def _mm_terms(model: ModelSpec, moe: bool, attention: bool, src: str) -> list[Term]:
    """The saved matmul outputs under selective-op, the attention's or the FFN's."""
    out = []
    for n, (i, name, width) in enumerate(mm_sequence(model, moe), 1):
        if n % 2 and (i in ATTENTION_MMS) == attention:
            out.append(saved(f"mm.{i}", f"{name} output (bf16), matmul {n}", "attention" if attention else "MoE"
                             if moe else "MLP", f"{width} s b", "act", k22=False, src=src, tp=i in COLWISE,
                             **MODE_FLAGS[("selective-op",)]))
    return out


def cp_gathered_kv_mla(k_width: int, v_width: int) -> list[Term]:
    """Under context parallelism the whole sequence's K (a (d_n + d_r)) and V (a d_v, made contiguous) that
    torchtitan's apply_cp_to_forward all-gathers for FlexAttention, which saves them: in place of the rank's k and
    wkv_b's output (``cp_gathered``); measured on one rank of a fake cp group (validation/titan_dsv3_tp.py
    ``measure_dsv3_cp``).  As memplan/inventory/titan.py ``cp_gathered_kv``, MLA's K and V widths apart."""
    return [saved(f"cp.{w}_gathered", f"{w.upper()} of the whole sequence (bf16), all-gathered over cp for "
                  "FlexAttention", "attn", f"{n} cp s b", k22=False, src=CP_MEASURED, tp=True, needs_cp=True,
                  **MODE_FLAGS[("none",)]) for w, n in (("k", k_width), ("v", v_width))]


def _groups_terms() -> list[Term]:
    """The group-limited routing's topk outputs SelectiveAC saves (fp32 values: the scores plus the fp32 bias); under
    TP over the tokens the router sees (titan_moe.py TOKENS: all at ep 1, the rank's sequence shard at ep > 1)."""
    groups, limited = ROUTER_GROUPS
    return [saved(f"moe.group_{w}_{kind}", f"router group {what}{' (int64)' if kind == 'ids' else ' (fp32)'}", "MoE",
                  f"{n} s b", "int64" if kind == "ids" else "fp32", k22=False, src=DSV3_MEASURED,
                  **MODE_FLAGS[("selective-op",)], **TOKENS)
            for w, what, n in (("top2", "top-2 scores in each group: topk", 2 * groups),
                               ("choice", f"choice of {limited} groups: topk", limited))
            for kind in ("values", "ids")]


def dsv3_layer_terms(model: ModelSpec, device: str) -> tuple[Term, ...]:
    """One torchtitan DeepSeek-V3 layer's kept tensors (module docstring), the dense and MoE layers' weighted."""
    layer, dense_terms, moe_terms = dsv3_layer_parts(model, device)
    L, dense = model.num_layers, model.moe_first_dense_layers
    return (*layer, *(weighted(t, Fraction(dense, L), "dense") for t in dense_terms if dense),
            *(weighted(t, Fraction(L - dense, L), "moe") for t in moe_terms))


def dsv3_layer_parts(model: ModelSpec, device: str) -> tuple[list[Term], list[Term], list[Term]]:
    """``dsv3_layer_terms``' three parts unweighted: every layer's (the attention, the norms), a dense layer's
    feed-forward, an MoE layer's."""
    groups = ROUTER_GROUPS[0]
    if model.num_experts % groups or model.num_experts // groups < 2:
        raise MemplanError(f"torchtitan's DeepSeek-V3 router ({groups} expert groups, as its 671B flavour) needs the "
                           f"experts a multiple of {groups}, at least 2 a group (got {model.num_experts})")
    cuda = device == "cuda"
    src = DSV3_CUDA if cuda else DSV3_MEASURED
    a, dn, dr, dv = model.num_attention_heads, model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim
    llama3 = llama3_layer_terms(model.hidden_size, 1, 1, 1)
    base = [t for t in llama3 if t.id in ("input", "wo.rs") or t.id.startswith(("attention_norm.", "ffn_norm."))]
    latents = [("q_norm", model.q_lora_rank)] if model.q_lora_rank else []
    for which, r in latents + [("kv_norm", model.kv_lora_rank)]:
        base += [dataclasses.replace(t, id=t.id.replace("attention_norm", which), split="",
                                     name=t.name.replace("attention_norm", f"{which} (the {r}-wide latent)"))
                 for t in llama3_layer_terms(r, 1, 1, 1) if t.id.startswith("attention_norm.")]
    none, tp = ("none",), "tp"  # the heads' terms split over tp (the up projections colwise)
    base += [TitanTerm("mla.q", "q: nope and rotated rope parts concatenated (bf16)", 2 * a * (dn + dr), none, tp),
             TitanTerm("mla.k", "k: k_nope and the shared rotated k_pe expanded to the heads (bf16)",
                       2 * a * (dn + dr), none, tp, cp_gathered=True),
             TitanTerm("mla.wkv_b", "wkv_b output (bf16): v, a view of it, keeps it whole", 2 * a * (dn + dv), none,
                       tp, cp_gathered=True),
             rope_gathered(4 * dr, "complex64 d_r/2"),
             TitanTerm("attn.out", "attention output (bf16)", 2 * a * dv, ("none", "selective-op"), tp),
             TitanTerm("attn.lse", "attention log-sum-exp (fp32)", 4 * a, ("none", "selective-op"), tp),
             TitanTerm("attn.out_contiguous", "attention output made contiguous, wo's input (bf16)", 2 * a * dv,
                       none, tp)]
    layer = [titan_term(t, TP_SRC if t.tp_only else src) for t in (cuda_norm(base) if cuda else base)]
    layer += _mm_terms(model, False, True, src)
    layer += cp_gathered_kv_mla(a * (dn + dr), a * dv)
    w2_rs = next(t for t in llama3 if t.id == "w2.rs")  # TP: w2's output reduce-scattered, kept under selective-op
    dense_terms = [titan_term(t, TP_SRC if t.tp_only else src) for t in _ffn("", "", model.f) + [w2_rs]]
    dense_terms += _mm_terms(model, False, False, src)
    moe_terms = [dataclasses.replace(t, name=t.name.replace("softmax", "sigmoid")) for t in
                 titan_moe_terms(model, device)]  # the gate: recomputed, not counted (mm_sequence)
    shared = _ffn("shared.", "shared experts' ", model.moe_shared_ffn_hidden_size)
    shared.append(dataclasses.replace(w2_rs, id="shared.w2.rs", name="shared experts' w2 output reduce-scattered "
                                      "over the sequence (bf16), TP only"))
    moe_terms += [titan_term(t, TP_SRC if t.tp_only else src) for t in shared]
    moe_terms.append(saved("moe.input_sharded", "ffn_norm's own sequence-sharded output, the router's and the routed "
                           "experts' input (bf16; the shared experts keep their all-gathered copy), TP with EP only",
                           "MoE", f"{model.hidden_size} s b", k22=False, src=TP_SRC, sp=True, needs_tp=True,
                           needs_ep=True, **MODE_FLAGS[("none",)]))
    moe_terms += _mm_terms(model, True, False, src) + _groups_terms()
    return layer, dense_terms, moe_terms


def dsv3_inventory(model: ModelSpec, device: str) -> Inventory:
    """torchtitan's DeepSeek-V3 as an Inventory: ``dsv3_layer_terms`` in titan.py's frame (final norm, loss), with the
    layers' backward moments (memplan/inventory/titan_dsv3_moments.py), its MTP layers' terms on the last stage
    (memplan/inventory/titan_mtp.py)."""
    layer = dsv3_layer_terms(model, device)
    _, dense_terms, moe_terms = dsv3_layer_parts(model, device)
    inv = titan_inventory(model, device, layer, dsv3_layer_moments(model, device, layer, tuple(dense_terms),
                                                                  tuple(moe_terms)))
    return dataclasses.replace(inv, terms=inv.terms + tuple(mtp_terms(model, device, layer))) if model.mtp_layers else inv



def notes(model: ModelSpec) -> list[str]:
    """What the output says of a DeepSeek-V3 model under --impl torchtitan (nothing for another)."""
    return ([NOTE] + ([MTP_NOTE] if model.mtp_layers else [])) if is_dsv3(model) else []
