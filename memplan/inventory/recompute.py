"""Megatron-LM's selective recompute modules (`--recompute-modules`) as a rewrite of an inventory's recompute flags.

An inventory marks what selective recompute drops as the attention core (`core_attn`, Megatron-LM's default module:
Term.dropped_by_selective) and what only its checkpoint keeps (Term.only_selective). With other modules chosen,
`apply_modules` moves those flags so that "selective" means the chosen modules, as megatron-core 0.16.1 runs them
(transformer_layer.py, measured on CPU per term: validation/mcore.py, tests/test_validate_mcore_recompute.py):

- "layernorm": both norms run in a CheckpointWithoutOutput under no_grad: their own saved tensors (statistics; on
  CPU RMSNorm's fp32 copies) are gone, their outputs (the QKV projection's and the first MLP linear's saved inputs)
  are freed after use (`discard_output_and_register_recompute`), and the checkpoint keeps the norms' inputs (the layer
  input and the residual after the attention);
- "mlp": the dense MLP runs in a CheckpointFunction that keeps its input (the second norm's output, which the first
  MLP linear saves anyway) and none of the MLP's own tensors; the dropout after it is outside the checkpoint;
- "moe": the whole MoELayer runs in a CheckpointFunction (moe_layer.py MoELayer.forward): it keeps the MLP input (the
  router's input, fc1_input) and nothing of the router, the dispatcher, the experts or the shared experts;
- "shared_experts": the shared experts run in a CheckpointFunction (MoELayer.shared_experts_compute) that keeps the MLP
  input; none of their own tensors;
- "mla_up_proj": MLA's up projections and RoPE run in a CheckpointWithoutOutput (multi_latent_attention.py): the up
  projections' inputs stay (the checkpoint keeps them), RoPE's cos / sin are not made, Q, K and V (its outputs, which
  the core attention saves) are freed after use; the checkpoint also keeps k_pos_emb, a view of the kv down
  projection's whole (r_kv + d_r)-wide output, and the rotary frequencies (fp32, s d_r per layer). Measured at t = 1
  with and without the q down projection. At t > 1 derived from the code: the local spec's column-parallel kv down
  projection is gathered to the whole sequence before the split (s b (r_kv + d_r), not split by t); the TE spec's
  replicated one keeps s/t b (r_kv + d_r) and gathers k_pos_emb (s b d_r) under SP: the term is its upper bound
  there. On CUDA (--device cuda) the same rules, derived.

- "moe_act": megatron-core 0.16.1 accepts it only with --moe-grouped-gemm (TransformerConfig), whose experts need CUDA
  (Transformer Engine's TEGroupedMLP, the grouped_gemm package's GroupedMLP): derived from their forward, not
  measured. The activation runs in a CheckpointWithoutOutput that keeps its inputs (fc1's output, the probabilities:
  kept anyway) and frees its output, fc2's saved input, after fc2 (`discard_output_and_register_recompute`): the
  experts' fc2 input and, with the unfused SwiGLU, its own tensors are dropped.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.core.training import DEFAULT_RECOMPUTE_MODULES
from memplan.inventory.types import Inventory, Term, saved

MODELLED = ("core_attn", "layernorm", "mlp", "moe", "shared_experts", "mla_up_proj")  # measured on CPU
DERIVED_MODULES = ("moe_act",)  # CUDA only: derived from megatron-core's code
MEGATRON_IMPLS = ("megatron", "megatron-local")
# what each module drops (term ids of memplan/inventory/k22.py and mcore.py)
DROPS = {
    "layernorm": ("ln1_stats", "ln2_stats", "ln1_fp32_input", "ln1_normed", "ln2_fp32_input", "ln2_normed",
                  "qkv_input", "fc1_input"),
    "mlp": ("gelu_input", "fc2_input", "swiglu_input", "swiglu_up", "swiglu_silu_out"),
    "mla_up_proj": ("rope_cos_sin", "qk", "v"),
}
# derived, not measured (CUDA only): TEGroupedMLP / GroupedMLP's activation checkpoint (tests/test_megatron_moe_variants.py)
DERIVED_DROPS = {"moe_act": ("moe_fc2_input", "moe_swiglu_up", "moe_silu_out", "moe_act_out")}
# the blocks (memplan/inventory/moe.py) whose every term a module drops
DROPS_BLOCKS = {"moe": ("MoE router", "MoE experts", "MoE shared experts"), "shared_experts": ("MoE shared experts",)}
MOE_ACT = ("--recompute-modules moe_act: megatron-core 0.16.1 accepts it only with --moe-grouped-gemm (TransformerConfig), "
           "an MoE model's")
SRC_MLA = "megatron-core 0.16.1 CheckpointWithoutOutput around MLA's up projections and RoPE ('mla_up_proj')"
NORM_INPUTS = ("ln1_input", "ln2_input")
SRC = "megatron-core 0.16.1 CheckpointWithoutOutput around the norms (selective recompute 'layernorm')"


def apply_modules(inv: Inventory, model: ModelSpec, impl: str, modules: Iterable[str]) -> Inventory:
    """`inv` with selective recompute meaning Megatron-LM's `modules` (the default, core_attn: unchanged)."""
    modules = tuple(modules)
    if modules == DEFAULT_RECOMPUTE_MODULES:
        return inv
    if impl not in MEGATRON_IMPLS:
        raise MemplanError(f"--recompute-modules is Megatron-LM's: it applies to --impl megatron / megatron-local, "
                           f"not --impl {impl}")
    other = [m for m in modules if m not in MODELLED + DERIVED_MODULES]
    if "moe_act" in modules and not (model.is_moe and model.moe_grouped_gemm):
        raise MemplanError(MOE_ACT)
    if "shared_experts" in modules and model.moe_shared_expert_overlap:
        raise MemplanError("--recompute-modules shared_experts cannot work with --moe-shared-expert-overlap "
                           "(megatron-core 0.16.1 TransformerConfig)")
    if other:
        raise MemplanError(f"--recompute-modules {' '.join(other)}: not modelled (modelled: "
                           f"{', '.join(MODELLED + DERIVED_MODULES)})")
    if (model.is_moe or model.is_mla) and set(modules) & {"layernorm", "mlp"}:
        raise MemplanError("--recompute-modules layernorm / mlp are modelled for dense layers with standard "
                           "attention (not MoE or MLA layers)")
    if "mla_up_proj" in modules and not model.is_mla:
        raise MemplanError("--recompute-modules mla_up_proj applies to multi-latent attention (kv_lora_rank set), as "
                           "megatron-core requires")
    drops = {i for m in modules for i in DROPS.get(m, DERIVED_DROPS.get(m, ()))}
    blocks = {b for m in modules for b in DROPS_BLOCKS.get(m, ())}
    terms: list[Term] = []
    for t in inv.terms:
        if t.scope == "layer":
            if "core_attn" not in modules and t.only_selective:
                continue  # the attention checkpoint's own inputs: no such checkpoint
            if "core_attn" not in modules and t.dropped_by_selective:
                t = dataclasses.replace(t, dropped_by_selective=False)
            if t.id in drops or t.block in blocks:
                t = dataclasses.replace(t, dropped_by_selective=True)
            if "layernorm" in modules and t.id in NORM_INPUTS and t.only_full:
                # kept by the norm checkpoint as by the full-recompute one, by nothing without recompute
                t = dataclasses.replace(t, only_full=False, only_selective=True, kept_by_full=True,
                                        source=f"{t.source}; {SRC}")
        terms.append(t)
    ids = {t.id for t in terms}
    if "layernorm" in modules and "ln2_input" not in ids:
        terms.append(saved("ln2_input", "input of norm 2 (kept by the norm checkpoint)", "layer norms", "s b h",
                           sp=True, k22=False, only_selective=True, src=SRC))
    if "mla_up_proj" in modules:
        terms += [saved("mla_k_pos_emb", "k_pos_emb (kept by the up projections' checkpoint): a view of the kv down "
                        "projection's whole output", "latent attention", "s b rkv + s b dr", k22=False,
                        only_selective=True, src=SRC_MLA),
                  saved("mla_rope_freqs", "rotary frequencies of the d_r part (fp32, kept by the up projections' "
                        "checkpoint)", "latent attention", "s dr", "fp32", k22=False, only_selective=True, src=SRC_MLA)]
    return dataclasses.replace(inv, terms=tuple(terms), name=f"{inv.name}/recompute-{'+'.join(modules) or 'none'}")
