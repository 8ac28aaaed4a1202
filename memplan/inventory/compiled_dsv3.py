"""torch.compile on torchtitan 0.3.0's DeepSeek-V3 blocks (``--impl torchtitan --compile`` on a DeepSeek-V3 model, ep
1, tp 1, cp 1): what AOTAutograd's partitioner saves for the backward of one compiled block, a dense first layer and an
MoE layer, in place of what the eager blocks save (memplan/inventory/titan_dsv3.py).

torchtitan's apply_compile compiles each DeepSeek-V3 block as Qwen3's (``block.compile(fullgraph=True)`` after AC
wraps it, ``capture_scalar_outputs`` on).  The tables below are TRACED from the compiled graph, not guessed:
validation/compiled_dsv3.py builds torchtitan's own blocks (``_build_dsv3_layers``: q latent, yarn ComplexRoPE, the
sigmoid router with expert groups, route_norm, route_scale, shared experts; bf16, the router's own top-k), wraps them
in torchtitan's AC, calls them with the dataloader's positions as its Trainer does (each block's RoPE gathers its
rows: traced, ``rope.gathered``), compiles them with torch 2.13's inductor on CPU with dynamic s, b and reads the
forward graph's saved tensors (validation/compiled.py ``trace_compiled_layer``), each a polynomial in s, b and the
widths; the same compiled blocks' bytes alive after the forward are measured with real tensors at two (s, b)
(tests/data/compiled_dsv3.json, tests/test_compiled_dsv3.py).

One stand-in: FlexAttention has no CPU backward; a custom op whose backward is the flash formula on q, k, v, out and
the log-sum-exp (the five torch's flex_attention_backward takes) stands in, so the partitioner keeps them as it keeps
the flex_attention HOP's: that save set on CUDA is DERIVED from torch 2.13's code.

What the partitioner changes against the eager blocks (per token): the norms keep their fp32 rstd and bf16 output only
(the latents' q_norm, kv_norm too), the residual sums are recomputed from the block input (kept) and wo's output;
wq_a's output (the q latent before q_norm) is kept, wkv_a's whole output (r_kv + d_r: the kv latent kv_norm takes is
a view of it), q and k as the two ``torch.cat`` make them, wkv_b's whole output (v is a view of it), the attention's
output, its lse and wo's contiguous input; RoPE's rows gathered at the positions (complex64 d_r / 2).  Dense layers:
w1's, w3's outputs and their product (silu recomputed).  MoE layers: the gate's scores (E), the top-k ids, route_norm's
denominator (1), the normalised scores (k), the combine's scores (k, bf16), the argsort and token indices (int64
2k), the routed copies (k h), the experts' w1, w3 outputs and product (3 k f_e), w2's (k h), the combine's zero
buffer (h), the shared experts' w1, w3 outputs and product (3 f_s); per layer route_scale (fp32 scalar) and the
grouped GEMMs' int32 offsets (E).  Selective-op keeps, besides the block input, the policy's odd matmuls the
backward uses (wq_a 1, wkv_a 3, wo 5, and w3: the dense layer's 7, the shared experts' in an MoE layer), the
attention's output and lse, the top-k ids and the combine's scores; eager SAC's group-limited topk outputs are NOT
saved (the backward does not use them).  Full: the block input, an MoE layer's combine scores and route_scale.
The positions tensor (a batch input, saved by the recomputing modes) is not counted, as eager.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.inventory.compiled_moe import ALL, CUDA_SRC, FLAGS, NONE, NONE_SEL, PP_NOTE
from memplan.inventory.moe import weighted
from memplan.inventory.types import Inventory, Term, saved

SRC = ("traced from torch.compile's partitioner on torchtitan 0.3.0's DeepSeek-V3 blocks called with the dataloader's "
       "positions (torch 2.13, inductor on CPU, dynamic s, b; validation/compiled_dsv3.py) and measured after their "
       "forward at two shapes (tests/test_compiled_dsv3.py); FlexAttention's save set (q, k, v, out, lse) derived")

# (id, what, part, block, elements, dtype, AC modes it is kept in): the compiled blocks' saved storages (a view's
# whole storage: the kv latent's wkv_a output, v's wkv_b output; measured), "layer" in every block, "dense" a dense
# first layer's, "moe" an MoE layer's; widths: rq, rkv the latents, dn, dr, dv the head widths, dqk = dn + dr,
# dkv = dn + dv, rkvr = rkv + dr, fs the shared experts' FFN; "router" bf16 on CPU, fp32 on CUDA (derived).
# The hand derivation at the test's widths (validation/compiled_dsv3.py SHAPE: h 56, a 5, rq 34, rkv 44, dn 10, dr 18,
# dv 11, f 80, fe 32, fs 96, E 24, k 7; so dqk 28, dkv 21, rkvr 62), bytes per token, none: every block 112 + 4 + 112
# + 68 + 4 + 68 + 124 + 4 + 88 + 280 + 280 + 210 + 110 + 112 + 4 + 112 + 110 + 20 + 72 = 1,894; a dense layer's
# 3 x 160 = 480 (2,374); an MoE layer's 48 + 56 + 2 + 14 + 56 + 14 + 56 + 784 + 3 x 448 + 784 + 112 + 3 x 192 = 3,846
# (5,740) + 4 + 96 B a layer; selective-op 112 + 68 + 124 + 112 + 110 + 20 = 546, + 160 (dense: 706) or
# + 56 + 14 + 192 (MoE: 808) + 4 B; full 112 (dense), 112 + 14 + 4 B (MoE) (tests/test_compiled_dsv3.py checks these
# against the inductor measurements at s 20, b 2 and s 12, b 4).
TABLE = (
    ("block_input", "block input (bf16: the residual sums are recomputed from it)", "layer", "layer norms", "s b h",
     "act", ALL),
    ("ln1_rstd", "attention_norm: rstd (fp32)", "layer", "layer norms", "s b", "fp32", NONE),
    ("attn_input", "attention_norm's output (bf16) = input of wq_a and wkv_a", "layer", "attention", "s b h", "act",
     NONE),
    ("wq_a.out", "wq_a's output, the q latent (bf16; matmul 1 under selective-op)", "layer", "attention", "s b rq",
     "act", NONE_SEL),
    ("q_norm_rstd", "q_norm: rstd (fp32)", "layer", "attention", "s b", "fp32", NONE),
    ("q_norm_out", "q_norm's output (bf16) = input of wq_b", "layer", "attention", "s b rq", "act", NONE),
    ("wkv_a.out", "wkv_a's whole output (bf16; kv_norm's input a view of it; matmul 3 under selective-op)", "layer",
     "attention", "s b rkvr", "act", NONE_SEL),
    ("kv_norm_rstd", "kv_norm: rstd (fp32)", "layer", "attention", "s b", "fp32", NONE),
    ("kv_norm_out", "kv_norm's output (bf16) = input of wkv_b", "layer", "attention", "s b rkv", "act", NONE),
    ("q", "q: nope and rotated rope parts concatenated (bf16)", "layer", "attention", "s b a dqk", "act", NONE),
    ("k", "k: k_nope and the shared rotated k_pe expanded (bf16)", "layer", "attention", "s b a dqk", "act", NONE),
    ("wkv_b.out", "wkv_b's whole output (bf16; the attention's v a view of it)", "layer", "attention", "s b a dkv",
     "act", NONE),
    ("attn_out_contiguous", "attention output made contiguous, wo's input (bf16)", "layer", "attention", "s b a dv",
     "act", NONE),
    ("wo.out", "wo's output (bf16; the residual sum is recomputed from it; matmul 5 under selective-op)", "layer",
     "attention", "s b h", "act", NONE_SEL),
    ("ln2_rstd", "ffn_norm: rstd (fp32)", "layer", "layer norms", "s b", "fp32", NONE),
    ("ffn_input", "ffn_norm's output (bf16) = the FFN's / the router's and experts' input", "layer", "layer norms",
     "s b h", "act", NONE),
    ("attn.out", "attention output (bf16; saved by FlexAttention, derived)", "layer", "attention", "s b a dv", "act",
     NONE_SEL),
    ("attn.lse", "attention log-sum-exp (fp32; saved by FlexAttention, derived)", "layer", "attention", "s b a",
     "fp32", NONE_SEL),
    ("rope.gathered", "RoPE cache rows gathered at the dataloader's positions (complex64 d_r/2, as fp32 d_r)", "layer",
     "attention", "s b dr", "fp32", NONE),
    ("w1.out", "w1's output (silu is recomputed from it)", "dense", "MLP", "s b f", "act", NONE),
    ("w3.out", "w3's output (matmul 7 under selective-op)", "dense", "MLP", "s b f", "act", NONE_SEL),
    ("swiglu.mul", "silu(w1) * w3 = input of w2", "dense", "MLP", "s b f", "act", NONE),
    ("moe.scores", "router gate's output (tokens x E; the sigmoid is recomputed)", "moe", "MoE", "s b E", "router",
     NONE),
    ("moe.topk_ids", "top-k expert ids (int64)", "moe", "MoE", "s b k", "int64", NONE_SEL),
    ("moe.denominator", "route_norm's denominator", "moe", "MoE", "s b", "router", NONE),
    ("moe.topk_norm", "route_norm's normalised top-k scores", "moe", "MoE", "s b k", "router", NONE),
    ("moe.route_scale", "route_scale as an fp32 scalar (a layer)", "moe", "MoE", "1", "fp32", ALL),
    ("moe.sort_idx", "argsort of the expert ids (int64)", "moe", "MoE", "s b k", "int64", NONE),
    ("moe.combine_scores", "the scaled top-k scores in bf16 (combine's weights)", "moe", "MoE", "s b k", "act", ALL),
    ("moe.token_idx", "token index of each routed copy (int64)", "moe", "MoE", "s b k", "int64", NONE),
    ("moe.routed_input", "routed token copies, the grouped GEMMs' input", "moe", "MoE", "s b k h", "act", NONE),
    ("moe.offsets", "grouped GEMMs' offsets (int32, 4 B as fp32; a layer)", "moe", "MoE", "E", "fp32", NONE),
    ("moe.w1.out", "experts' w1 output (silu is recomputed from it)", "moe", "MoE", "s b k fe", "act", NONE),
    ("moe.w3.out", "experts' w3 output", "moe", "MoE", "s b k fe", "act", NONE),
    ("moe.swiglu.mul", "silu(w1) * w3 = input of the experts' w2", "moe", "MoE", "s b k fe", "act", NONE),
    ("moe.w2.out", "experts' w2 output (bf16)", "moe", "MoE", "s b k h", "act", NONE),
    ("moe.combine_zeros", "zero buffer torchtitan's deterministic_scatter_add adds into", "moe", "MoE", "s b h", "act",
     NONE),
    ("shared.w1.out", "shared experts' w1 output (silu is recomputed from it)", "moe", "MoE", "s b fs", "act", NONE),
    ("shared.w3.out", "shared experts' w3 output (matmul 7 under selective-op)", "moe", "MoE", "s b fs", "act",
     NONE_SEL),
    ("shared.swiglu.mul", "shared experts' silu(w1) * w3", "moe", "MoE", "s b fs", "act", NONE),
)
TOKENLESS = ("moe.route_scale", "moe.offsets")


def widths(model: ModelSpec) -> dict[str, int]:
    """The table's symbols bound to ``model``'s widths (h, a, f kept as memplan's own symbols)."""
    dn, dr, dv, rkv = model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim, model.kv_lora_rank
    return dict(rq=model.q_lora_rank, rkv=rkv, dr=dr, dv=dv, dqk=dn + dr, dkv=dn + dv, rkvr=rkv + dr,
                fe=model.fe, fs=model.moe_shared_ffn_hidden_size, E=model.num_experts,
                k=model.moe_top_k, a=model.num_attention_heads)


def bind(elements: str, values: dict[str, int]) -> str:
    """``elements`` with the MLA's and the MoE's widths as numbers ("s b a dqk" -> "1536 s b")."""
    n, rest = 1, []
    for sym in elements.split():
        if sym in values:
            n *= values[sym]
        elif sym.isdigit():
            n *= int(sym)
        else:
            rest.append(sym)
    return " ".join(([str(n)] if n != 1 or not rest else []) + rest)


def compiled_dsv3_parts(model: ModelSpec, device: str) -> dict[str, list[Term]]:
    """The compiled blocks' saved tensors by part ("layer", "dense", "moe"), unweighted."""
    values = widths(model)
    parts: dict[str, list[Term]] = {"layer": [], "dense": [], "moe": []}
    for id, what, part, block, elements, dtype, modes in TABLE:
        cuda_router = dtype == "router" and device == "cuda"
        parts[part].append(saved(id, what, block, bind(elements, values), "fp32" if cuda_router else
                                 "act" if dtype == "router" else dtype, k22=False,
                                 src=CUDA_SRC if cuda_router else SRC, tokenless=id in TOKENLESS, **FLAGS[modes]))
    return parts


def compiled_dsv3_terms(model: ModelSpec, device: str) -> list[Term]:
    """Every layer's terms, a dense layer's weighted n_dense / L, an MoE layer's (L - n_dense) / L (as
    memplan/inventory/titan_dsv3.py weighs the eager blocks'; tagged with their kind for --pp)."""
    parts = compiled_dsv3_parts(model, device)
    L, dense = model.num_layers, model.moe_first_dense_layers
    return (parts["layer"] + [weighted(t, Fraction(dense, L), "dense") for t in parts["dense"] if dense]
            + [weighted(t, Fraction(L - dense, L), "moe") for t in parts["moe"]])


def check(model: ModelSpec) -> None:
    """The traced kind: the q latent (torchtitan's 671B flavour; the debug and 16B flavours' single wq not traced)."""
    if not model.q_lora_rank:
        raise MemplanError("--compile with DeepSeek-V3 is traced with the q latent (q_lora_rank > 0, torchtitan's "
                           "671B flavour); this model has none")


def apply(inventory: Inventory, model: ModelSpec, device: str) -> Inventory:
    """The inventory with each layer's saved tensors the compiled blocks'; the eager blocks' layer moments
    (memplan/inventory/titan_dsv3_moments.py) are not the compiled ones': left out (the backward is not traced)."""
    kept = [t for t in inventory.terms if t.scope != "layer"]
    return dataclasses.replace(inventory, name=f"{inventory.name}/compiled",
                               terms=tuple(compiled_dsv3_terms(model, device) + kept),
                               moments=tuple(m for m in inventory.moments if m.scope != "layer"))


def notes(pp: int = 1) -> list[str]:
    """What estimate says of compiled DeepSeek-V3 blocks."""
    return [f"--compile on the DeepSeek-V3 blocks (a dense first layer, an MoE layer): their saved tensors {SRC}; on "
            "CUDA the router's scores fp32 (derived); the compiled blocks' backward transients and Inductor's "
            "kernels' own buffers not modelled" + (f"; {PP_NOTE}" if pp > 1 else "")]
