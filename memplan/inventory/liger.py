"""Liger-Kernel's fused kernels on transformers' Llama layout (`--liger`, --impl hf-sdpa / hf-eager): what
apply_liger_kernel_to_llama's defaults (rms_norm, swiglu, rope, fused_linear_cross_entropy) change in the
saved tensors and in the loss's moments of memplan/inventory/hf.py.

Liger-Kernel is Triton only: nothing here runs on CPU, so every figure is DERIVED from Liger-Kernel 0.8.5's code,
NOT MEASURED:

- LigerRMSNorm (ops/rms_norm.py LigerRMSNormFunction.forward, casting_mode "llama"): saves X (the norm's input,
  in its own dtype), W (a parameter) and RSTD (fp32, one per row): no fp32 copy of the input and no normalised
  tensor (LlamaRMSNorm keeps both). Its backward writes dX into dY in place and sums dW in an fp32
  [SM count, h] buffer (not modelled: a few MB).
- LigerSwiGLUMLP (ops/swiglu.py LigerSiLUMulFunction.forward): saves a (gate_proj's output) and b (up_proj's
  output) only and recomputes SiLU(a) in the backward: SiLU's output is not kept; down_proj still keeps its input.
- liger_rotary_pos_emb (ops/rope.py LigerRopeFunction.forward): saves cos and sin, the same shared tables
  transformers' apply_rotary_pos_emb keeps (rope_cos, rope_sin): no change in bytes.
- LigerFusedLinearCrossEntropy (ops/fused_linear_cross_entropy.py fused_linear_cross_entropy_forward, through
  transformers/model/llama.py lce_forward with skip_logits in training): the logits are never made whole; the
  forward computes them in chunks of chunk_size = min(next_pow2(ceil(sb / ceil(v / h))), sb) rows (chunk_mem_const 1),
  at most 2 s b h elements (bf16), turns each into its gradient in place and computes the input's gradient
  (zeros_like(_input): s b h, bf16) and the head weight's gradient (zeros_like(weight): v h in the weight's dtype,
  accum_dtype None by default; bf16 weights here) inside the forward, and saves those two
  (LigerFusedLinearCrossEntropyFunction.forward, ctx.save_for_backward(grad_input, grad_weight)) instead of
  lm_head's input, the fp32 log-softmax and the targets. The backward hands them on (scaled in place when the
  loss's gradient is not 1).
"""

from __future__ import annotations

import dataclasses

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.inventory.types import OUTPUT_LAYER_W, Inventory, Moment, Term, saved, transient

LIGER = "Liger-Kernel 0.8.5"
DERIVED = "DERIVED, not measured (Triton only)"
NAMES = {"ln1": "input_layernorm", "ln2": "post_attention_layernorm", "final_norm": "final norm"}
INFO = ("--liger (--impl hf-sdpa / hf-eager, Llama layout): Liger-Kernel 0.8.5's apply_liger_kernel_to_llama "
        "defaults: RMSNorm saving its bf16 input and fp32 rstd, SwiGLU recomputing SiLU, RoPE (same cos / sin), the "
        "fused linear cross-entropy (no full logits; the head's input and weight gradients made in the forward and "
        "saved). DERIVED from Liger-Kernel's code, NOT MEASURED (Triton only; memplan/inventory/liger.py)")

NORM_GONE = ("_fp32_input", "_normed")  # of ln1, ln2, final_norm (memplan/inventory/hf.py _rmsnorm)
LOSS_GONE = ("head_input", "logits_fp32", "target_ids", "nll_total_weight")


def check_liger(model: ModelSpec, impl: str, loss_chunks: int) -> None:
    """Liger is modelled for the hand-written transformers Llama inventory with transformers' own loss."""
    if impl not in ("hf-eager", "hf-sdpa") or model.inventory is not None or model.is_moe or model.is_mla:
        raise MemplanError("--liger is modelled for --impl hf-sdpa / hf-eager with the Llama layout "
                           "(transformers' own code, not a traced inventory)")
    if not (model.norm == "rmsnorm" and model.mlp == "swiglu"):
        raise MemplanError("--liger is modelled for the Llama layout (RMSNorm, SwiGLU)")
    if loss_chunks > 1:
        raise MemplanError("--liger computes the loss in its own chunks (fused linear cross-entropy): drop --loss-chunks")


