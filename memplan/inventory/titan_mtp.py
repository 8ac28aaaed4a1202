"""torchtitan 0.3.0's multi-token prediction for DeepSeek-V3 (`--impl torchtitan --mtp N`: models/deepseek_v3/mtp.py,
``model_registry(flavor, num_mtp_layers=N)``; its flavours build none by default): what the N MTP layers keep for the
backward, as Inventory terms of the last stage (scope "last": alive from the forward to the loss's backward, like the
head's).

torchtitan's MTPDecoder runs the main decoder, then for depth k = 1 .. N: the input tokens shifted by k
(``roll_mtp_sequence``: a new int64 tensor and a bool valid mask), their embedding (the shared tok_embeddings), the
previous depth's hidden state (the main decoder's last layer output before its norm at depth 1) times the valid mask,
``eh_proj(cat(enorm(embedding), hnorm(hidden)))``, one MLA + MoE transformer block (a copy of the last layer's config)
and ``mtp_norm``; each depth's output goes through the shared lm_head, and MTPLoss adds each depth's cross-entropy on
the labels shifted by k (scaled by mtp_scale / N).  torchtitan's activation checkpointing wraps ``model.layers`` only,
so the MTP layers keep everything under every AC mode.  Per depth, per token of s b (CPU kernels):

* the MTP block: an MoE layer's terms under AC none (memplan/inventory/titan_dsv3.py), whatever the AC mode;
* enorm and hnorm: each norm's fp32 input, rstd and fp32 x * rstd (their bf16 outputs go to ``torch.cat``, which keeps
  nothing); mtp_norm the same and its bf16 output (the lm_head's input);
* eh_proj's input, the concatenation (2 x 2h, bf16); the valid mask in bf16 (2, kept by the multiply); the shifted
  token ids (int64, kept by the embedding) and the shifted labels (int64, kept by nll_loss);
* the depth's fp32 log-softmax of the logits (4 v), as the main loss's.

Measured: torchtitan's DeepSeekV3Model with 0, 1 and 2 MTP layers at tiny sizes run on CPU with MTPLoss, every saved
tensor counted (validation/titan_dsv3.py ``measure_dsv3_mtp``; tests/test_titan_mtp.py): each depth adds these to
the byte but what memplan leaves out everywhere (the grouped GEMMs' int32 offsets, nll_loss's 4-byte total_weight; the
RoPE cache rows gathered at the positions torchtitan's dataloader passes, 4 s b d_r B, are the MoE layer's
``rope.gathered`` term, as in every layer).  On CUDA the
fused RMSNorm (derived, as the layers').  torchtitan refuses MTP with pipeline or context parallelism
(MTPDecoder.Config.update_from_config raises NotImplementedError; titan_moe.check_titan_mtp refuses them here).

With TP (sequence parallel; torchtitan's ``_set_deepseek_v3_mtp_sharding``) the block is a decoder layer's (its terms'
own splits), enorm / hnorm / mtp_norm's fp32 terms, eh_proj's input and the valid mask are the rank's sequence shard
(/ t), mtp_norm's output all-gathered for the LM head (whole), the log-softmax the rank's vocab shard, and the shared
vocab-parallel Embedding keeps its bf16 vocab mask beside the clamped ids (TP only); eh_proj's weight is replicated
(states.mtp_stage_params).  With EP the block's routed terms are a decoder layer's.  Measured per rank with torchtitan's
own parallelize_deepseekv3 on 2 ranks over gloo (tp 2 at ep 1 and 2, tp 1 at ep 2: validation/titan_mtp.py;
tests/test_titan_mtp_tp.py), equal storage by storage but the same two left out everywhere.  Their FLOPs:
timing/flops.py ``mtp_flops`` (derived).
"""

from __future__ import annotations

import dataclasses

from memplan.core.model import ModelSpec
from memplan.core.training import Recompute
from memplan.inventory.moe import one_layer
from memplan.inventory.titan import TitanTerm, cuda_norm, llama3_layer_terms, titan_term
from memplan.inventory.types import Term, saved

