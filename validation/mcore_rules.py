"""How a saved storage of megatron-core's local-spec code is labelled: the rule tables.

Labels: every saved storage is labelled from the context of its first save, as validation/hf.py does
for transformers: (module path relative to the decoder layer / model, torch call, k-th saving call of
that op in that module, j-th saved tensor of the call), mapped by the rule tables here to memplan's
term ids. A storage no rule matches is "unlabeled" (tests demand none). validation/mcore.py labels its
measurements with them.
"""

from __future__ import annotations

import re
from typing import Optional

# ---------------------------------------------------------------------------------------------
# label rules: (module relative to the layer / model, op, k, j) -> memplan term id

FN = "Function"  # a torch.autograd.Function's save_for_backward (megatron-core's linears, checkpoint, loss)
LN, RMS = "torch.nn.functional.layer_norm", "torch.nn.functional.rms_norm"
DROPOUT, MUL = "torch.nn.functional.dropout", "torch.Tensor.mul"
ATTN, CORE = "<layer>.self_attention", "<layer>.self_attention.core_attention"


def _norm_rules(module: str, prefix: str) -> dict:
    """torch.nn.LayerNorm saves input, mean, rstd (bf16 statistics on CPU); torch.nn.RMSNorm on CPU runs
    F.rms_norm's composite path: an fp32 copy of the input, rstd (fp32) and the fp32 normalised input."""
    return {(module, LN, 0, 0): f"{prefix}_input", (module, LN, 0, 1): f"{prefix}_stats",
            (module, LN, 0, 2): f"{prefix}_stats",
            (module, RMS, 0, 0): f"{prefix}_fp32_input", (module, RMS, 0, 1): f"{prefix}_stats",
            (module, RMS, 0, 4): f"{prefix}_normed"}


LAYER_RULES: dict[tuple[str, str, int, int], str] = {
    **_norm_rules("<layer>.input_layernorm", "ln1"),
    ("<layer>.self_attention.linear_qkv", FN, 0, 0): "qkv_input",
    # apply_rotary_pos_emb (unfused): t * cos and rotate_half(t) * sin save cos and sin, made per call from
    # the freqs, for Q and for K
    **{(ATTN, MUL, k, 0): "rope_cos_sin" for k in range(4)},
    # DotProductAttention: baddbmm(buffer, Q, K^T) saves Q and K, bmm(probs, V) saves V: views of the QKV
    # projection's output (one storage) for GPT; Q and K after RoPE and K, V repeated to the a heads for GQA
    (CORE, "torch.baddbmm", 0, 0): "qkv",
    (CORE, "torch.baddbmm", 0, 1): "qkv",
    (CORE, "torch.bmm", 0, 0): "qkv",
    (f"{CORE}.scale_mask_softmax", "torch.Tensor.masked_fill_", 0, 0): "causal_mask",
    (f"{CORE}.scale_mask_softmax", "torch.nn.functional.softmax", 0, 0): "softmax_out",
    (f"{CORE}.attention_dropout", DROPOUT, 0, 0): "softmax_mask",
    (CORE, "torch.bmm", 0, 1): "attn_dropout_out",  # dropout output, or the bf16 probabilities of an fp32 softmax
    # selective recompute: CheckpointFunction around the attention core saves Q, K, V, the mask and
    # attn_mask_type as an int tensor
    **{(ATTN, FN, 0, j): "qkv" for j in range(3)},
    (ATTN, FN, 0, 3): "causal_mask",
    (ATTN, FN, 0, 4): "attn_mask_type",
    ("<layer>.self_attention.linear_proj", FN, 0, 0): "proj_input",
    ("<layer>", DROPOUT, 0, 0): "attn_dropout_mask",  # self_attn_bda (bias_dropout_fusion off: F.dropout)
    **_norm_rules("<layer>.pre_mlp_layernorm", "ln2"),
    ("<layer>.mlp.linear_fc1", FN, 0, 0): "fc1_input",
    ("<layer>.mlp", "torch.nn.functional.gelu", 0, 0): "gelu_input",
    ("<layer>.mlp", "torch.nn.functional.silu", 0, 0): "swiglu_input",  # a view of fc1's 2f-wide output
    ("<layer>.mlp", MUL, 0, 0): "swiglu_up",  # x_linear + glu_linear_offset (a new tensor)
    ("<layer>.mlp", MUL, 0, 1): "swiglu_silu_out",
    ("<layer>.mlp.linear_fc2", FN, 0, 0): "fc2_input",
    ("<layer>", DROPOUT, 1, 0): "mlp_dropout_mask",
}

MOE, ROUTER, SHARED = "<layer>.mlp", "<layer>.mlp.router", "<layer>.mlp.shared_experts"
SILU = "torch.nn.functional.silu"


def _expert_rules(expert: str) -> dict:
    """One SequentialMLP expert (an MLP on its tokens, probabilities applied after the activation)."""
    return {(f"{expert}.linear_fc1", FN, 0, 0): "moe_permuted_tokens",  # its slice of the routed tokens
            (expert, SILU, 0, 0): "moe_fc1_output", (expert, MUL, 0, 0): "moe_swiglu_up",
            (expert, MUL, 0, 1): "moe_silu_out", (expert, MUL, 1, 0): "moe_permuted_probs",
            (expert, MUL, 1, 1): "moe_act_out", (f"{expert}.linear_fc2", FN, 0, 0): "moe_fc2_input"}


