"""Megatron-LM's fusion switches as memory: what `--no-<name>-fusion` (memplan/core/training.py FUSIONS) changes
in a Megatron-LM inventory (--impl megatron, megatron-local) on CUDA, and the CPU kernels' own choice.

Names and defaults are Megatron-LM's (megatron/training/arguments.py at core_v0.16.1, _add_training_args:
`--no-masked-softmax-fusion`, `--no-bias-gelu-fusion`, `--no-bias-swiglu-fusion`, `--no-bias-dropout-fusion`,
`--no-rope-fusion`, `--no-gradient-accumulation-fusion`, all `store_false`, so every fusion is on by default).
What each changes, per tensor and the function that makes it (megatron-core 0.16.1):

- masked-softmax: the local spec's DotProductAttention runs FusedScaleMaskSoftmax; unfused
  (forward_torch_softmax) `masked_fill` saves the [s, s] causal mask, one storage for the chunk's layers
  (k22.causal_mask_term, measured on CPU, where the fusion is CUDA-only). Transformer Engine's attention
  (--impl megatron) has its own softmax kernels and does not read this switch: no change there.
- bias-swiglu: MLP.glu unfused keeps `x_linear + glu_linear_offset` and SiLU's output beside silu's input
  (mcore.unfused_swiglu, measured on CPU); the fused bias_swiglu_impl (fusions/fused_bias_swiglu.py) saves
  only its input. Both specs' MLP runs megatron-core's activation, so both impls change. A mixture-of-experts
  layer's experts and shared experts read the same switch (SequentialMLP's MLP, TEGroupedMLP's bias_act_func,
  SharedExpertMLP) and keep the same three tensors per routed copy (moe.unfused_moe_swiglu); the legacy GroupedMLP
  (--moe-grouped-gemm with --transformer-impl local) does not read it.
- rope: unfused `_apply_rotary_pos_emb_bshd` saves cos and sin for Q and for K in every layer
  (mcore.rope_cos_sin_term, measured on CPU); TE's fused_apply_rotary_pos_emb saves the shared freqs only.
  Multi-head latent attention keeps its own rotary terms (memplan/inventory/mla.py): no change.
- gradient-accumulation: without the fused wgrad (fused_weight_gradient_mlp_cuda, a CUDA kernel) each linear
  layer's bf16 weight gradient is a tensor until DDP's backward hook adds it to the fp32 main_grad
  (distributed/distributed_data_parallel.py _make_backward_post_hook): Inventory.grad_hook_transient. A tied
  output layer's bf16 weight gradient then waits in autograd's input buffer for the embedding's, from the output
  layer's backward to the embedding's (Inventory.tied_grad_waits; measured on CPU: validation/mcore_step.py).
- bias-gelu, bias-dropout: no change in bytes, derived from code: unfused, `fc1 + bias` is a new s b f tensor
  that F.gelu saves where the fused bias_gelu_impl saves fc1's output (the bias is a parameter); the unfused
  bias_dropout_add keeps native_dropout's 1-byte mask as the jit-fused one does.

Everything for CUDA here is derived from code, not measured (no GPU measured it); the CPU inventories
(memplan/inventory/mcore.py, measured) have every CUDA-only fusion off already.

`--cross-entropy-loss-fusion` (ModelParallelConfig.cross_entropy_loss_fusion, default off) with
`--cross-entropy-fusion-impl native|te` (default native) changes what LanguageModule.compute_language_model_loss calls
instead of tensor_parallel.vocab_parallel_cross_entropy (eager: the fp32 copy of the logits becomes the softmax in
place, which the backward turns into the gradient in place before autograd casts it to bf16):

- native: fusions/fused_cross_entropy.py, the same steps in four torch.compile'd functions (megatron/core/jit.py).
  Measured on CPU (inductor, validation/mcore_loss.py, tests/data/mcore_cross_entropy.json): the forward keeps the
  same tensors (exp written into the fp32 copy: no third s b v buffer); the backward's compiled
  calculate_gradients does not reuse the saved softmax: it writes the fp32 gradient into a new buffer and casts
  that to bf16, so the softmax, the fp32 gradient and the bf16 gradient are alive at once (4 + 4 + 2 bytes per
  logit where the eager path holds 4 + 2). On CUDA the same compiled graph is assumed (derived, not measured).
- te: Transformer Engine's Triton kernels (transformer_engine/pytorch/triton/cross_entropy.py, through
  extensions/transformer_engine.te_parallel_cross_entropy): no fp32 copy; the kernels read the bf16 logits, keep
  per token the max, the sum and the target's logit (m_d_X_y, 3 fp32; all-gathered over t ranks) and the
  contiguous targets, and write the gradient into the logits' own storage, which they save: 2 bytes per logit
  saved instead of 4, and no gradient buffer in the backward. CUDA only; derived from code, not measured.

The norm's implementation has one switch that changes memory, `--memory-efficient-layer-norm`
(TransformerConfig.memory_efficient_layer_norm): the local spec's LayerNorm with apex installed is
fusions/fused_layer_norm.FusedLayerNorm, which hands it to apex's FusedLayerNormAffineFunction (or the persistent
FastLayerNormFN): memory_efficient saves the norm's output, not its input, and rstd without the mean. The output is
the next linear's saved input (the same storage), so each LayerNorm's input (s b h) and mean (s b fp32) are no
longer kept: both layer norms of every layer and the final one. Derived from apex's code (CUDA only), not measured.
Transformer Engine's norms ignore it; the local spec's RMSNorm (torch.nn.RMSNorm through WrappedTorchNorm) asserts it
is off, as it does for persist_layer_norm and `--apply-layernorm-1p`, which change no bytes in FusedLayerNorm
(the persistent kernel saves what the other one does; zero-centred gamma makes `weight + 1`, h elements).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.core.symbolic import Poly
from memplan.inventory.k22 import causal_mask_term
from memplan.inventory.mcore import MCORE, rope_cos_sin_term, unfused_swiglu
from memplan.inventory.moe import unfused_moe_swiglu
from memplan.inventory.types import Inventory, Moment, saved, transient

MEGATRON_IMPLS = ("megatron", "megatron-local")
INFO = ("--device cpu|cuda, --transformer-impl local|transformer_engine, --no-<name>-fusion (masked-softmax, bias-gelu, "
        "bias-swiglu, bias-dropout, rope, gradient-accumulation; --impl megatron*): Megatron-LM's names and defaults "
        "(every fusion on). Unfused, megatron-core keeps the causal mask (local spec only), SwiGLU's x + offset and "
        "SiLU output, rotary cos / sin per layer, each bf16 weight gradient until DDP's hook adds it; bias-gelu and "
        "bias-dropout keep the same bytes. The tensors are measured on CPU (validation/mcore.py runs megatron-core "
        "unfused); their CUDA use is DERIVED from megatron-core 0.16.1 code, NOT MEASURED on a GPU "
        "(memplan/inventory/fusions.py). --cross-entropy-loss-fusion: native (torch.compile'd) adds an fp32 "
        "logits-sized gradient buffer to the loss backward (MEASURED on CPU, validation/mcore_loss.py); "
        "--cross-entropy-fusion-impl te keeps the bf16 logits as their gradient instead of the fp32 softmax (DERIVED "
        "from Transformer Engine's code, CUDA only)")
DERIVED = f"{MCORE} with the Megatron-LM fusion switched off, derived from code, not measured"


def apply_fusions(inv: Inventory, model: ModelSpec, impl: str, device: str, off: tuple[str, ...]) -> Inventory:
    """`inv` (the implementation's inventory on `device`) with the fusions named in `off` switched off."""
    if off and impl not in MEGATRON_IMPLS:
        raise MemplanError(f"--no-<name>-fusion are Megatron-LM's switches: they apply to --impl megatron and "
                           f"megatron-local, not --impl {impl}")
    if impl not in MEGATRON_IMPLS:
        return inv
    if device == "cpu":  # torch's CPU kernels: the fused wgrad is a CUDA kernel; the rest is unfused already
        hook = impl == "megatron-local" or inv.grad_hook_transient
        return dataclasses.replace(inv, grad_hook_transient=hook, tied_grad_waits=hook or inv.tied_grad_waits)
    terms = list(inv.terms)
    ids = {t.id for t in terms}
    if "masked-softmax" in off and impl == "megatron-local" and "causal_mask" not in ids:
        mask = causal_mask_term()
        terms.append(dataclasses.replace(mask, source=f"{DERIVED} (FusedScaleMaskSoftmax.forward_torch_softmax); "
                                                      f"{mask.source}"))
    if "bias-swiglu" in off and model.mlp == "swiglu" and "swiglu_up" not in ids:
        terms = unfused_swiglu(terms, f"{DERIVED} (MLP.glu); measured on CPU (validation/mcore.py)")
    if "bias-swiglu" in off and model.is_moe and model.mlp == "swiglu":
        terms = unfused_moe_swiglu(terms, model, impl, f"{DERIVED} (experts' MLP.glu / TEGroupedMLP bias_act_func)")
    if ("rope" in off and model.position_embedding == "rope" and not model.is_mla and "rope_cos_sin" not in ids):
        at = max(i for i, t in enumerate(terms) if t.id in ("qkv_input", "q", "k")) + 1
        terms.insert(at, rope_cos_sin_term(f"{DERIVED} (rope_utils._apply_rotary_pos_emb_bshd); measured on CPU "
                                           "(validation/mcore.py)"))
    hook = inv.grad_hook_transient or "gradient-accumulation" in off
    name = f"{inv.name}/no-fusion:{','.join(off)}" if off else inv.name
    return dataclasses.replace(inv, name=name, terms=tuple(terms), grad_hook_transient=hook,
                               tied_grad_waits=hook or inv.tied_grad_waits)


CE_NATIVE = ("measured on CPU: megatron-core 0.16.1 fused_vocab_parallel_cross_entropy under torch.compile "
             "(validation/mcore_loss.py)")
CE_TE = ("derived from Transformer Engine's Triton cross-entropy (transformer_engine/pytorch/triton/cross_entropy.py), "
         "not measured (CUDA only)")


def apply_loss_fusion(inv: Inventory, impl: str, device: str, fusion: Optional[str], loss_chunks: int) -> Inventory:
    """`inv` with megatron-core's fused cross-entropy (`fusion`: native | te; None: the eager one)."""
    if fusion is None:
        return inv
    if impl not in MEGATRON_IMPLS:
        raise MemplanError(f"--cross-entropy-loss-fusion is Megatron-LM's switch: it applies to --impl megatron and "
                           f"megatron-local, not --impl {impl}")
    if loss_chunks > 1:
        raise MemplanError("--cross-entropy-loss-fusion fuses the loss over the whole logits: drop --loss-chunks")
    if fusion == "te" and device == "cpu":
        raise MemplanError("--cross-entropy-fusion-impl te is Transformer Engine's Triton kernel, CUDA only: use "
                           "native with --device cpu")
    terms, moments = list(inv.terms), list(inv.moments)
    if fusion == "native":
        src = CE_NATIVE + ("" if device == "cpu" else "; CUDA: the same compiled graph, derived, not measured")
        backward = Moment(
            "cross_entropy_backward", "fused cross-entropy backward: the fp32 gradient in a new buffer beside the "
            "softmax, cast to bf16", "backward", "last",
            (transient("grad_logits_fp32", "fp32 gradient of the logits (compiled calculate_gradients)", "s b v",
                       "fp32", tp=True, scope="last", src=src),
             transient("grad_logits", "gradient of the logits (activation dtype)", "s b v", tp=True, scope="last",
                       src=src)), source=src)
        at = next(i for i, m in enumerate(moments) if m.id == "loss_backward")
        moments.insert(at, backward)
        drop = {"loss_forward": ("logits_fp32_copy",)}  # exp written into the fp32 copy (measured)
    else:
        at = next(i for i, t in enumerate(terms) if t.id == "logits_fp32")
        terms[at:at + 1] = [
            saved("logits_te", "logits (activation dtype) kept by TE's cross-entropy, overwritten by their gradient",
                  "output layer", "s b v", tp=True, sp=False, scope="last", k22=False, src=CE_TE),
            saved("cross_entropy_m_d_x_y", "per-token max, sum and target logit (fp32, gathered over t ranks)",
                  "output layer", "3 s b t", "fp32", tp=False, sp=False, scope="last", k22=False, src=CE_TE)]
        terms = [t for t in terms if t.id != "target_mask"]  # TE keeps the targets only
        drop = {"loss_forward": ("logits", "logits_fp32_copy"), "loss_backward": ("grad_logits",)}
    moments = [dataclasses.replace(m, transients=tuple(t for t in m.transients if t.id not in drop[m.id]))
               if m.id in drop else m for m in moments]
    return dataclasses.replace(inv, name=f"{inv.name}/ce-fusion:{fusion}", terms=tuple(terms), moments=tuple(moments))


APEX_LN = "derived from apex FusedLayerNormAffineFunction (memory_efficient=True saves the output), not measured"
LN_INPUTS = ("ln1_input", "ln2_input", "final_ln_input")
LN_STATS = ("ln1_stats", "ln2_stats", "final_ln_stats")


def apply_norm(inv: Inventory, model: ModelSpec, impl: str, device: str, memory_efficient: bool,
               modules: tuple[str, ...]) -> Inventory:
    """`inv` with Megatron-LM's --memory-efficient-layer-norm: the LayerNorms' inputs and means not kept."""
    if not memory_efficient:
        return inv
    if impl != "megatron-local" or device != "cuda" or model.norm != "layernorm":
        raise MemplanError("--memory-efficient-layer-norm is apex's fused LayerNorm in megatron-core's local spec: "
                           "--impl megatron-local, a LayerNorm model, --device cuda (Transformer Engine ignores it, "
                           "torch's RMSNorm refuses it)")
    if "layernorm" in modules:
        raise MemplanError("--memory-efficient-layer-norm with --recompute-modules layernorm is not modelled")
    terms = []
    for t in inv.terms:
        if t.id == "ln1_input":  # the layer input: still the checkpoint's under full recompute
            t = dataclasses.replace(t, name="the layer input (kept by full recompute's checkpoint only)",
                                    only_full=True, source=APEX_LN)
        elif t.id in LN_INPUTS:
            continue
        if t.id in LN_STATS:  # rstd only: one value per token
            t = dataclasses.replace(t, name=t.name.replace("mean and rstd", "rstd"), elements=Poly.parse_sum("s b"), storages=1,
                                    source=APEX_LN)
        terms.append(t)
    return dataclasses.replace(inv, name=f"{inv.name}/memory-efficient-ln", terms=tuple(terms))