def liger_terms(terms: list[Term], tied: bool) -> list[Term]:
    """The Llama inventory's terms with Liger's kernels."""
    out: list[Term] = []
    for t in terms:
        prefix = next((t.id[: -len(g)] for g in NORM_GONE + ("_rstd",) if t.id.endswith(g)), None)
        if prefix in ("ln1", "ln2", "final_norm"):
            if t.id.endswith("_rstd"):  # the fp32 rstd stays; the input (own dtype) replaces the fp32 copy
                src = f"{DERIVED}: {LIGER} ops/rms_norm.py LigerRMSNormFunction.forward (saves X, W, RSTD)"
                out.append(saved(f"{prefix}_input", f"{NAMES[prefix]}: LigerRMSNorm input X (bf16)", t.block, "s b h",
                                 scope=t.scope, k22=False, src=src))
                out.append(dataclasses.replace(t, source=src))
            continue
        if t.id == "silu_out" or t.id in LOSS_GONE:
            continue
        if t.id in ("silu_input", "up_out"):  # a and b of LigerSiLUMulFunction
            t = dataclasses.replace(t, source=f"{DERIVED}: {LIGER} ops/swiglu.py LigerSiLUMulFunction.forward "
                                              "(saves a and b, recomputes SiLU(a))")
        out.append(t)
    flce = f"{DERIVED}: {LIGER} ops/fused_linear_cross_entropy.py LigerFusedLinearCrossEntropyFunction.forward"
    what = "embedding's (tied)" if tied else "LM head's"
    return out + [
        saved("liger_grad_head_input", "gradient of the LM head's input, made in the forward (bf16)", "output layer",
              "s b h", scope="last", k22=False, src=flce),
        saved("liger_grad_head_weight", f"gradient of the {what} weight, made in the forward (bf16)",
              "output layer", "v h", scope="last", k22=False, src=flce),
    ]


def liger_moments(moments: list[Moment], tied: bool) -> list[Moment]:
    """The layers' moments (their freed ids renamed) and the fused loss's instead of transformers' loss."""
    layers = [dataclasses.replace(m, freed=tuple(f for f in m.freed if f not in ("ln2_fp32_input", "ln2_normed",
                                                                                 "silu_out")) + ("ln2_input",))
              if m.id == "attention_backward" else m for m in moments if m.scope != "last"]
    flce = f"{DERIVED}: {LIGER} ops/fused_linear_cross_entropy.py fused_linear_cross_entropy_forward"
    head = "word embedding" if tied else OUTPUT_LAYER_W
    return layers + [
        Moment("loss_forward", "fused linear cross-entropy forward: one chunk of logits beside the gradients",
               "loss", "last",
               (transient("liger_logits_chunk", "one chunk of logits, turned into its gradient in place (bf16; "
                          "chunk_size x v <= 2 s b h)", "2 s b h", scope="last", src=flce),
                transient("liger_loss_1d", "per-token losses (fp32)", "s b", "fp32", scope="last", src=flce)),
               source=flce),
        # the backward returns the saved weight gradient: it becomes .grad (the same storage)
        Moment("head_backward", "fused linear cross-entropy backward: the saved gradients handed on", "backward",
               "last", (), ("liger_grad_head_weight",), (head,), fresh=True, source=flce),
    ]


def apply(inv: Inventory, model: ModelSpec, impl: str, loss_chunks: int) -> Inventory:
    """`inv` (transformers' Llama inventory) with Liger-Kernel's default kernels."""
    check_liger(model, impl, loss_chunks)
    return dataclasses.replace(inv, name=f"{inv.name}/liger", terms=tuple(liger_terms(list(inv.terms),
                                                                                     model.tied_embeddings)),
                               moments=tuple(liger_moments(list(inv.moments), model.tied_embeddings)))


def notes(training) -> list[str]:
    """The estimate's note on what --liger changes, and that it is derived."""
    if not training.liger:
        return []
    return ["--liger: Liger-Kernel 0.8.5's RMSNorm, SwiGLU, RoPE and fused linear cross-entropy; their saved tensors "
            "and the loss's chunk of logits are DERIVED from its code (Triton only), NOT MEASURED"]
