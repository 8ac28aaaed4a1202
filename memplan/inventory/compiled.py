"""torch.compile per decoder layer (`--compile`; --impl hf-sdpa: transformers' Llama layout, --impl torchtune: its
Llama, as its recipes' compile_model compiles each layer, --impl torchtitan: its Llama 3 block, as apply_compile
compiles each, --ac none / full / selective-layer / selective-op): what AOTAutograd's partitioner saves for the
backward of one compiled layer, in place of what the eager layer saves. With a layer checkpointed (full AC), the
compiled layer keeps its input only, as the eager one (derived).

The tables below are TRACED from the compiled graph, not guessed: validation/compiled.py compiles one transformers
5.23 LlamaDecoderLayer (sdpa, bf16), one torchtune 0.6.1 TransformerSelfAttentionLayer (llama3_2 builder) or one
torchtitan 0.3.0 Llama 3 block (validation/titan.py: sdpa standing in for FlexAttention, which has no CPU backward)
with torch 2.13's inductor on CPU (dynamic s and b) and reads the forward graph's
outputs that the backward takes (inductor's min_cut_rematerialization_partition, torch._functorch.partitioners),
each shape as a polynomial in s, b and the config's widths; the same compiled layer's bytes alive after its forward
are measured with torch.profiler's allocation events and equal the table's (tests/test_compile.py: 1,692 B per token
for h 60, f 154, a 6, g 2, head 8, vs 2,480 B eager; torchtune's at h 48: 1,724 B vs 2,608 B eager; torchtitan's
at h 48, called with the dataloader's positions: 1,628 B vs 2,512 B eager;
MEMPLAN_COMPILE_SLOW=1 runs inductor, torchtune and torchtitan, the suite runs transformers' layer through AOTAutograd with
inductor's partitioner and decompositions, no C++).

What the partitioner changes (per token, bf16 = 2 B): the RMSNorms keep only their fp32 rstd and their bf16 output
(the fp32 copy of the input and the fp32 normalised tensor are recomputed), SiLU's output is recomputed from the
gate, the residual sums are recomputed from the layer input and o_proj's output, so the layer keeps its own input
(eager frees it) and o_proj's output. sdpa keeps Q, K, V, its output and log-sum-exp as eager does (torchtune's K
and V expanded to all heads, as eager).

torchtitan's blocks are traced and measured as its Trainer calls them, with the dataloader's positions
(validation/titan.py ``loader_positions``: torchtitan 0.3.0 always passes them): each block's RoPE gathers its cache
rows at them (models/common/rope.py ``_reshape_for_broadcast``), and the compiled block without AC saves that gathered
copy (``rope_rows``: complex64 d/2, 4d B per token, as eager keeps it); called without positions it saves no RoPE
row (the buffer's prefix is a graph input). Selective-op and every memory budget below 1 recompute the gather (the
positions, a batch input the training loop holds, are what such a block keeps of it).

torchtitan's block under its per-op selective AC (``--ac selective-op``: torchtitan wraps each block in SelectiveAC,
create_selective_checkpoint_contexts with its save list and every-other-matmul policy, then compiles it), traced
and measured the same way (validation/compiled.py ``trace_compiled_layer(ac="selective-op")``, the CPU attention
kernel added to the save list for FlexAttention as validation/titan.py does): the partitioner keeps the block input,
the fused QKV linear's output (matmul 1), the attention output and log-sum-exp and w1's output (matmul 3), TITAN_SAC;
w2's output (matmul 5), which eager SAC keeps in its cache, is not saved (the backward does not use it); wo, w3
(matmuls 2, 4), the norms, RoPE and SwiGLU are recomputed. Measured after the forward at s 20, b 2 (h 48, f 154, a 6,
g 2): 684 B per token against eager SelectiveAC's 780 B (tests/test_compile.py); for llama3-8b 2h less per token.
The layers' backward (the recomputed tensors alive in it) is memplan's recompute working set (derived).

torchtitan's compiled block under TP (``--compile --tp T``, sequence parallel, DTensor): torchtitan's own
parallelize_llama then apply_compile on 2 ranks over gloo (validation/titan_tp_compile.py; AOTAutograd with inductor's
partitioner; the model called with the dataloader's positions): the forward graph of each rank saves TITAN_LAYER's
set (selective-op: TITAN_SAC's plus wo's reduce-scattered output), each term split per TITAN_TP_SPLIT (one table, its split: tests/test_titan_tp.py); under
TP, AC none, the residual sum after attention is saved in place of the block input (as many bytes). ``--ac full``
with compile and TP is derived (the block's sequence-sharded input, as eager FullAC under TP): torch 2.13 stops it
(FULL_TP_ERROR). Budget AC with TP and compile with CP are not traced (refused).

torchtitan's memory-budget AC (``--ac budget:F --compile``: MemoryBudgetAC sets activation_memory_budget = F): the
partitioner's knapsack keeps a subset of TITAN_LAYER that depends on the widths, so it is traced at the real Llama 3
8B / 70B / 405B widths (validation/budget.py, under FakeTensorMode, the block called with the dataloader's
positions; BUDGET_SAVED, F in tenths: at every F below 1 the knapsack recomputes the RoPE gather, at 1 it saves the
rows as the plain compiled block); what it recomputes is traced from the same graphs and timed
(memplan/inventory/budget_recompute.py), not counted as a working set.

torchtitan's block with torchao's float8 linears (``--float8``, memplan/inventory/titan_float8.py), traced and
measured the same way (validation/compiled.py ``trace_compiled_layer(float8=...)``, h 48, f 160 so that every linear
is converted): the partitioner no longer saves the two norms' bf16 outputs nor SwiGLU's product (2h + 2h + 2f per
token: it recomputes them, as each float8 linear's backward casts its input again); tensorwise also keeps one bf16
amax and one fp32 scale scalar per float8 linear; the RoPE rows gathered at the positions are saved as in the bf16
block. Measured after the forward at s 28, b 5: 1,152 B per token (rowwise; + 30 B tensorwise) against the bf16
compiled block's 1,664 B (tests/test_titan_float8.py).

torchtune's LoRA layer (`--lora R` with `--impl torchtune`, its lora_llama3_2 layer, only the adapters trainable) compiled
keeps the table's tensors that the adapters' and the input gradients need and each target's A output (s b r): what
memplan/inventory/lora.py makes of the table (traced with the recipes' targets and with q, v only, and measured:
tests/test_compile.py); with `--qlora` (torchao NF4) the partitioner also saves every NF4 linear's dequantised bf16
weight (lora.py's qlora_dequantized_weights). Not traced: LoRA dropout, a whole (unchunked) loss (the LoRA recipe
compiles it: refused).

Left out, said in the output: Inductor's fused backward kernels' own buffers (not traced); the backward's moments
are eager transformers' measured ones (the matmul and sdpa gradients run the same kernels), with the compiled
layer's saved tensors (derived). Traced with CPU's sdpa kernel; a CUDA estimate uses the same list (derived:
without dropout CUDA's flash / efficient sdpa also keeps Q, K, V, its output and the fp32 log-sum-exp).
"""

