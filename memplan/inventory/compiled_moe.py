"""torch.compile on torchtitan 0.3.0's Qwen3 MoE block (``--impl torchtitan --compile`` on a Qwen3 MoE model, ep 1,
tp 1, cp 1): what AOTAutograd's partitioner saves for the backward of one compiled block, in place of what the eager
block saves (memplan/inventory/titan.py + titan_moe.py).

torchtitan's apply_compile compiles every TransformerBlock whole, the MoE ones too (``block.compile(fullgraph=True)``
after AC wraps it; ``capture_scalar_outputs`` on for the token dispatch).  The tables below are TRACED from the compiled
graph, not guessed: validation/compiled_moe.py builds torchtitan's own block (``_build_qwen3_moe_layers``, bf16, the
router's own top-k, the sdpa stand-in for FlexAttention), wraps it in torchtitan's AC, compiles it with torch 2.13's
inductor on CPU with dynamic s, b and reads the forward graph's outputs the backward takes (validation/compiled.py
``trace_compiled_layer``), each a polynomial in s, b and the widths; the routed copies are k s b rows.  The same
compiled block's bytes alive after its forward are measured with real tensors (tests/test_compiled_moe.py: h 40,
q 48, a 6, g 2, fe 24, E 10, k 4; s 20, b 2: 90,444 B under none, 16,004 B under selective-op, 8,580 B under full,
less the CPU generator state, against eager's 142,368 B under none). The block is called as torchtitan's Trainer
calls it, with the dataloader's positions (validation/titan.py ``loader_positions``): under none it saves CosSinRoPE's
cos and sin rows gathered at them (8d B per token, as the eager block keeps them); selective-op and full recompute
the gather (the block keeps the positions, which the training loop holds anyway).

What the partitioner changes against the eager MoE block (per token; k the top-k, bf16 = 2 B):
* none: as the dense compiled block (memplan/inventory/compiled.py), the norms keep only their fp32 rstd and bf16
  output, the residual sums are recomputed from the block input (kept) and wo's output; Qwen3's q_norm / k_norm keep
  their bf16 input and fp32 rstd (per head); the RoPE rows gathered at the positions (cos and sin, fp32 2d).  The MoE keeps the softmax scores (E), the top-k ids (int64 k), the
  gathered scores (k), the combine's normalised scores (bf16 k: route_norm's denominator and the fp32 top-k values
  are recomputed), the argsort and token indices (int64 2k), the routed copies (k h), the experts' w1, w3 outputs and
  their product (3 k fe; silu's output is recomputed), w2's output in bf16 (k h; eager keeps the combine's fp32 copy,
  4 k h), the zero buffer torchtitan's ``deterministic_scatter_add`` adds into (h: the custom op saves it); per layer
  the grouped GEMMs' int32 offsets (E) and route_scale as an fp32 scalar.
* selective-op (torchtitan's SelectiveAC, its shipped save list): the block input, wqkv's output (matmul 1), the
  attention's output and log-sum-exp, the top-k ids (int64 k) and the combine's scores (bf16 k), route_scale; the
  rest recomputed (eager SAC keeps topk's fp32 values besides, not its scores).
* full (FullAC, then compiled): the block input, and, besides eager's, the combine's scores (bf16 k) and route_scale
  (the partitioner saves them outside the recomputed region; measured).  The CPU generator state FullAC stashes per
  block (5,056 B on CPU, torch.get_rng_state) is CPU's and not modelled (as for the dense block).

Not traced, refused in one line (check_titan_moe): with --ep > 1 (the all-to-alls' data-dependent sizes, unbacked
under compile), --tp or --cp (the dense block's TP trace does not cover the MoE's gather).  DeepSeek-V3's blocks:
memplan/inventory/compiled_dsv3.py (the same constants, FLAGS).  With --pp the
saved set per block is the same (derived).  On CUDA the router runs under fp32 autocast: the scores and gathered
scores fp32 (derived, as titan_moe.py's CUDA_ROUTER; whether the partitioner keeps the gate input's fp32 copy is not
traced: left out).  The compiled block's backward moments: memplan/inventory/compiled_moe_moments.py.
"""

from __future__ import annotations

import dataclasses

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.inventory.types import Inventory, Term, saved

SRC = ("traced from torch.compile's partitioner on torchtitan 0.3.0's Qwen3 MoE block (torch 2.13, inductor on CPU, "
       "dynamic s, b; validation/compiled_moe.py) and measured after its forward (tests/test_compiled_moe.py)")
