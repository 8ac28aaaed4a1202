"""The config.json readers of DeepSeek-V3's near relatives and the families beside them (issue 22, the registry walk):
latent attention with a lightning indexer (DeepSeek-V3.2, GLM-5, A.X-K2: ModelSpec.mla_indexer; A.X-K2's query gate
and gated norms: mla_query_gate, gated_norm_rank), A.X-K1's norm on the MoE
block's output (moe_block_norms), Flint's sinks beside Qwen3-MoE's experts with an ungated shared expert, Beam's gate
on the attention output with a bias per head (attention_gate_bias), MiMo-V2-Flash's attention by layer kind
(value_head_dim, full_attention_layers, sinks_sliding_only); each checked
by the walk (memplan/check/registry.py) against transformers' count of the model on the meta device.

``LATENT_KEYED``: what each family sets on ModelSpec beyond the Llama layout (hf_config reads the rest, as for
hf_families.LLAMA_KEYED), every one of them reading its experts; ``LATENT_APPROXIMATED``: where --impl megatron*
approximates the layer (a note; the indexer families are refused there: memplan/inventory/assemble.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from memplan.core.errors import MemplanError
from memplan.core.spec_base import echo
from memplan.presets.hf_families import YAML_HINT, deepseek_experts, dense_first, flag, nat


def _latent_moe(data: dict, dense: int, path: Path) -> dict[str, Any]:
    """DeepSeek-V3's latent attention (with the query latent these families always build) and experts (dense layers
    from mlp_layer_types, else the first ``dense``); a missing key is refused (hf_config: KeyError)."""
    if flag(data, "attention_bias", False, path):
        raise MemplanError(f"{path}: attention_bias: memplan models latent attention without biases; {YAML_HINT}")
    d = {k: data[k] for k in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts")}
    mla = {k: nat(data, k, data[k], path) for k in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                                                    "qk_rope_head_dim", "v_head_dim")}
    return dict(deepseek_experts(dict(d, first_k_dense_replace=dense_first(data, dense, path))), **mla)


def _dsa(data: dict, path: Path) -> dict[str, Any]:
    """DeepSeek-V3.2 (DeepseekV32ForCausalLM) and GLM-5 (GlmMoeDsaForCausalLM): DeepSeek-V3's latent attention and
    experts (first_k_dense_replace default 3) with a lightning indexer in each layer (index_n_heads heads
    index_head_dim wide: ModelSpec.mla_indexer). GLM-5's indexer_types (else index_topk_pattern, else index_topk_freq /
    index_skip_topk_offset) may leave a layer without one ("shared"): refused."""
    out = _latent_moe(data, 3, path)
    L = nat(data, "num_hidden_layers", 61, path)
    types, pattern, freq = data.get("indexer_types"), data.get("index_topk_pattern"), data.get("index_topk_freq", 1)
    if types is None and pattern is not None:  # GlmMoeDsaConfig.__post_init__
        types = [{"F": "full", "S": "shared"}.get(c) for c in pattern] if isinstance(pattern, str) else pattern
    if types is None and isinstance(freq, int) and freq > 1:
        offset = data.get("index_skip_topk_offset", 2)
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(L)] \
            if isinstance(offset, int) else None
    if types is not None and (not isinstance(types, list) or any(t != "full" for t in types)):
        raise MemplanError(f"{path}: indexer_types / index_topk_pattern / index_topk_freq: memplan models an indexer "
                           f"in every layer (all \"full\"; got {echo(types)}); {YAML_HINT}")
    return dict(out, mla_indexer=_indexer(data, path))


def _moe_layer_types(data: dict, path: Path) -> dict:
    """The config with its mlp_layer_types as AXK1Config / AXK2Config derive them where the file has none: the first
    first_k_dense_replace (default 1) layers dense, then every moe_layer_freq-th (default 1) MoE."""
    if data.get("mlp_layer_types") is not None:
        return data
    L, k, freq = nat(data, "num_hidden_layers", 61, path), data.get("first_k_dense_replace", 1), \
        nat(data, "moe_layer_freq", 1, path)
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise MemplanError(f"{path}: first_k_dense_replace: expected a count of layers (got {echo(k)})")
    return dict(data, mlp_layer_types=["sparse" if isinstance(k, int) and i >= k and i % freq == 0 else "dense"
                                       for i in range(L)])


def _axk1(data: dict, path: Path) -> dict[str, Any]:
    """A.X-K1 (AXK1ForCausalLM): DeepSeek-V3 with an RMSNorm on each MoE block's output (mlp.post_mlp_layernorm:
    moe_block_norms 1); memplan: dense layers first."""
    return dict(_latent_moe(_moe_layer_types(data, path), 1, path), moe_block_norms=1)


def _axk2(data: dict, path: Path) -> dict[str, Any]:
    """A.X-K2 (AXK2ForCausalLM): DeepSeek-V3.2's latent attention and indexer in every layer, the query latent and
    its norm's output projected together to the queries and a gate on the attention output (q_gate_proj:
    mla_query_gate), a low-rank sigmoid gate after the input norm of every layer and the post-attention norm of the
    MoE layers (AXK2GatedRMSNorm, gated_norm_rank); its layers as A.X-K1's."""
    return dict(_latent_moe(_moe_layer_types(data, path), 1, path), mla_query_gate=True,
                gated_norm_rank=nat(data, "gated_norm_rank", 16, path), mla_indexer=_indexer(data, path))