from __future__ import annotations

import dataclasses

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.core.training import Recompute
from memplan.inventory import compiled_qwen3
from memplan.inventory.compiled_moments import SRC as MOMENTS_SRC, compiled_titan_moments
from memplan.inventory.compiled_qwen3_moments import compiled_qwen3_moments
from memplan.inventory.hf import hf_layer_moments
from memplan.inventory.titan import is_qwen3_dense
from memplan.inventory.titan_float8 import converted_linears
from memplan.inventory.tune_loss import EAGER_SAVED, compiled_loss_terms, tune_chunked_backward, tune_loss_forward
from memplan.inventory.types import Inventory, Term, saved

SRC = "traced from torch.compile's partitioner (torch 2.13, inductor on CPU; validation/compiled.py)"
TP_SRC = ("measured per rank: torchtitan's parallelize_llama (DTensor TP, sequence parallel) then apply_compile, "
          "AOTAutograd with inductor's partitioner, 2 ranks over gloo (validation/titan_tp_compile.py)")
INFO = ("--compile (--impl hf-sdpa / torchtune / torchtitan, Llama layout): each decoder layer torch.compile'd; its saved tensors "
        + SRC + "; the backward's transients, where modelled: the eager layer's moments (derived; Inductor's fused "
        "kernels' own buffers left out)")

