"""Checks of ModelSpec's fields that involve one group of them alone, called by its validator (memplan/core/model.py):
a mixture-of-experts model's fields and routing loads (moe_expert_loads), multi-head latent attention's fields and the gate on the
attention output."""

from __future__ import annotations

from typing import Any, Optional


def check_expert_loads(loads: Optional[tuple[float, ...]], imbalance: float, E: int, k: int) -> None:
    """moe_expert_loads: the loads of E/ep experts (a count dividing E), none negative or above E / k times the
    average (an expert receives each token at most once), in place of moe_imbalance."""
    if not loads or E % len(loads) or min(loads) < 0:
        raise ValueError(f"moe_expert_loads takes the loads of E/ep experts (a count dividing num_experts={E}), "
                         f"none negative (got {len(loads or ())})")
    if imbalance != 1.0:
        raise ValueError("moe_expert_loads and moe_imbalance both give the routing's imbalance: give one")
    if max(loads) > E / k:
        raise ValueError(f"moe_expert_loads: an expert's load {max(loads):g} x the average exceeds E / k = "
                         f"{E / k:g} (each token goes to an expert at most once)")


def check_latent(model: Any) -> None:
    """Multi-head latent attention's fields come together (kv_lora_rank and the three head widths; q_lora_rank
    optional; mla_indexer and mla_query_gate need the query latent), without biases (``model``: the ModelSpec being validated)."""
    fields = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    if not model.is_mla:
        given = [name for name in ("q_lora_rank",) + fields + ("mla_indexer",) if getattr(model, name) is not None]
        given += ["mla_query_gate"] * model.mla_query_gate
        if given:
            raise ValueError(f"{given[0]} is a multi-head latent attention field: it needs kv_lora_rank")
        return
    missing = [name for name in fields if getattr(model, name) is None]
    if missing:
        raise ValueError(f"kv_lora_rank={model.kv_lora_rank} (multi-head latent attention) needs {missing[0]}")
    if model.bias:
        raise ValueError("bias: memplan models multi-head latent attention without biases (DeepSeek-V3); set "
                         "bias: false")
    if model.mla_query_gate and model.q_lora_rank is None:
        raise ValueError("mla_query_gate projects the query latent: it needs q_lora_rank")
    if model.mla_indexer and (model.q_lora_rank is None or model.mla_indexer[1] < model.qk_rope_head_dim):
        raise ValueError(f"mla_indexer {model.mla_indexer}: the indexer projects the query latent (it needs "
                         f"q_lora_rank) into heads at least qk_rope_head_dim={model.qk_rope_head_dim} wide")


def check_gate(model: Any) -> None:
    """The attention's own fields agree: attention_gate_bias needs attention_output_gate, sinks_sliding_only
    attention_sinks, value_head_dim standard attention, full_attention_layers at most num_layers."""
    if model.attention_gate_bias and not model.attention_output_gate:
        raise ValueError("attention_gate_bias is the bias of the gate on the attention output: it needs "
                         "attention_output_gate")
    if model.sinks_sliding_only and not model.attention_sinks:
        raise ValueError("sinks_sliding_only says which layers have the attention sinks: it needs attention_sinks")
    if model.value_head_dim and model.is_mla:
        raise ValueError("value_head_dim is standard attention's V width: latent attention's is v_head_dim")
    if (model.full_attention_layers or 0) > model.num_layers:
        raise ValueError(f"full_attention_layers={model.full_attention_layers} exceeds num_layers={model.num_layers}")


def check_experts(model: Any) -> None:
    """A mixture-of-experts model's fields agree: the MoE fields need num_experts, k <= E, at least one
    MoE layer; its experts have no biases."""
    E, k = model.num_experts, model.moe_top_k
    if model.moe_pad_to_capacity and model.moe_capacity_factor is None:
        raise ValueError("moe_pad_to_capacity needs moe_capacity_factor (the capacity experts are padded to)")
    if E is None:
        given = [name for name in ("moe_top_k", "moe_ffn_hidden_size", "moe_capacity_factor", "moe_z_loss_coeff",
                                   "moe_router_dtype", "moe_expert_loads")
                 if getattr(model, name) is not None]
        given += ["moe_imbalance"] if model.moe_imbalance != 1.0 else []
        given += [name for name in ("moe_shared_ffn_hidden_size", "moe_first_dense_layers", "moe_aux_loss_coeff",
                                    "moe_router_pre_softmax", "moe_grouped_gemm", "moe_permute_fusion",
                                    "moe_shared_expert_overlap") if getattr(model, name)]
        if given:
            raise ValueError(f"{given[0]} is a mixture-of-experts field: it needs num_experts (the routed experts)")
        return
    if k is None:
        raise ValueError(f"num_experts={E} needs moe_top_k (the routed experts each token goes through)")
    if model.moe_expert_loads is not None:
        check_expert_loads(model.moe_expert_loads, model.moe_imbalance, E, k)
    if model.moe_token_dispatcher == "flex" and model.moe_pad_to_capacity:
        raise ValueError("the flex dispatcher with DeepEP does not pad to capacity (megatron-core 0.16.1 "
                         "TransformerConfig)")
    if model.moe_shared_expert_overlap and not (model.moe_shared_ffn_hidden_size
                                                and model.moe_token_dispatcher == "alltoall"):
        raise ValueError("moe_shared_expert_overlap needs shared experts (moe_shared_ffn_hidden_size) and the "
                         "alltoall dispatcher (megatron-core 0.16.1 TransformerConfig)")
    if k > E:
        raise ValueError(f"moe_top_k={k} exceeds num_experts={E}: a token cannot go through more experts than "
                         "there are")
    if model.moe_first_dense_layers >= model.num_layers:
        raise ValueError(f"moe_first_dense_layers={model.moe_first_dense_layers} leaves no MoE layer among the "
                         f"num_layers={model.num_layers}")
    if model.bias:
        raise ValueError("bias: memplan models mixture-of-experts layers without biases on every linear (Mixtral, "
                         "Qwen3-MoE); set bias: false (attention_bias and moe_bias put them where gpt-oss has "
                         "them)")