def _indexer(data: dict, path: Path) -> tuple[int, int]:
    return nat(data, "index_n_heads", data["index_n_heads"], path), nat(data, "index_head_dim", data["index_head_dim"],
                                                                         path)


def _flint(data: dict, path: Path) -> dict[str, Any]:
    """Flint (FlintForCausalLM): Qwen3-MoE's layer (q / k norms per head) with attention sinks in every layer; the
    layers in mlp_only_layers (default [0, 1]) dense, intermediate_size wide, the others num_experts experts
    moe_intermediate_size wide, top num_experts_per_tok, beside one ungated shared expert shared_expert_intermediate_size
    wide (FlintSparseMoeBlock). memplan: dense layers first, decoder_sparse_step 1."""
    dense = data.get("mlp_only_layers")
    dense = [0, 1] if dense is None else dense
    if not isinstance(dense, list) or dense != list(range(len(dense))) or data.get("decoder_sparse_step", 1) != 1:
        raise MemplanError(f"{path}: mlp_only_layers / decoder_sparse_step: memplan models dense layers first only "
                           f"(mlp_only_layers [0, ..., k-1], decoder_sparse_step 1); {YAML_HINT}")
    return dict(num_experts=nat(data, "num_experts", 256, path), moe_top_k=nat(data, "num_experts_per_tok", 6, path),
                moe_ffn_hidden_size=nat(data, "moe_intermediate_size", 512, path),
                moe_shared_ffn_hidden_size=nat(data, "shared_expert_intermediate_size", 1024, path),
                moe_first_dense_layers=len(dense), attention_sinks=True, qk_norm=True)


def _beam(data: dict, path: Path) -> dict[str, Any]:
    """Beam (BeamForCausalLM): q / k norms per head, a sigmoid gate on the attention output (gate_proj h x q and a bias
    per head, gate_bias), four norms per layer (pre / post feed-forward ones too); dense layers first (mlp_layer_types,
    default 3) intermediate_size wide, then num_experts experts moe_intermediate_size wide, top num_experts_per_tok,
    no shared expert (BeamMoE; its router's correction bias is a buffer)."""
    return dict(num_experts=nat(data, "num_experts", 256, path), moe_top_k=nat(data, "num_experts_per_tok", 8, path),
                moe_ffn_hidden_size=nat(data, "moe_intermediate_size", 2560, path),
                moe_first_dense_layers=dense_first(data, 3, path), qk_norm=True, sandwich_norms=True,
                attention_output_gate="full", attention_gate_bias=True)


def _mimo(data: dict, path: Path) -> dict[str, Any]:
    """MiMo-V2-Flash (MiMoV2FlashForCausalLM): q / k heads head_dim wide, V heads v_head_dim wide (value_head_dim),
    biases on q, k and v (attention_bias); the sliding-window layers of layer_types (default: all but the first and
    every sixth) with twice num_key_value_heads K / V heads and attention sinks, the full-attention ones with
    num_key_value_heads and none (MiMoV2FlashAttention); dense layers first (mlp_layer_types, default one)
    intermediate_size wide, then n_routed_experts experts moe_intermediate_size wide, no shared expert."""
    L, g = nat(data, "num_hidden_layers", 48, path), nat(data, "num_key_value_heads", 4, path)
    types = data.get("layer_types") or ["full_attention" if i == 0 or not (i + 1) % 6 else "sliding_attention"
                                        for i in range(L)]
    if not isinstance(types, list) or len(types) != L or set(types) - {"full_attention", "sliding_attention"}:
        raise MemplanError(f"{path}: layer_types: expected full_attention or sliding_attention for each of the {L} "
                           f"layers (got {echo(types)})")
    full = types.count("full_attention")
    kv = dict(num_kv_heads=2 * g, full_attention_kv_heads=g, attention_sinks=True, sinks_sliding_only=full > 0,
              full_attention_layers=full) if full < L else dict(num_kv_heads=g)
    return dict(num_experts=nat(data, "n_routed_experts", 256, path), moe_top_k=nat(data, "num_experts_per_tok", 8,
                                                                                   path),
                moe_ffn_hidden_size=nat(data, "moe_intermediate_size", 2048, path),
                moe_first_dense_layers=dense_first(data, 1, path), head_dim=nat(data, "head_dim", 192, path),
                value_head_dim=nat(data, "v_head_dim", 128, path), qkv_bias=flag(data, "attention_bias", False, path),
                attention_bias=False, **kv)


LATENT_KEYED: dict[str, Callable[[dict, Path], dict[str, Any]]] = {
    "DeepseekV32ForCausalLM": _dsa, "GlmMoeDsaForCausalLM": _dsa, "AXK1ForCausalLM": _axk1, "FlintForCausalLM": _flint,
    "BeamForCausalLM": _beam, "AXK2ForCausalLM": _axk2, "MiMoV2FlashForCausalLM": _mimo,
}

LATENT_APPROXIMATED = {
    "AXK1ForCausalLM": "A.X-K1 normalises each MoE block's output (post_mlp_layernorm)",
    "FlintForCausalLM": "Flint's attention has sinks",
    "MiMoV2FlashForCausalLM": "MiMo-V2-Flash's V heads are narrower than its Q / K heads and its sliding-window layers "
                              "have twice the K / V heads and attention sinks",
    "BeamForCausalLM": "Beam gates the attention output by a sigmoid of a linear of the layer input (with a bias per "
                       "head), normalises the sub-layers' outputs too and scales the residual sums by depth",
}