# (id, what, block, elements, dtype): the compiled layer's saved storages in the forward graph's order (views of one
# storage counted once); "act" is the bf16 activation dtype. The rotary cos / sin tables (graph inputs, shared by the
# layers) are kept as in eager (hf.py's rope_cos / rope_sin, once per model chunk).
LAYER = (
    ("layer_input", "layer input (bf16: the compiled backward recomputes the residual sums from it)", "layer norms",
     "s b h", "act"),
    ("ln1_rstd", "input_layernorm: rstd (fp32)", "layer norms", "s b", "fp32"),
    ("qkv_input", "input_layernorm's output = input of q_proj, k_proj, v_proj", "attention", "s b h", "act"),
    ("v", "V, g heads (v_proj's output, saved by sdpa)", "attention", "s b g q /a", "act"),
    ("q", "Q after rotary (saved by sdpa)", "attention", "s b q", "act"),
    ("k", "K after rotary, g heads (saved by sdpa)", "attention", "s b g q /a", "act"),
    ("sdpa_logsumexp", "sdpa log-sum-exp per row and head (fp32)", "attention", "s b a", "fp32"),
    ("attn_out", "sdpa output = input of o_proj", "attention", "s b q", "act"),
    ("o_proj_out", "o_proj's output (the residual sum is recomputed from it)", "attention", "s b h", "act"),
    ("ln2_rstd", "post_attention_layernorm: rstd (fp32)", "layer norms", "s b", "fp32"),
    ("mlp_input", "post_attention_layernorm's output = input of gate_proj and up_proj", "MLP", "s b h", "act"),
    ("silu_input", "gate_proj's output (SiLU is recomputed from it)", "MLP", "s b f", "act"),
    ("up_out", "up_proj's output", "MLP", "s b f", "act"),
    ("fc2_input", "SiLU(gate) * up = input of down_proj", "MLP", "s b f", "act"),
)