CUDA_SRC = ("derived: torch 2.13's CUDA autocast runs torchtitan's router in fp32 (traced on CPU in bf16), "
            "not measured")
PP_NOTE = "with --pp each stage's compiled blocks save the same set (derived)"

# (id, what, block, elements, dtype, AC modes it is kept in): the compiled block's saved storages in the forward
# graph's order (views of one storage counted once); "k" the model's top-k (bound in `compiled_moe_terms`), "act" the
# bf16 activation dtype; "router": bf16 on CPU, fp32 on CUDA (derived).  The hand derivation of the bytes per token
# at the test's widths (h 40, q 48, a 6, g 2 so q g /a 16, fe 24, E 10, k 4, d 8), none: 80 + 4 + 80 + 96 + 32 + 24 +
# 8 + 64 (the RoPE rows, 8d) + 96 + 32 + 32 + 24 + 96 + 80 + 4 + 80 (attention, norms, block input: 832) + 32 + 8 +
# 32 + 8 + 32 (the k-sized router and index tensors: 112) + 320 (routed copies) + 3 x 192 (w1, w3, product) + 320 (w2)
# + 80 (zeros) + 20 (scores) = 2,260 B, plus 40 + 4 B a layer (offsets, route_scale); selective-op 80 + 160 + 96 + 24
# + 32 + 8 = 400 B + 4 B; full 80 + 8 = 88 B + 4 B (tests/test_compiled_moe.py checks these against the measurement).
ALL, NONE, NONE_SEL, SEL = ("none", "selective-op", "full"), ("none",), ("none", "selective-op"), ("selective-op",)
TABLE = (
    ("block_input", "block input (bf16: the compiled backward recomputes the residual sums from it)", "layer norms",
     "s b h", "act", ALL),
    ("ln1_rstd", "attention_norm: rstd (fp32)", "layer norms", "s b", "fp32", NONE),
    ("qkv_input", "attention_norm's output (bf16) = input of wqkv", "attention", "s b h", "act", NONE),
    ("q_norm_input", "q before q_norm (bf16)", "attention", "s b q", "act", NONE),
    ("k_norm_input", "k before k_norm, g heads (bf16)", "attention", "s b g q /a", "act", NONE),
    ("q_norm_rstd", "q_norm: rstd per head (fp32)", "attention", "s b a", "fp32", NONE),
    ("k_norm_rstd", "k_norm: rstd per KV head (fp32)", "attention", "s b g", "fp32", NONE),
    ("rope_rows", "RoPE cos and sin rows gathered at the dataloader's positions (fp32 2d)", "attention",
     "2 s b q /a", "fp32", NONE),
    ("q", "rotated q (saved by sdpa)", "attention", "s b q", "act", NONE),
    ("k", "rotated k, g heads (saved by sdpa)", "attention", "s b g q /a", "act", NONE),
    ("v", "v, g heads, contiguous (saved by sdpa)", "attention", "s b g q /a", "act", NONE),
    ("qkv_out", "wqkv's output (bf16; matmul 1, saved by the selective-op policy)", "attention",
     "s b q + 2 s b g q /a", "act", SEL),
    ("sdpa_logsumexp", "attention log-sum-exp (fp32)", "attention", "s b a", "fp32", NONE_SEL),
    ("attn_out", "attention output = input of wo", "attention", "s b q", "act", NONE_SEL),
    ("o_proj_out", "wo's output (the residual sum is recomputed from it)", "attention", "s b h", "act", NONE),
    ("ln2_rstd", "ffn_norm: rstd (fp32)", "layer norms", "s b", "fp32", NONE),
    ("moe_input", "ffn_norm's output (bf16) = the router gate's input and the routed copies' source", "MoE",
     "s b h", "act", NONE),
    ("moe.scores", "router softmax scores (tokens x E)", "MoE", "E s b", "router", NONE),
    ("moe.topk_ids", "top-k expert ids (int64)", "MoE", "k s b", "int64", NONE_SEL),
    ("moe.topk_scores", "gathered top-k scores (route_norm's numerator)", "MoE", "k s b", "router", NONE),
    ("moe.route_scale", "route_scale as an fp32 scalar (a layer)", "MoE", "1", "fp32", ALL),
    ("moe.sort_idx", "argsort of the expert ids (int64)", "MoE", "k s b", "int64", NONE),
    ("moe.combine_scores", "normalised, scaled top-k scores in bf16 (combine's weights)", "MoE", "k s b", "act", ALL),
    ("moe.token_idx", "token index of each routed copy (int64)", "MoE", "k s b", "int64", NONE),
    ("moe.routed_input", "routed token copies, the grouped GEMMs' input", "MoE", "k s b h", "act", NONE),
    ("moe.offsets", "grouped GEMMs' offsets (int32, 4 B as fp32; a layer)", "MoE", "E", "fp32", NONE),
    ("moe.w1.out", "experts' w1 output (silu is recomputed from it)", "MoE", "k s b fe", "act", NONE),
    ("moe.w3.out", "experts' w3 output", "MoE", "k s b fe", "act", NONE),
    ("moe.swiglu.mul", "silu(w1) * w3 = input of w2", "MoE", "k s b fe", "act", NONE),
    ("moe.w2.out", "experts' w2 output (bf16)", "MoE", "k s b h", "act", NONE),
    ("moe.combine_zeros", "zero buffer torchtitan's deterministic_scatter_add adds into (saved by the custom op)",
     "MoE", "s b h", "act", NONE),
)
# memplan's recompute flags (memplan/inventory/types.py Term.kept) of a term kept in these AC modes
FLAGS = {ALL: dict(full=True), NONE: dict(sel=True), NONE_SEL: {}, SEL: dict(only_selective=True)}
TOKENLESS = ("moe.route_scale", "moe.offsets")


