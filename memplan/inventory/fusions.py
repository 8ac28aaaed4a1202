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
"""

from __future__ import annotations

import dataclasses

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.inventory.k22 import causal_mask_term
from memplan.inventory.mcore import MCORE, rope_cos_sin_term, unfused_swiglu
from memplan.inventory.moe import unfused_moe_swiglu
from memplan.inventory.types import Inventory

MEGATRON_IMPLS = ("megatron", "megatron-local")
INFO = ("--device cpu|cuda, --transformer-impl local|transformer_engine, --no-<name>-fusion (masked-softmax, bias-gelu, "
        "bias-swiglu, bias-dropout, rope, gradient-accumulation; --impl megatron*): Megatron-LM's names and defaults "
        "(every fusion on). Unfused, megatron-core keeps the causal mask (local spec only), SwiGLU's x + offset and "
        "SiLU output, rotary cos / sin per layer, each bf16 weight gradient until DDP's hook adds it; bias-gelu and "
        "bias-dropout keep the same bytes. The tensors are measured on CPU (validation/mcore.py runs megatron-core "
        "unfused); their CUDA use is DERIVED from megatron-core 0.16.1 code, NOT MEASURED on a GPU "
        "(memplan/inventory/fusions.py)")
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