TUNE_LAYER = (
    ("layer_input", "layer input (bf16: the compiled backward recomputes the residual sums from it)", "layer norms",
     "s b h", "act"),
    ("ln1_rstd", "sa_norm: rstd (fp32)", "layer norms", "s b", "fp32"),
    ("qkv_input", "sa_norm's output (bf16) = input of q_proj, k_proj, v_proj", "attention", "s b h", "act"),
    ("q", "Q after RoPE (saved by sdpa)", "attention", "s b q", "act"),
    ("k", "K after RoPE, expanded to a heads (saved by sdpa)", "attention", "s b q", "act"),
    ("v", "V expanded to a heads (saved by sdpa)", "attention", "s b q", "act"),
    ("sdpa_logsumexp", "sdpa log-sum-exp per row and head (fp32)", "attention", "s b a", "fp32"),
    ("attn_out", "sdpa output = input of output_proj", "attention", "s b q", "act"),
    ("o_proj_out", "output_proj's output (the residual sum is recomputed from it)", "attention", "s b h", "act"),
    ("ln2_rstd", "mlp_norm: rstd (fp32)", "layer norms", "s b", "fp32"),
    ("mlp_input", "mlp_norm's output (bf16) = input of w1 and w3", "MLP", "s b h", "act"),
    ("silu_input", "w1's output (SiLU is recomputed from it)", "MLP", "s b f", "act"),
    ("up_out", "w3's output", "MLP", "s b f", "act"),
    ("fc2_input", "SiLU(w1 x) * w3 x = input of w2", "MLP", "s b f", "act"),
)
TITAN_LAYER = (
    ("layer_input", "block input (bf16: the compiled backward recomputes the residual sums from it; under TP, AC "
     "none, the residual sum after attention in its place, as many bytes)", "layer norms", "s b h", "act"),
    ("ln1_rstd", "attention_norm: rstd (fp32)", "layer norms", "s b", "fp32"),
    ("qkv_input", "attention_norm's output (bf16) = input of the fused QKV linear", "attention", "s b h", "act"),
    ("q", "rotated q (saved by sdpa)", "attention", "s b q", "act"),
    ("k", "rotated k, g heads (saved by sdpa)", "attention", "s b g q /a", "act"),
    ("v", "v, g heads, contiguous (saved by sdpa)", "attention", "s b g q /a", "act"),
    ("sdpa_logsumexp", "attention log-sum-exp (fp32)", "attention", "s b a", "fp32"),
    ("attn_out", "attention output = input of wo", "attention", "s b q", "act"),
    ("o_proj_out", "wo's output (the residual sum is recomputed from it)", "attention", "s b h", "act"),
    ("ln2_rstd", "ffn_norm: rstd (fp32)", "layer norms", "s b", "fp32"),
    ("mlp_input", "ffn_norm's output (bf16) = input of w1 and w3", "MLP", "s b h", "act"),
    ("silu_input", "w1's output (SiLU is recomputed from it)", "MLP", "s b f", "act"),
    ("up_out", "w3's output", "MLP", "s b f", "act"),
    ("fc2_input", "silu(w1) * w3 = input of w2", "MLP", "s b f", "act"),
    ("rope_rows", "RoPE cache rows gathered at the dataloader's positions (complex64 d/2, as fp32; the rotation's "
     "backward multiplies by them)", "attention", "s b q /a", "fp32"),
)
TABLES = {"hf-sdpa": LAYER, "torchtune": TUNE_LAYER, "torchtitan": TITAN_LAYER}
# torchtitan's block in its SelectiveAC (--ac selective-op), then compiled: the partitioner saves, besides the block
# input, the outputs of the policy's MUST_SAVE ops that the backward needs (the fused QKV linear, matmul 1; the
# attention op; w1, matmul 3; not w2, matmul 5: its output is only the residual sum's) and recomputes everything the
# policy marks PREFER_RECOMPUTE (the norms, RoPE, wo and w3, SwiGLU). Traced and measured (module docstring).
TITAN_SAC = (
    TITAN_LAYER[0],
    ("qkv_out", "fused QKV linear's output (bf16; matmul 1, saved by the selective-op policy)", "attention",
     "s b q + 2 s b g q /a", "act"),
    *(row for row in TITAN_LAYER if row[0] in ("sdpa_logsumexp", "attn_out", "silu_input")),
)
# torchtitan's compiled block under TP (--tp T, sequence parallel, DTensor; measured per rank over gloo, 2 ranks:
# validation/titan_tp_compile.py, tests/test_titan_tp.py): the same saved set, each term on a rank split "tp" (heads,
# FFN columns: / t), "sp" (sequence-sharded: / t) or kept whole (""); the norm outputs are saved all-gathered over the
# sequence (the colwise linears' input), wo's output reduce-scattered. The residual row: under TP the partitioner saves
# the residual sum after attention (x + wo's output) in place of the block input (the reduce-scatter sits between
# them), as many bytes; under selective-op the block input itself. The RoPE rows gathered at the positions are whole
# on each rank (the attention runs on the all-gathered sequence, the positions are not sharded over tp).
TITAN_TP_SPLIT = {"layer_input": "sp", "ln1_rstd": "sp", "qkv_input": "", "q": "tp", "k": "tp", "v": "tp",
                  "sdpa_logsumexp": "tp", "attn_out": "tp", "o_proj_out": "sp", "ln2_rstd": "sp", "mlp_input": "",
                  "silu_input": "tp", "up_out": "tp", "fc2_input": "tp", "qkv_out": "tp", "wo_rs": "sp",
                  "rope_rows": ""}
# selective-op under TP also saves wo's reduce-scattered output (its save list holds reduce_scatter_tensor; w2's is
# not saved: the backward does not use it), a TP-only term
TITAN_SAC_TP = (("wo_rs", "wo's output reduce-scattered over the sequence (bf16; TP only, selective-op's save list)",
                 "attention", "s b h", "act"),)
SAC_IDS = frozenset(row[0] for row in TITAN_SAC + TITAN_SAC_TP)
# torchtitan's MemoryBudgetAC (--ac budget:F): the TITAN_LAYER rows the partitioner saves at F = 0, 0.1, ..., 1 (by
# tenths), traced at the Llama 3 8B, 70B and 405B widths (BUDGET_WIDTHS) at s 2,048, 8,192 and 32,768 with
# validation/budget.py (the real-size block compiled under FakeTensorMode, called with the dataloader's positions;
# torch's knapsack, flops estimator): the same set at each of the nine. F = 1 is the plain compiled block
# (TITAN_LAYER, the RoPE rows gathered at the positions included), F = 0 its input only; below 1 the gather is
# recomputed (re-traced with the positions: the same sets as traced without them, but F = 1's rope_rows).
_B7 = "layer_input ln1_rstd q k v sdpa_logsumexp attn_out o_proj_out ln2_rstd silu_input up_out"
BUDGET_SAVED = ("layer_input", "layer_input q k v", "layer_input q k v o_proj_out", "layer_input q k v silu_input",
                "layer_input q k v o_proj_out silu_input", "layer_input q k v silu_input up_out",
                "layer_input ln1_rstd q k v o_proj_out ln2_rstd silu_input up_out", _B7, _B7, _B7,
                " ".join(row[0] for row in TITAN_LAYER))