MTP_MEASURED = ("measured: torchtitan 0.3.0 DeepSeekV3Model with MTP layers on CPU, MTPLoss, FlexAttention's save set "
                "in a stand-in (validation/titan_dsv3.py measure_dsv3_mtp; tests/test_titan_mtp.py), with TP and EP "
                "per rank over gloo (validation/titan_mtp.py; tests/test_titan_mtp_tp.py)")
NOTE = ("torchtitan multi-token prediction (--mtp N: model_registry num_mtp_layers): each MTP layer's MLA + MoE block, "
        "its enorm / hnorm / eh_proj / mtp_norm and its head's fp32 log-softmax kept until the loss's backward under "
        "every AC mode (torchtitan checkpoints model.layers only), measured on CPU, with TP and EP per rank over gloo; "
        "its parameters on the last stage (an MoE layer + 2h^2 + 3h each, eh_proj whole on every TP rank); its FLOPs "
        "(eh_proj, the block, the head's matmul) in the step time, derived")


def mtp_terms(model: ModelSpec, device: str, layer_terms: tuple[Term, ...]) -> list[Term]:
    """The model's ``mtp_layers`` MTP layers' kept tensors (module docstring); ``layer_terms``: one DeepSeek-V3
    layer's (titan_dsv3.dsv3_layer_terms: the MoE layer's, weighted by (L - n_dense) / L, taken whole here)."""
    n = model.mtp_layers
    if not n:
        return []
    src = MTP_MEASURED if device != "cuda" else f"{MTP_MEASURED}; on CUDA the fused RMSNorm derived"
    block = [dataclasses.replace(t, id=f"mtp.{t.id}", name=f"MTP layer: {t.name.split(' (in ')[0]}", scope="last",
                                 elements=one_layer(t, model).elements * n, layer_kind="", source=src,
                                 dropped_by_selective=False, kept_by_full=False)
             for t in layer_terms if t.layer_kind != "dense" and t.kept(Recompute.NONE) and t.id != "input"
             and not t.needs_cp]  # torchtitan runs no MTP layer with CP (check_titan_mtp)
    h = model.hidden_size
    norms: list[TitanTerm] = []
    for which in ("enorm", "hnorm", "mtp_norm"):  # under TP their fp32 terms sequence-sharded, mtp_norm's out gathered
        norms += [dataclasses.replace(t, id=t.id.replace("attention_norm", which),
                                      name=t.name.replace("attention_norm", f"MTP {which}"))
                  for t in llama3_layer_terms(h, 1, 1, 1) if t.id.startswith("attention_norm.")
                  and (which == "mtp_norm" or not t.id.endswith(".out"))]  # enorm, hnorm: their outputs go to cat
    norms = cuda_norm(norms) if device == "cuda" else norms
    extra = [dataclasses.replace(titan_term(t, src, "last"), id=f"mtp.{t.id}") for t in norms]
    extra += [saved(f"mtp.{i}", name, block_name, elements, dtype, scope="last", k22=False, src=src, **split)
              for i, name, block_name, elements, dtype, split in (
                  ("eh_proj_in", "MTP eh_proj input: cat(enorm, hnorm) (bf16)", "mtp", f"{2 * h} s b", "act",
                   dict(sp=True)),
                  ("valid_mask", "MTP valid mask in the hidden's dtype (bf16)", "mtp", "s b", "act", dict(sp=True)),
                  ("token_ids", "MTP shifted token ids (int64, tok_embeddings; under TP their clamp to the rank's "
                   "vocab shard)", "mtp", "s b", "int64", {}),
                  ("embed_mask", "MTP embedding's vocab-shard mask (bf16; TP only: the vocab-parallel embedding's)",
                   "mtp", "s b", "act", dict(needs_tp=True)),
                  ("labels", "MTP shifted labels (int64, nll_loss)", "output", "s b", "int64", {}),
                  ("logits_fp32", "MTP head's fp32 log-softmax of the logits (its vocab shard under TP)", "output",
                   "s b v", "fp32", dict(tp=True)))]
    return block + [dataclasses.replace(t, elements=t.elements * n) for t in extra]
