"""The parameter groups of DeepSeek-V3.2's near relatives beside latent attention (issue 22; states.model_groups adds
them): the lightning indexer (ModelSpec.mla_indexer: DeepseekV32Indexer's wq_b r_q -> H_i D_i, wk h -> D_i, k_norm a
LayerNorm D_i with bias, weights_proj h -> H_i, whole on every GPU) and A.X-K2's gated norms (gated_norm_rank r: each
gate's fc1 h -> r and fc2 r -> h, one after every layer's input norm, a second after each MoE layer's post-attention
norm).
The indexer's parameters get no gradient (transformers runs DeepseekV32Indexer.forward / GlmMoeDsaIndexer.forward under
@torch.no_grad, k_norm and weights_proj inside it), so no optimizer state: weights only (ParamGroup.trained)."""

from __future__ import annotations

from memplan.core.model import ModelSpec
from memplan.core.symbolic import Poly
from memplan.memory.param_group import ParamGroup

INDEXER = "lightning indexer"  # ModelSpec.mla_indexer
NORM_GATES = "gated norms' low-rank gates"  # ModelSpec.gated_norm_rank


def indexer_groups(model: ModelSpec) -> list[ParamGroup]:
    """The indexer's and the gated norms' groups of one layer (none for a model without them)."""
    groups = []
    if model.mla_indexer:
        n, d = model.mla_indexer
        groups.append(ParamGroup(INDEXER, Poly.parse_sum(f"{n * d} rq + {d + n} h + {2 * d}"), False, "layer",
                                 trained=False))  # its forward runs under torch.no_grad: no gradient, no state
    if model.gated_norm_rank:
        gates = Poly.parse(f"{2 * model.gated_norm_rank} h")
        groups.append(ParamGroup(NORM_GATES, gates, False, "layer"))
        groups += [ParamGroup(NORM_GATES + " (MoE layers)", gates, False, "moe")] if model.is_moe else []
    return groups