BUDGET_WIDTHS = {(4096, 32, 8, 14336), (8192, 64, 8, 28672), (16384, 128, 8, 53248)}  # (h, a, g, f)
BUDGET_SRC = ("traced from torch.compile's partitioner at torchtitan's memory budget (torch 2.13, the Llama 3 8B / "
              "70B / 405B widths at s 2,048, 8,192, 32,768: the same set at each; validation/budget.py)")
# torchtitan with float8 linears (module docstring): TITAN_LAYER without these, plus tensorwise's scalars (one of each
# per float8 linear, each its own storage)
FLOAT8_RECOMPUTED = ("qkv_input", "mlp_input", "fc2_input")
FLOAT8_SCALARS = (("float8_amax", "tensorwise casts' amax (bf16 scalars, one per float8 linear)", "act"),
                  ("float8_scale", "tensorwise casts' scales (fp32 scalars, one per float8 linear)", "fp32"))

MLP = ("ln2_rstd", "mlp_input", "silu_input", "up_out", "fc2_input", "o_proj_out")
# the saved tensors each of hf.py's three layer moments (fc2, MLP, attention backward) no longer holds
FREED = ((), ("fc2_input",), MLP + ("attn_out",))
MOMENTS = ("derived: the eager layer's backward moment (transformers' measured one) with the compiled layer's saved "
           "tensors; Inductor's fused kernels' own buffers left out (not traced)")


def check_budget(model: ModelSpec, impl: str, training) -> None:
    """torchtitan's memory-budget AC: compiled, its Llama 3 widths (the partitioner's knapsack depends on them),
    bf16 linears, nothing checkpointed."""
    if training.memory_budget is None:
        return
    if impl != "torchtitan" or not training.compile:
        raise MemplanError("--ac budget:F is torchtitan's MemoryBudgetAC, which needs the blocks compiled: "
                           "--impl torchtitan with --compile")
    if training.float8 or training.recompute != Recompute.NONE:
        raise MemplanError("--ac budget:F is traced with bf16 linears and no other AC: drop --float8")
    widths = (model.hidden_size, model.num_attention_heads, model.g, model.f)
    if widths not in BUDGET_WIDTHS or model.q != model.hidden_size:
        raise MemplanError("--ac budget:F is traced at the Llama 3 8B, 70B and 405B widths (the partitioner's choice "
                           "depends on them); this model's are not")


def check_compile(model: ModelSpec, impl: str, training) -> None:
    """--compile is traced for transformers' (sdpa) and torchtune's Llama layer and torchtitan's Llama 3 and dense
    Qwen3 blocks, nothing else changing the layer."""
    if impl == "torchtitan" and training.recompute == Recompute.SELECTIVE and training.float8:
        raise MemplanError("--compile --float8 with --ac selective-op is not traced yet (the partitioner under "
                           "torchtitan's save list with float8 linears): --ac none, full or selective-layer")
    qwen3 = impl == "torchtitan" and is_qwen3_dense(model)  # its dense Qwen3 block (memplan/inventory/compiled_qwen3.py)
    if qwen3:
        compiled_qwen3.check(training)
    if not qwen3 and (impl not in TABLES or model.inventory is not None or model.is_moe or model.is_mla):
        raise MemplanError("--compile is traced for --impl hf-sdpa, torchtune and torchtitan with the Llama layout "
                           "and torchtitan's dense Qwen3 (their own code, not a traced inventory)")
    if not (model.norm == "rmsnorm" and model.mlp == "swiglu") or model.dropout or model.bias:
        raise MemplanError("--compile is traced for the Llama layout (RMSNorm, SwiGLU, no biases, no dropout)")
    if training.lora_rank and impl == "torchtune":
        _check_tune_lora(training)
    others = [name for name, on in (("--liger", training.liger),
                                    ("--lora", training.lora_rank and impl != "torchtune"),
                                    ("--fp8", training.fp8), ("--mst", training.mst != 1),
                                    ("--batch-layout", training.batch_layout != "full"),
                                    ("--checkpoint-reentrant", training.checkpoint_reentrant)) if on]
    if others:
        raise MemplanError(f"--compile is traced for the plain layer: drop {others[0]}")


