"""Multi-head latent attention (DeepSeek-V2 / V3) as Megatron-LM runs it (`--impl megatron` / `megatron-local`), and
multi-token prediction's extra work on the last stage, as data.

megatron-core 0.16.1's MLASelfAttention (megatron/core/transformer/multi_latent_attention.py,
get_query_key_value_tensors / forward) with its latent norms (`qk_layernorm`, as DeepSeek-V3's Megatron-LM recipe
sets `--qk-layernorm`). What one layer's attention keeps, per GPU (symbols: r_q = q_lora_rank, r_kv = kv_lora_rank,
d_n / d_r = qk_nope / qk_rope head widths, d_v = v_head_dim):

- the attention input (ln1's output), kept by linear_q_down_proj and linear_kv_down_proj (one storage: the
  qkv_input term; with q_lora_rank None by linear_q_proj);
- q_layernorm on the r_q-wide latent and kv_layernorm on the r_kv-wide one (kv_down_proj's output is r_kv + d_r wide,
  split into the latent and the shared rope key); both latents are gathered over t and, with SP, scattered along s:
  split by SP, not by t. Each norm's output is the up projection's input (r_q, r_kv wide);
- RoPE on the d_r part of Q and of the shared K (apply_rotary_pos_emb, unfused in the local spec: cos and sin saved
  for each, s x d_r, made per layer);
- the core attention's Q and K (a heads of d_n + d_r: torch.cat of the rotated and unrotated parts; K's rope part
  expanded to every head) and V (a x d_v, a contiguous copy of kv_up_proj's split): split by t;
- the unfused DotProductAttention's s x s scores / softmax (the megatron_layer eager core), the output projection's
  input (a x d_v).

Measured on CPU per term against megatron-core's MLASelfAttention in the local spec (validation/mcore.py,
tests/test_validate_mcore_mla.py). megatron-core 0.16.1's local DotProductAttention does not take the k_channels /
v_channels MLA passes (Megatron-LM runs MLA with Transformer Engine only): the harness gives it a subclass that
takes them (its forward is width-agnostic).

`--impl megatron` (the Transformer Engine spec, get_gpt_layer_with_transformer_engine_spec(multi_latent_attention=
True, qk_layernorm=True)): derived from code, not measured. The down projections are TELinear (duplicated), the up
projections TELayerNormColumnParallelLinear (the norm fused into the linear: it keeps the latent, the fp32 rstd
and the norm's output, the GEMM input), the core attention TEDotProductAttention (cuDNN fused attention with
d_n + d_r wide Q / K and d_v wide V: Q, K, V, the output and the fp32 softmax statistics, no s x s tensor), RoPE
fused (fusions/fused_mla_yarn_rope_apply.py: its autograd functions save only the shared cos / sin tables).

Multi-token prediction (`mtp_layers`, Megatron-LM --mtp-num-layers; megatron-core's multi_token_prediction.py
MultiTokenPredictionLayer): on the last pipeline stage each MTP module normalises the main model's hidden states
(hnorm) and the next token's embedding (enorm), projects their concatenation (2h -> h, eh_proj), runs one
transformer layer (an MoE layer in DeepSeek-V3) and the shared output head and cross-entropy again: the fp32 logits
s b v / t once more. Derived from megatron-core's code, not measured; its layer is not recomputed (memplan counts it
as the last stage's extra layer under every recompute mode).
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Iterable

from memplan.core.model import ModelSpec
from memplan.inventory.moe import DENSE_MLP
from memplan.inventory.types import Dtype, Term, saved

MCORE = "megatron-core 0.16.1 MLASelfAttention"
MEASURED = f"mcore MLA CPU: {MCORE} (local spec), measured on CPU (validation/mcore.py)"
DERIVED_LOCAL = f"mcore MLA code: {MCORE} (local spec) with Megatron-LM's CUDA kernels, derived from code, not measured"
DERIVED_TE = (f"mcore MLA code: {MCORE} in the Transformer Engine spec (TELayerNormColumnParallelLinear latent norms, "
              "cuDNN fused attention, fused MLA RoPE), derived from code, not measured")
MTP_SRC = ("derived from megatron-core 0.16.1 multi_token_prediction.py (MultiTokenPredictionLayer: enorm, hnorm, "
           "eh_proj, one transformer layer, the shared output head and loss), not measured")
# the attention terms a latent attention replaces (memplan/inventory/k22.py megatron_layer, memplan/inventory/mcore.py)
REPLACED = ("qk", "v", "q", "k", "qkv_output", "kv_repeated", "rope_cos_sin", "proj_input", "softmax_lse",
            "rope_freqs")


def mla_terms(terms: Iterable[Term], model: ModelSpec, impl: str, device: str) -> list[Term]:
    """`terms` (a Megatron layer inventory) with multi-head latent attention's terms in place of the
    attention's Q / K / V (see the module docstring); `impl` megatron (TE spec) or megatron-local."""
    local, cpu = impl == "megatron-local", device == "cpu"
    src = MEASURED if local and cpu else DERIVED_LOCAL if local else DERIVED_TE
    out: list[Term] = []
    for t in terms:
        if t.id in REPLACED:
            continue
        out.append(t)
        if t.id == "qkv_input":
            out[-1] = dataclasses.replace(t, name="attention input (kept by the q / kv down projections)")
            out += _attention(model, local, cpu, src)
    return out