def compile_left(model: ModelSpec, ep: int, tp: int, cp: int) -> str:
    """What of a compiled MoE layout is not traced ("" when it is): check_titan_moe refuses it in one line."""
    if ep > 1 or tp > 1 or cp > 1:
        return ("--compile with --ep, --tp or --cp (the compiled Qwen3 MoE and DeepSeek-V3 blocks are traced at ep 1, "
                "tp 1, cp 1: memplan/inventory/compiled_moe.py, compiled_dsv3.py)")
    return ""


def check_compile(model: ModelSpec, impl: str, training) -> None:
    """--compile on an MoE model: torchtitan's Qwen3 MoE or DeepSeek-V3 block (memplan/inventory/compiled_dsv3.py
    checks its own), bf16 linears, no memory budget."""
    if impl != "torchtitan":
        raise MemplanError("--compile on an MoE model is traced for --impl torchtitan's Qwen3 MoE and DeepSeek-V3 "
                           "blocks only")
    if training.float8 or training.memory_budget is not None:
        raise MemplanError("--compile on torchtitan's MoE blocks is traced with bf16 linears and --ac none, full, "
                           "selective-layer or selective-op")


def compiled_moe_terms(model: ModelSpec, device: str) -> list[Term]:
    """The compiled Qwen3 MoE block's saved tensors (TABLE, k bound to the model's top-k)."""
    k = str(model.moe_top_k)
    router = "fp32" if device == "cuda" else "act"
    return [saved(id, what, block, elements.replace("k", k) if elements.startswith("k ") else elements,
                  router if dtype == "router" else dtype, k22=False,
                  src=CUDA_SRC if dtype == "router" and device == "cuda" else SRC, tokenless=id in TOKENLESS,
                  **FLAGS[modes])
            for id, what, block, elements, dtype, modes in TABLE]


def apply(inventory: Inventory, model: ModelSpec, device: str) -> Inventory:
    """The inventory with each layer's saved tensors the compiled MoE block's; the eager block's layer moments
    (memplan/inventory/titan_moments.py) are not the compiled one's: left out (memplan/inventory/compiled_moe_moments.py
    adds the compiled block's)."""
    kept = [t for t in inventory.terms if t.scope != "layer"]
    return dataclasses.replace(inventory, name=f"{inventory.name}/compiled",
                               terms=tuple(compiled_moe_terms(model, device) + kept),
                               moments=tuple(m for m in inventory.moments if m.scope != "layer"))


def notes(model: ModelSpec, training, pp: int = 1) -> list[str]:
    """What estimate says of a compiled MoE block."""
    if not (training.compile and model.is_moe):
        return []
    return [f"--compile on the Qwen3 MoE blocks: their saved tensors {SRC}; on CUDA the router's scores fp32 "
            "(derived); their backward's experts' moments measured on CPU from Inductor's generated backward "
            "(memplan/inventory/compiled_moe_moments.py; the attention's later moments, the CPU kernels' own scratch "
            "and CUDA's triton kernels not modelled)"
            + (f"; {PP_NOTE}" if pp > 1 else "")]