def _check_tune_lora(training) -> None:
    """torchtune's LoRA layer compiled is traced without dropout, with its chunked loss (its LoRA recipe compiles a
    whole loss, which is not measured)."""
    if training.lora_dropout:
        raise MemplanError("--compile with --lora-dropout is not traced (the partitioner's dropout masks): "
                           "--lora-dropout 0, as torchtune's Llama 3 LoRA configs")
    if training.loss_chunks < 2:
        raise MemplanError("--compile --lora: torchtune's LoRA recipe compiles the whole loss, which is not measured; "
                           "give --loss-chunks N (its configs' CEWithChunkedOutputLoss)")


def compiled_terms(impl: str, float8: str | None = None, linears: int = 0, budget: float | None = None,
                   qwen3: bool = False) -> list[Term]:
    """The compiled layer's saved tensors; ``float8``: torchtitan's block with ``linears`` float8 linears. torchtitan's
    terms carry its selective-op table too (Term.kept: TITAN_LAYER's terms not in TITAN_SAC dropped under selective,
    TITAN_SAC's own kept under selective alone); ``budget``: its memory-budget AC, BUDGET_SAVED's rows at F;
    ``qwen3``: torchtitan's dense Qwen3 block (TITAN_LAYER with compiled_qwen3.QWEN3_ROWS in place of its RoPE rows;
    TITAN_SAC's set under selective-op)."""
    if budget is not None:
        keep = BUDGET_SAVED[round(budget * 10)].split()
        return [saved(id, what, block, elements, dtype, k22=False, src=BUDGET_SRC)
                for id, what, block, elements, dtype in TITAN_LAYER if id in keep]
    sac = impl == "torchtitan" and not float8
    layer = (tuple(r for r in TITAN_LAYER if r[0] != "rope_rows") + compiled_qwen3.QWEN3_ROWS if qwen3 else
             TABLES[impl])
    rows = layer + (tuple(r for r in TITAN_SAC if r not in TITAN_LAYER) + TITAN_SAC_TP if sac else ())
    split = TITAN_TP_SPLIT if impl == "torchtitan" else {}
    src = compiled_qwen3.SRC if qwen3 else f"{SRC}; per TP rank {TP_SRC}" if impl == "torchtitan" else SRC
    terms = [saved(id, what, block, elements, dtype, full=id == "layer_input", k22=False, src=src,
                   sel=sac and id not in SAC_IDS, only_selective=sac and (id, what, block, elements, dtype) not in
                   layer, tp=split.get(id) == "tp", sp=split.get(id) == "sp", needs_tp=id == "wo_rs")
             for id, what, block, elements, dtype in rows if not (float8 and id in FLOAT8_RECOMPUTED)]
    if float8 == "tensorwise":
        terms += [saved(id, what, "float8", str(linears), dtype, k22=False, src=SRC, storages=linears)
                  for id, what, dtype in FLOAT8_SCALARS]
    return terms