def _attention(model: ModelSpec, local: bool, cpu: bool, src: str) -> list[Term]:
    block = "latent attention"
    out: list[Term] = []
    latents = (("q", "rq"), ("kv", "rkv")) if model.q_lora_rank else (("kv", "rkv"),)
    for which, r in latents:
        norm = f"{which}_layernorm"
        if cpu:  # torch.nn.RMSNorm on CPU: F.rms_norm's composite path (see memplan/inventory/mcore.py)
            out += [saved(f"mla_{which}_fp32_latent", f"{norm}: fp32 copy of the {r}-wide latent", block, f"s b {r}",
                       "fp32", sp=True, k22=False, src=src),
                    saved(f"mla_{which}_norm_stats", f"{norm} rstd", block, "s b", "fp32", sp=True, k22=False, src=src),
                    saved(f"mla_{which}_normed", f"{norm}: fp32 normalised latent", block, f"s b {r}", "fp32", sp=True,
                       k22=False, src=src)]
        else:  # a fused RMSNorm (torch's CUDA kernel, TE's LayerNormLinear): the bf16 latent and an fp32 rstd
            out += [saved(f"mla_{which}_latent", f"the {r}-wide latent ({norm}'s input)", block, f"s b {r}",
                       sp=True, k22=False, src=src),
                    saved(f"mla_{which}_norm_stats", f"{norm} rstd", block, "s b", "fp32", sp=True, k22=False, src=src)]
        out.append(saved(f"mla_{which}_up_input", f"{which} up projection's input ({norm}'s output)", block,
                      f"s b {r}", sp=True, k22=False, src=src))
    if local:
        out.append(saved("rope_cos_sin", "rotary cos and sin of the d_r part, for Q and for K, made per layer", block,
                      "4 s dr", k22=False, src=src))
    out += [
        saved("qk", "Q and K, a heads of d_n + d_r (saved by the core attention)", block, "2 s b a dn + 2 s b a dr",
           tp=True, k22=False, src=src, storages=2),
        saved("v", "V, a heads of d_v (saved by the core attention)", block, "s b a dv", tp=True, k22=False, src=src),
        saved("proj_input", "attention output = input of the output projection (a x d_v)", block, "s b a dv", tp=True,
           k22=False, src=src),
    ]
    if not local:
        out.append(saved("softmax_lse", "fused attention's softmax statistics per row and head (fp32)", block, "a s b",
                      "fp32", tp=True, sel=True, k22=False, src=src))
    return out


def mtp_terms(layer_terms: Iterable[Term], model: ModelSpec, stats: Dtype = "fp32") -> list[Term]:
    """The last stage's multi-token-prediction modules (model.mtp_layers of them): each one's norms, eh_proj's 2h-wide
    input, one more transformer layer (the layers' terms, as the last MoE layer keeps them) and the output head's
    input, fp32 logits and targets again. Scope "last": they live on the last stage only."""
    n = model.mtp_layers
    if not n:
        return []
    out = [
        saved("mtp_norm_inputs", "MTP enorm / hnorm / final norm inputs (the next tokens' embedding, the hidden states, "
           "the MTP layer's output)", "MTP", f"{3 * n} s b h", sp=True, scope="last", k22=False, src=MTP_SRC),
        saved("mtp_norm_stats", "MTP enorm / hnorm / final norm rstd", "MTP", f"{3 * n} s b", stats, sp=True,
           scope="last", k22=False, src=MTP_SRC),
        saved("mtp_eh_proj_input", "MTP eh_proj input: concat(enorm(emb), hnorm(h)), 2h wide", "MTP", f"{2 * n} s b h",
           sp=True, scope="last", k22=False, src=MTP_SRC),
    ]
    moe_share = Fraction(model.num_layers, model.moe_layers) if model.is_moe and model.moe_layers else Fraction(1)
    for t in layer_terms:
        if t.scope != "layer" or t.only_full or t.only_selective:
            continue
        if model.is_moe and t.id in DENSE_MLP:
            continue  # the dense-first layers' MLP (weighted by their share) is not in an MoE layer
        # an MoE model's MTP layer is an MoE layer (DeepSeek-V3): undo the MoE terms' weighting by the layers' share
        scale = moe_share if t.block.startswith("MoE") else Fraction(1)
        out.append(dataclasses.replace(t, id=f"mtp_{t.id}", name=f"MTP layer: {t.name}", scope="last",
                                       elements=t.elements * (scale * n), source=f"{t.source}; {MTP_SRC}"))
    out += [
        saved("mtp_head_input", "MTP final norm's output = the output head's input", "MTP", f"{n} s b h", sp=True, scope="last",
           k22=False, src=MTP_SRC),
        saved("mtp_logits_fp32", "MTP fp32 logits for its cross-entropy", "MTP", f"{n} s b v", "fp32", tp=True,
           scope="last", k22=False, src=MTP_SRC),
        saved("mtp_target_ids", "MTP targets (int64, the labels rolled by one)", "MTP", f"{n} s b", "int64",
           scope="last", k22=False, src=MTP_SRC),
    ]
    return out