def _gelu_expert_rules(expert: str) -> dict:
    """One SequentialMLP expert with a GeLU MLP (no GLU): the probabilities' multiply is its first."""
    return {(expert, "torch.nn.functional.gelu", 0, 0): "moe_fc1_output", (expert, MUL, 0, 0): "moe_permuted_probs",
            (expert, MUL, 0, 1): "moe_act_out"}


GELU_SHARED_RULES = {(SHARED, "torch.nn.functional.gelu", 0, 0): "shared_fc1_output"}


# the z-loss (--moe-z-loss-coeff) runs before the routing: logsumexp keeps the logits and its output, and its
# MoEAuxLossAutoScaler is the router's second Function (the aux loss's then the third)
Z_LOSS_RULES = {(ROUTER, "torch.logsumexp", 0, 0): "moe_z_logits", (ROUTER, "torch.logsumexp", 0, 1): "moe_z_lse",
                (ROUTER, FN, 1, 0): "moe_z_loss", (ROUTER, FN, 2, 0): "moe_aux_loss"}

# megatron-core's MoELayer (memplan/inventory/moe.py): router, permutation, SequentialMLP experts, shared experts
MOE_RULES: dict[tuple[str, str, int, int], str] = {
    (ROUTER, FN, 0, 0): "fc1_input",  # RouterGatingLinearFunction keeps the MLP input
    (f"{SHARED}.linear_fc1", FN, 0, 0): "fc1_input",  # the same storage, when the shared experts run first
    (ROUTER, "torch.topk", 0, 0): "moe_topk_indices",
    (ROUTER, "torch.softmax", 0, 0): "moe_topk_probs",
    (ROUTER, "torch.softmax", 1, 0): "moe_aux_scores",
    (ROUTER, FN, 1, 0): "moe_aux_loss",  # MoEAuxLossAutoScaler
    (MOE, "torch.Tensor.masked_select", 0, 0): "moe_routing_map",
    (MOE, "torch.Tensor.masked_select", 0, 1): "moe_probs_dense",
    (MOE, "torch.Tensor.__getitem__", 0, 0): "moe_sort_index",  # 0.19.2's argsort, indexing the probabilities
    (MOE, "torch.Tensor.index_select", 0, 0): "moe_permute_index",
    (MOE, FN, 0, 0): "fc1_input",  # selective recompute "moe" / "shared_experts": the checkpoint keeps the MLP input
    (MOE, "torch.Tensor.index_select", 1, 0): "moe_permute_index",  # padded to capacity: the probabilities'
    (SHARED, SILU, 0, 0): "shared_fc1_output", (SHARED, MUL, 0, 0): "shared_swiglu_up",
    (SHARED, MUL, 0, 1): "shared_silu_out", (f"{SHARED}.linear_fc2", FN, 0, 0): "shared_fc2_input",
    **{k: v for i in range(16) for k, v in _expert_rules(f"{MOE}.experts.local_experts.{i}").items()},
}
# the router's multiplies: the token dropping's routing map (bool) and the aux loss's tokens per expert (int64),
# in either order
ROUTER_MUL = {"bool": "moe_routing_map", "int64": "moe_aux_counts"}

# megatron-core's MLASelfAttention (memplan/inventory/mla.py): down projections, latent norms, up projections; RoPE's
# cos / sin and the core attention's Q, K, V are LAYER_RULES' (ATTN, CORE)
MLA_RULES: dict[tuple[str, str, int, int], str] = {
    **{(f"{ATTN}.{proj}", FN, 0, 0): "qkv_input" for proj in ("linear_q_down_proj", "linear_kv_down_proj",
                                                               "linear_q_proj")},
    **{(f"{ATTN}.{which}_layernorm", RMS, 0, j): f"mla_{which}_{part}" for which in ("q", "kv")
       for j, part in ((0, "fp32_latent"), (1, "norm_stats"), (4, "normed"))},
    (f"{ATTN}.linear_q_up_proj", FN, 0, 0): "mla_q_up_input",
    (f"{ATTN}.linear_kv_up_proj", FN, 0, 0): "mla_kv_up_input",
}

MODEL_RULES: dict[tuple[str, str, int, int], str] = {
    ("embedding.word_embeddings", "torch.nn.functional.embedding", 0, 0): "token_ids",
    ("embedding.word_embeddings", "torch.Tensor.__setitem__", 0, 0): "embedding_input_mask",  # t > 1
    ("embedding.position_embeddings", "torch.nn.functional.embedding", 0, 0): "position_ids",
    ("embedding.embedding_dropout", DROPOUT, 0, 0): "embedding_dropout_mask",
    **_norm_rules("decoder.final_layernorm", "final_ln"),
    ("output_layer", FN, 0, 0): "head_input",
    # VocabParallelCrossEntropy saves exp_logits (the fp32 softmax), target_mask, masked_target_1d
    ("", FN, 0, 0): "logits_fp32",
    ("", FN, 0, 1): "target_mask",
    ("", FN, 0, 2): "target_ids",
    # full recompute: CheckpointFunction around the layers saves the hidden states and the mask
    **{("decoder", FN, k, 0): "ln1_input" for k in range(8)},
    **{("decoder", FN, k, 1): "causal_mask" for k in range(8)},
    **{("decoder", FN, k, 2): "rope_freqs" for k in range(8)},  # RoPE's fp32 freqs, an input of every checkpoint
}

LAYER_RE = re.compile(r"^(?:decoder\.)?layers\.(\d+)(?:\.(.*))?$")


def split_module(path: str) -> tuple[Optional[int], str]:
    m = LAYER_RE.match(path)
    if m:
        return int(m.group(1)), m.group(2) or ""
    return None, path