def apply(inventory: Inventory, model: ModelSpec, impl: str, float8: str | None = None,
          loss_chunks: int = 1, budget: float | None = None, recompute: Recompute = Recompute.NONE,
          recompute_layers: bool = False) -> Inventory:
    """The inventory with each decoder layer's saved tensors those of the compiled layer, and its layer moments
    freeing the compiled tensors; ``float8``: torchtitan's float8 linears (all five converted, as traced); with
    torchtune's chunked loss (`loss_chunks` > 1) the compiled loss's saved tensors and moments (its recipes'
    compile_loss: memplan/inventory/tune_loss.py)."""
    linears = len(converted_linears(model)) if float8 else 0
    if float8 and linears != 5:
        raise MemplanError("--compile with --float8 is traced with every linear of the layer in float8; this model "
                           "has a dim not divisible by 16 (torchtitan leaves that linear bf16): plan it eager")
    kept = [t for t in inventory.terms if t.scope != "layer"]
    moments = {m.id: dataclasses.replace(m, source=MOMENTS)
               for m in hf_layer_moments(model, True, traced=FREED, kv_expanded=impl == "torchtune")}
    if impl == "torchtune" and loss_chunks > 1:
        kept = [t for t in kept if t.id not in EAGER_SAVED] + compiled_loss_terms(loss_chunks)
        moments |= {m.id: m for m in [tune_loss_forward(loss_chunks, True),
                                      *tune_chunked_backward(loss_chunks, True)]}
    # torchtitan's eager layer moments (memplan/inventory/titan_moments.py) are not the compiled block's: left out,
    # the compiled bf16 block's own in their place (memplan/inventory/compiled_moments.py; ``recompute_layers``:
    # selective-layer, some layers kept whole)
    out = tuple(moments.get(m.id, m) for m in inventory.moments if impl != "torchtitan" or m.scope != "layer")
    qwen3 = impl == "torchtitan" and is_qwen3_dense(model)
    terms = compiled_terms(impl, float8, linears, budget, qwen3)
    if titan_moments_measured(impl, float8, budget):
        out += (compiled_qwen3_moments if qwen3 else compiled_titan_moments)(
            model, recompute, recompute_layers, tuple(t.id for t in terms))
    return dataclasses.replace(inventory, name=f"{inventory.name}/compiled", terms=tuple(terms + kept), moments=out)


def titan_moments_measured(impl: str, float8: str | None, budget: float | None) -> bool:
    """Whether the compiled block has its measured backward moments: torchtitan's bf16 block, AC none, full or
    selective-op (not float8's linears, not the memory-budget AC's saved sets)."""
    return impl == "torchtitan" and not float8 and budget is None


# torch 2.13 stops compiling torchtitan's FullAC block under DTensor TP (inductor and AOTAutograd alike, on CPU): the
# checkpointed region's forward saves the TP DeviceMesh among its tensors
FULL_TP_ERROR = ("AssertionError: expected all tensors_saved_with_vc_check to be Tensors, got types: [..., "
                 "DeviceMesh] (torch/_functorch/_aot_autograd/runtime_wrappers.py save_from_forward)")


def notes(training, impl: str = "", tp: int = 1, model: ModelSpec | None = None, pp: int = 1) -> list[str]:
    if not getattr(training, "compile", False):
        return []
    if impl == "torchtitan" and model is not None and is_qwen3_dense(model):
        return compiled_qwen3.notes(pp)
    if impl == "torchtitan" and tp > 1:
        full = training.recompute == Recompute.FULL
        tp_note = [f"--compile with --tp {tp}: the compiled block's saved tensors {TP_SRC}" + (
            "; under --ac full DERIVED, not measured (each checkpointed block keeps its sequence-sharded input, as "
            "eager FullAC under TP, measured): torch 2.13 does not run it on CPU, " + FULL_TP_ERROR if full else "")]
    else:
        tp_note = []
    loss = ("the loss is not compiled" if impl != "torchtune" else
            "the loss as torchtune's recipes compile it: CEWithChunkedOutputLoss's compute_cross_entropy (what it saves "
            "and its moments measured on CPU with inductor, CUDA derived)" if training.loss_chunks > 1 else
            "the whole loss stays eager (torchtune's full fine-tune recipes discard what compile_loss returns for it)")
    budget = [] if getattr(training, "memory_budget", None) is None else [
        f"--ac budget:{training.memory_budget:g} (torchtitan's MemoryBudgetAC): the saved set {BUDGET_SRC}; what the "
        "partitioner recomputes in the backward is traced from the same graphs and timed (memplan/inventory/"
        "budget_recompute.py: the step time derived from the traced graph, uncalibrated), not counted as a working "
        "set (a lower bound)"]
    measured = titan_moments_measured(impl, training.float8, getattr(training, "memory_budget", None))
    transients = (f"the layers' backward moments {MOMENTS_SRC}; the CPU kernels' own scratch (oneDNN's bf16 GEMMs, "
                  "sdpa's CPU backward) left out" if measured else
                  "the layers' backward transients, where the implementation models them, are the eager layer's "
                  "(transformers' measured ones, derived), Inductor's fused kernels' own buffers left out (not traced)"
                  if impl != "torchtitan" else
                  "the layers' backward moments are not modelled with float8 linears or the memory-budget AC (the "
                  "compiled bf16 block's are measured)")
    return [f"--compile: the decoder layers' saved tensors {SRC}; {transients}; {loss}"] + budget + tp_note
