"""The config.json readers of transformers' further families (issue 22, the registry walk): what each family's
config sets on ModelSpec, from transformers' own modelling code (transformers 5.23), each checked by the walk
(memplan/check/registry.py) against transformers' parameter count of the model built on the meta device.

``LLAMA_KEYED``: families whose config.json names the Llama fields (hidden_size, num_hidden_layers,
intermediate_size, ...): the fields they set beyond the Llama layout (hf_config reads the rest).
(hf_own_keys.py reads the families with their own key names on these helpers.)  ``APPROXIMATED``: where a family's layer differs from the sequential
pre-norm layer the --impl megatron* inventories model (the config reader adds it as a note)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from memplan.core.errors import MemplanError
from memplan.core.spec_base import echo

YAML_HINT = "write a model YAML (docs/reference.md, Model presets)"


def flag(data: dict, key: str, default: bool, path: Path) -> bool:
    """A true / false field of a config.json: JSON's true or false (a string "false" is refused, not read as true);
    missing or null: transformers' default."""
    value = data.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise MemplanError(f"{path}: {key}: expected true or false (got {echo(value)})")
    return value


def nat(data: dict, key: str, default: Any, path: Path) -> Any:
    """A positive-integer field of a config.json (``default`` when missing; a bool, 0 or a string is refused)."""
    value = data.get(key, default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise MemplanError(f"{path}: {key}: expected a positive integer (got {echo(value)})")
    return value


def nat_or_default(data: dict, key: str, default: int, path: Path) -> int:
    """A positive-integer field whose null means the config class's default (OLMo-hybrid's derived widths, RWKV's
    attention_hidden_size, RecurrentGemma's lru_width)."""
    return nat(data if data.get(key) is not None else {}, key, default, path)


def layer_types(data: dict, key: str, table: dict, path: Path) -> str:
    """A layer-type list (layer_types, layers_block_type) as layer_pattern characters (``table``: type -> character)."""
    types = data.get(key)
    if not isinstance(types, list) or not types or not all(isinstance(t, str) and t in table for t in types):
        raise MemplanError(f"{path}: {key}: expected a list of the layer types {', '.join(sorted(table))} "
                           f"(got {echo(types)})")
    return "".join(table[t] for t in types)


def deepseek_experts(d: dict) -> dict[str, Any]:
    """The experts of a DeepSeek-V3-style config (DeepSeek-V2 / V3, GLM-4.5, dots.llm1): first_k_dense_replace
    dense layers intermediate_size wide, then n_routed_experts experts moe_intermediate_size wide, top
    num_experts_per_tok, and n_shared_experts shared ones as one MLP n_shared_experts x moe_intermediate_size wide;
    ``d``: the config with the family's defaults filled in."""
    fe, shared = d["moe_intermediate_size"], d["n_shared_experts"]
    both_ints = all(isinstance(x, int) and not isinstance(x, bool) for x in (fe, shared))
    return dict(num_experts=d["n_routed_experts"], moe_top_k=d["num_experts_per_tok"], moe_ffn_hidden_size=fe,
                moe_shared_ffn_hidden_size=fe * shared if both_ints else shared,
                moe_first_dense_layers=d["first_k_dense_replace"])


def _glm(data: dict, path: Path) -> dict[str, Any]:  # GlmAttention: attention_bias on q, k, v (not o_proj)
    return dict(qkv_bias=flag(data, "attention_bias", True, path), attention_bias=False)


def _glm4(data: dict, path: Path) -> dict[str, Any]:  # and post_self_attn_layernorm / post_mlp_layernorm
    return dict(_glm(data, path), sandwich_norms=True)


def _plain_mlp(data: dict, path: Path) -> dict[str, Any]:  # Arcee, Nemotron: up_proj, down_proj (relu2)
    return dict(mlp="gelu", **({"norm": "layernorm", "norm_eps": data.get("norm_eps")}
                               if data.get("model_type") == "nemotron" else {}))


def _phi(data: dict, path: Path) -> dict[str, Any]:
    """PhiDecoderLayer: one LayerNorm before attention and MLP in parallel, every linear and lm_head biased."""
    if flag(data, "qk_layernorm", False, path):
        raise MemplanError(f"{path}: Phi with qk_layernorm (a LayerNorm with bias per head): not modelled; {YAML_HINT}")
    return dict(norm="layernorm", mlp="gelu", bias=True, norms_per_layer=1, layer_layout="parallel", head_bias=True,
                norm_eps=data.get("layer_norm_eps"))


def _persimmon(data: dict, path: Path) -> dict[str, Any]:
    """PersimmonDecoderLayer: LayerNorms with bias, every linear biased, q / k LayerNorms (with bias) per head."""
    return dict(norm="layernorm", mlp="gelu", bias=True, qk_norm=flag(data, "qk_layernorm", True, path),
                norm_eps=data.get("layer_norm_eps"))


def _qwen2_moe(data: dict, path: Path) -> dict[str, Any]:
    """Qwen2MoeSparseMoeBlock: Qwen3-MoE's experts (hf_config reads them) plus a shared expert
    shared_expert_intermediate_size wide behind a sigmoid gate (shared_expert_gate, h -> 1); qkv_bias on q, k, v."""
    shared = nat(data, "shared_expert_intermediate_size", 5632, path)
    return dict(qkv_bias=flag(data, "qkv_bias", True, path), moe_shared_ffn_hidden_size=shared,
                moe_shared_gate=True)


_DEEPSEEK_LIKE_DEFAULTS = {  # Glm4MoeConfig / Dots1Config defaults for the keys a config.json may leave out
    "glm4_moe": dict(n_routed_experts=128, num_experts_per_tok=8, moe_intermediate_size=1408, n_shared_experts=1,
                     first_k_dense_replace=1),
    "dots1": dict(n_routed_experts=None, num_experts_per_tok=None, moe_intermediate_size=None, n_shared_experts=None,
                  first_k_dense_replace=0),
}


def _deepseek_like(data: dict, path: Path) -> dict[str, Any]:
    """GLM-4.5 (Glm4MoeMoE) and dots.llm1 (Dots1MoE): DeepSeek-V3's experts (its correction bias a buffer) with
    standard attention; GLM-4.5: attention_bias on q, k, v, q / k norms per head with use_qk_norm; dots.llm1:
    attention_bias on all four projections, q / k norms per head always."""
    kind = "glm4_moe" if data.get("model_type") == "glm4_moe" else "dots1"
    d = {**_DEEPSEEK_LIKE_DEFAULTS[kind], **{k: data[k] for k in _DEEPSEEK_LIKE_DEFAULTS[kind] if k in data}}
    missing = [k for k, v in d.items() if v is None]
    if missing:
        raise MemplanError(f"{path}: missing field {missing[0]!r} for {data.get('architectures', ['dots1'])[0]}")
    if kind == "glm4_moe":
        attention = dict(qkv_bias=flag(data, "attention_bias", False, path), attention_bias=False,
                         qk_norm=flag(data, "use_qk_norm", False, path))
    else:
        attention = dict(qk_norm=True)
    return dict(deepseek_experts(d), **attention)


def _llama4(data: dict, path: Path) -> dict[str, Any]:
    """Llama4TextMoe: num_local_experts experts intermediate_size wide, top num_experts_per_tok, one shared expert
    as wide, in the layers moe_layers lists (default every interleave_moe_layer_step-th); the others a dense MLP
    intermediate_size_mlp wide; its q / k norm is an L2 norm without weights.  memplan models dense layers first."""
    L, f = nat(data, "num_hidden_layers", 48, path), nat(data, "intermediate_size", 8192, path)
    step = nat(data, "interleave_moe_layer_step", 1, path)
    moe = data.get("moe_layers")
    moe = list(range(step - 1, L, step)) if moe is None else moe
    if not isinstance(moe, list) or not moe or moe != list(range(L - len(moe), L)):
        raise MemplanError(f"{path}: moe_layers / interleave_moe_layer_step: memplan models MoE layers after the dense "
                           f"ones only (every layer from some k on; got {len(moe) if isinstance(moe, list) else 0} "
                           f"MoE layers of {L} not in that pattern); {YAML_HINT}")
    return dict(num_experts=nat(data, "num_local_experts", 16, path), moe_top_k=nat(data, "num_experts_per_tok", 1,
                                                                                         path),
                moe_ffn_hidden_size=f, moe_shared_ffn_hidden_size=f, moe_first_dense_layers=L - len(moe),
                ffn_hidden_size=nat(data, "intermediate_size_mlp", 16384, path))


def _hunyuan(data: dict, path: Path) -> dict[str, Any]:
    """HunYuan dense / MoE: q / k RMSNorms per head; the MoE's num_experts experts intermediate_size wide (top
    moe_topk), a router (gate.wg) and one shared MLP as wide in every layer."""
    if data.get("model_type") != "hunyuan_v1_moe":
        return dict(qk_norm=True)
    experts, k = data.get("num_experts", 1), data.get("moe_topk", 1)
    if not isinstance(experts, int) or not isinstance(k, int):
        raise MemplanError(f"{path}: num_experts / moe_topk per layer (a list): memplan models one expert count; "
                           f"{YAML_HINT}")
    return dict(qk_norm=True, num_experts=experts, moe_top_k=k, moe_shared_ffn_hidden_size=data.get(
        "intermediate_size", 11008))


def _ernie_moe(data: dict, path: Path) -> dict[str, Any]:
    """Ernie4_5_MoeSparseMoeBlock: moe_num_experts experts moe_intermediate_size wide, top moe_k, a router with a
    correction bias (a parameter, E per layer), moe_num_shared_experts shared ones; MoE in the layers from
    moe_layer_start_index to moe_layer_end_index every moe_layer_interval-th."""
    L = nat(data, "num_hidden_layers", 28, path)
    start, end = data.get("moe_layer_start_index", 1), data.get("moe_layer_end_index", 27)
    if data.get("moe_layer_interval", 1) != 1 or not isinstance(start, int) or not isinstance(end, int) \
            or end < L - 1 or flag(data, "use_bias", False, path):
        raise MemplanError(f"{path}: ERNIE 4.5 MoE with moe_layer_interval other than 1, moe_layer_end_index before "
                           f"the last layer or use_bias: memplan models MoE layers after the dense ones, without "
                           f"biases; {YAML_HINT}")
    fe = nat(data, "moe_intermediate_size", 1536, path)
    return dict(num_experts=nat(data, "moe_num_experts", 64, path), moe_top_k=nat(data, "moe_k", 2, path),
                moe_ffn_hidden_size=fe, moe_shared_ffn_hidden_size=fe * data.get("moe_num_shared_experts", 0),
                moe_first_dense_layers=max(start, 0), moe_router_bias=True)


def _dense_first(data: dict, default: int, path: Path) -> int:
    """The dense layers before the MoE ones: mlp_layer_types' leading "dense" entries (the rest "sparse"), else
    first_k_dense_replace (``default`` when missing)."""
    kinds = data.get("mlp_layer_types")
    if kinds is None:
        return nat(data, "first_k_dense_replace", default, path) if data.get("first_k_dense_replace") != 0 else 0
    k = next((i for i, kind in enumerate(kinds) if kind != "dense"), len(kinds)) if isinstance(kinds, list) else -1
    if k < 0 or any(kind != "sparse" for kind in kinds[k:]):
        raise MemplanError(f"{path}: mlp_layer_types: memplan models MoE layers after the dense ones only (dense, ..., "
                           f"sparse, ...); {YAML_HINT}")
    return k


dense_first = _dense_first  # its public name, for the readers of presets/hf_latent.py


def _routed(data: dict, experts: str, path: Path) -> dict[str, Any]:
    return dict(num_experts=nat(data, experts, None, path), moe_top_k=nat(data, "num_experts_per_tok", None, path))


def _minimax_m2(data: dict, path: Path) -> dict[str, Any]:
    """MiniMax-M2: Mixtral's experts (num_local_experts, intermediate_size wide) in every layer, q / k RMSNorms over
    the whole Q and K."""
    return dict(_routed(data, "num_local_experts", path), qk_norm=True, qk_norm_width="full")


def _flex_olmo(data: dict, path: Path) -> dict[str, Any]:
    """FlexOlmo: OLMo-2's layer (post-norms, whole-width q / k norms) with OLMoE's experts (intermediate_size wide)."""
    return dict(_routed(data, "num_experts", path), qk_norm=True, qk_norm_width="full", layer_layout="post-norm")


def _shared_moe(data: dict, path: Path) -> dict[str, Any]:
    """Solar Open (n_shared_experts, every layer MoE), EXAONE MoE and Hunyuan 3 (num_shared_experts, dense layers
    first, q / k norms per head): num_experts / n_routed_experts experts moe_intermediate_size wide, shared ones as
    one MLP (shared count) x moe_intermediate_size wide."""
    solar = data.get("model_type") == "solar_open"
    fe = nat(data, "moe_intermediate_size", None, path)
    shared = nat(data, "n_shared_experts" if solar else "num_shared_experts", 1, path)
    out = dict(_routed(data, "n_routed_experts" if solar else "num_experts", path), moe_ffn_hidden_size=fe,
               moe_shared_ffn_hidden_size=fe * shared)
    return dict(out, ffn_hidden_size=fe) if solar else dict(out, qk_norm=True, moe_first_dense_layers=_dense_first(
        data, 1, path))


def _cohere2_moe(data: dict, path: Path) -> dict[str, Any]:
    """Cohere2-MoE: Cohere 2's parallel block after one LayerNorm without bias; experts intermediate_size wide,
    num_shared_experts shared ones as one MLP that many times as wide; dense prefix layers
    prefix_dense_intermediate_size wide."""
    f, dense = nat(data, "intermediate_size", None, path), _dense_first(data, 0, path)
    shared = data.get("num_shared_experts", 0)
    out = dict(_routed(data, "num_experts", path), moe_ffn_hidden_size=f, moe_first_dense_layers=dense,
               norm="layernorm", norm_bias=False, norms_per_layer=1, layer_layout="parallel",
               tied_embeddings=flag(data, "tie_word_embeddings", True, path), norm_eps=data.get("layer_norm_eps"))
    out.update(moe_shared_ffn_hidden_size=f * shared) if isinstance(shared, int) and shared > 0 else None
    return dict(out, ffn_hidden_size=nat(data, "prefix_dense_intermediate_size", None, path)) if dense else out


def _cohere_compass(data: dict, path: Path) -> dict[str, Any]:
    """Cohere Compass's text model (North): Cohere 2's parallel block after one LayerNorm without bias, no q / k norms;
    its full-attention layers without position encoding (rope_parameters None there: no parameters either way)."""
    return dict(norm="layernorm", norm_bias=False, norms_per_layer=1, layer_layout="parallel",
                tied_embeddings=flag(data, "tie_word_embeddings", True, path), norm_eps=data.get("layer_norm_eps"))


def _glm4_moe_lite(data: dict, path: Path) -> dict[str, Any]:
    """GLM-4.7-Flash (Glm4MoeLite): DeepSeek-V3's multi-head latent attention and experts, the dense layers from
    mlp_layer_types."""
    d = {k: data[k] for k in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts")}
    mla = {k: data[k] for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    return dict(deepseek_experts(dict(d, first_k_dense_replace=_dense_first(data, 1, path))), **mla,
                q_lora_rank=data.get("q_lora_rank"))


def _olmo(data: dict, path: Path) -> dict[str, Any]:  # OlmoLayerNorm: no weight, no bias
    return dict(norm="layernorm", norm_params=False)


def _nanochat(data: dict, path: Path) -> dict[str, Any]:  # RMSNorms (q / k too) without weights; fc1 / fc2 relu2
    return dict(mlp="gelu", norm_params=False, qk_norm=True)


def _jais2(data: dict, path: Path) -> dict[str, Any]:  # LayerNorms with bias; up / down relu2 (hf_config: biases)
    return dict(norm="layernorm", mlp="gelu", norm_eps=data.get("layer_norm_eps"))


def _youtu(data: dict, path: Path) -> dict[str, Any]:  # DeepSeek-V3's latent attention, a dense gated MLP
    return dict(q_lora_rank=data.get("q_lora_rank"),
                **{k: data[k] for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")})


def _more_moe(data: dict, path: Path) -> dict[str, Any]:
    """Granite-MoE-SWA (GraniteMoe's experts intermediate_size wide, attention sinks), Mellum (experts
    moe_intermediate_size wide after mlp_layer_types' dense layers, q / k norms per head), Aria's text model
    (moe_num_experts experts intermediate_size wide, top moe_topk, moe_num_shared_experts shared ones as one MLP that
    many times as wide) and Kolibri (experts moe_intermediate_size wide, a shared one shared_expert_intermediate_size
    wide, four norms per layer, q / k norms per head); Mellum aside, every layer MoE."""
    kind = data.get("model_type")
    if kind == "granitemoe_swa":
        return dict(_routed(data, "num_local_experts", path), attention_sinks=True)
    if kind == "mellum":
        return dict(_routed(data, "num_local_experts", path), qk_norm=True, moe_first_dense_layers=_dense_first(
            data, 0, path), moe_ffn_hidden_size=nat(data, "moe_intermediate_size", None, path))
    if kind == "aria_text":
        f = nat(data, "intermediate_size", None, path)
        return dict(num_experts=nat(data, "moe_num_experts", 8, path), moe_top_k=nat(data, "moe_topk", 2, path),
                    moe_shared_ffn_hidden_size=f * nat(data, "moe_num_shared_experts", 2, path))
    fe = nat(data, "moe_intermediate_size", None, path)  # Kolibri
    return dict(_routed(data, "num_local_experts", path), qk_norm=True, sandwich_norms=True, ffn_hidden_size=fe,
                moe_ffn_hidden_size=fe,
                moe_shared_ffn_hidden_size=nat(data, "shared_expert_intermediate_size", None, path))


def _afmoe(data: dict, path: Path) -> dict[str, Any]:
    """AFMoE: num_dense_layers dense layers, then num_experts experts moe_intermediate_size wide (a sigmoid router
    with expert_bias, a parameter E per layer), num_shared_experts shared ones as one MLP that many times as wide;
    four norms per layer, q / k norms per head, a gate on the attention output (self_attn.gate_proj, h x q)."""
    fe, shared = nat(data, "moe_intermediate_size", 1408, path), data.get("num_shared_experts", 2)
    if shared != 0:
        shared = nat(data, "num_shared_experts", 2, path)
    dense = data.get("num_dense_layers", 1)
    return dict(num_experts=nat(data, "num_experts", 64, path), moe_top_k=nat(data, "num_experts_per_tok", 6, path),
                moe_ffn_hidden_size=fe, moe_shared_ffn_hidden_size=fe * shared, moe_router_bias=True,
                moe_first_dense_layers=0 if dense == 0 else nat(data, "num_dense_layers", 1, path),
                qk_norm=True, sandwich_norms=True, attention_output_gate="full")


def _apertus(data: dict, path: Path) -> dict[str, Any]:
    """Apertus: q / k norms per head, an up / down MLP whose xIELU activation (hidden_act "xielu") learns two scalars
    per layer (alpha_p, alpha_n)."""
    return dict(mlp="gelu", qk_norm=True, activation_params=2 if data.get("hidden_act", "xielu") == "xielu" else 0)


def _laguna(data: dict, path: Path) -> dict[str, Any]:
    """Laguna: AFMoE's attention with a gate (g_proj) per head (gating true or "per-head") or per channel, the
    heads of num_attention_heads_per_layer (one count for every layer), q / k norms per head; dense layers
    (mlp_layer_types) then num_experts experts moe_intermediate_size wide with a correction bias (a parameter, E
    per layer) and one shared expert shared_expert_intermediate_size wide."""
    heads = data.get("num_attention_heads_per_layer") or [nat(data, "num_attention_heads", None, path)]
    if not isinstance(heads, list) or len(set(map(str, heads))) != 1:
        raise MemplanError(f"{path}: num_attention_heads_per_layer: memplan models one head count for every layer "
                           f"(got {echo(heads)}); {YAML_HINT}")
    gating, a = data.get("gating", True), nat(data, "num_attention_heads", None, path)
    head_dim = nat(data, "head_dim", None, path) or nat(data, "hidden_size", None, path) // a  # config's a, not heads
    return dict(_routed(data, "num_experts", path), num_attention_heads=nat({"num_attention_heads_per_layer": heads[0]},
                                                                    "num_attention_heads_per_layer", None, path),
                head_dim=head_dim,
                moe_ffn_hidden_size=nat(data, "moe_intermediate_size", None, path),
                moe_shared_ffn_hidden_size=nat(data, "shared_expert_intermediate_size", None, path),
                moe_first_dense_layers=_dense_first(data, 0, path), moe_router_bias=True, qk_norm=True,
                attention_output_gate="head" if gating is True or gating == "per-head" else "full")


def _gemma4_full(data: dict, types: list, k_eq_v: bool, path: Path) -> tuple[Any, Any]:
    """The full-attention layers' head width and K / V heads: per_layer_config's overrides, the same for every
    full-attention layer and none for a sliding one (what Gemma4TextConfig writes); else global_head_dim (default
    512) and, with attention_k_eq_v, num_global_key_value_heads (Gemma4TextConfig.__post_init__)."""
    overrides = data.get("per_layer_config")
    if overrides is None:
        return nat(data, "global_head_dim", 512, path), \
            nat(data, "num_global_key_value_heads", None, path) if k_eq_v else None
    if not isinstance(overrides, dict) or not all(isinstance(k, str) and k.isdigit() and isinstance(v, dict)
                                                  for k, v in overrides.items()):
        raise MemplanError(f"{path}: per_layer_config: expected layer indices with their overrides (got "
                           f"{echo(overrides)})")
    by_layer = {int(k): v for k, v in overrides.items() if v}
    full = [i for i, kind in enumerate(types) if kind == "full_attention"]
    wanted = by_layer.get(full[0], {}) if full else {}
    if set(wanted) - {"head_dim", "num_key_value_heads"} or any(by_layer.get(i, {}) != wanted for i in full) \
            or set(by_layer) - set(full):
        raise MemplanError(f"{path}: per_layer_config: memplan models one head_dim / num_key_value_heads override "
                           f"shared by every full-attention layer and none on a sliding layer; {YAML_HINT}")
    return nat(wanted, "head_dim", None, path), nat(wanted, "num_key_value_heads", None, path)


def _gemma4(data: dict, path: Path) -> dict[str, Any]:
    """Gemma 4's text model (transformers Gemma4TextModel; Gemma4TextConfig's defaults for missing keys): Gemma 3's
    layer (q / k norms per head, four norms, GeLU-gated MLP) with the full-attention layers' own head width and K / V
    heads (_gemma4_full; attention_k_eq_v: their keys serve as values, no v_proj), the last num_kv_shared_layers
    layers reusing earlier K / V (use_double_wide_mlp: their MLP 2f wide), per-layer input embeddings
    (hidden_size_per_layer_input p, vocab_size_per_layer_input rows) and, with enable_moe_block, experts beside the
    dense MLP (the dense MLP read as the shared experts, f wide; the router's scales and the block's three norms).
    The full-attention layers must be every N-th (layer_types; default every 6th, the last one full)."""
    L = nat(data, "num_hidden_layers", 30, path)
    types = data.get("layer_types") or ["full_attention" if (i + 1) % 6 == 0 or i == L - 1 else "sliding_attention"
                                        for i in range(L)]
    if not isinstance(types, list) or len(types) != L:
        raise MemplanError(f"{path}: layer_types: expected one attention kind per layer ({L} layers)")
    n = types.index("full_attention") + 1 if "full_attention" in types else 0
    if n and types != ["full_attention" if (i + 1) % n == 0 else "sliding_attention" for i in range(L)] and \
            "sliding_attention" in types:
        raise MemplanError(f"{path}: layer_types: memplan models Gemma 4's full-attention layers as every N-th layer "
                           f"(every {n}-th here, the rest sliding); {YAML_HINT}")
    k_eq_v = flag(data, "attention_k_eq_v", False, path)
    head_dim, kv_heads = _gemma4_full(data, types, k_eq_v, path)
    shared = data.get("num_kv_shared_layers") or 0
    if isinstance(shared, bool) or not isinstance(shared, int) or not 0 <= shared < L:
        raise MemplanError(f"{path}: num_kv_shared_layers: expected a number of layers below {L} (got {echo(shared)})")
    p = data.get("hidden_size_per_layer_input", 256 if data.get("model_type") == "gemma4_text" else None) or 0
    out = dict(qk_norm=True, sandwich_norms=True, full_attention_head_dim=head_dim, full_attention_kv_heads=kv_heads,
               full_attention_k_eq_v=k_eq_v, kv_shared_layers=shared,
               kv_shared_double_mlp=flag(data, "use_double_wide_mlp", False, path) and shared > 0,
               per_layer_input_size=p, per_layer_input_vocab=nat(data, "vocab_size_per_layer_input", 262_144, path)
               if p else None)
    if flag(data, "enable_moe_block", False, path):
        out.update(num_experts=nat(data, "num_experts", None, path), moe_top_k=nat(data, "top_k_experts", None, path),
                   moe_ffn_hidden_size=nat(data, "moe_intermediate_size", None, path),
                   moe_shared_ffn_hidden_size=nat(data, "intermediate_size", 9216, path), moe_router_scales=True,
                   moe_block_norms=3)
    return out


LLAMA_KEYED: dict[str, Callable[[dict, Path], dict[str, Any]]] = {
    "GlmForCausalLM": _glm, "Glm4ForCausalLM": _glm4, "ArceeForCausalLM": _plain_mlp,
    "NemotronForCausalLM": _plain_mlp, "PhiForCausalLM": _phi, "PersimmonForCausalLM": _persimmon,
    "MinistralForCausalLM": lambda data, path: {}, "HunYuanDenseV1ForCausalLM": _hunyuan,
    "Qwen2MoeForCausalLM": _qwen2_moe, "Glm4MoeForCausalLM": _deepseek_like, "Dots1ForCausalLM": _deepseek_like,
    "Llama4ForCausalLM": _llama4, "HunYuanMoEV1ForCausalLM": _hunyuan, "Ernie4_5_MoeForCausalLM": _ernie_moe,
    "MiniMaxM2ForCausalLM": _minimax_m2, "FlexOlmoForCausalLM": _flex_olmo, "SolarOpenForCausalLM": _shared_moe,
    "ExaoneMoeForCausalLM": _shared_moe, "HYV3ForCausalLM": _shared_moe, "Cohere2MoeForCausalLM": _cohere2_moe,
    "Glm4MoeLiteForCausalLM": _glm4_moe_lite, "OlmoForCausalLM": _olmo, "NanoChatForCausalLM": _nanochat,
    "Jais2ForCausalLM": _jais2, "YoutuForCausalLM": _youtu, "MiniCPM3ForCausalLM": _youtu,
    "GraniteMoeSWAForCausalLM": _more_moe, "MellumForCausalLM": _more_moe, "AriaTextForCausalLM": _more_moe,
    "Kolibri1ForCausalLM": _more_moe, "AfmoeForCausalLM": _afmoe,
    "LagunaForCausalLM": _laguna,
    "DiffLlamaForCausalLM": lambda data, path: dict(differential_attention=True),
    "Emu3ForCausalLM": lambda data, path: {},  # Emu3's text model: the Llama layout
    "BitNetForCausalLM": lambda data, path: dict(sub_norms=True),  # attn_sub_norm, ffn_sub_norm; relu2 gate
    "ApertusForCausalLM": _apertus,
    "GraniteSWAForCausalLM": lambda data, path: dict(attention_sinks=True),  # Granite's layer, sinks, windows
    "Gemma4ForCausalLM": _gemma4, "Gemma4UnifiedForCausalLM": _gemma4, "CohereCompassForCausalLM": _cohere_compass,
}

# LLAMA_KEYED families whose config.json has no intermediate_size (every layer MoE: the reader gives the width)
NO_DENSE_WIDTH = ("SolarOpenForCausalLM", "Kolibri1ForCausalLM")

# the MoE families LLAMA_KEYED reads whole (their experts included); Qwen2-MoE's experts are Qwen3-MoE's (hf_config)
MOE_READ = ("Glm4MoeForCausalLM", "Dots1ForCausalLM", "Llama4ForCausalLM", "HunYuanMoEV1ForCausalLM",
            "Ernie4_5_MoeForCausalLM", "MiniMaxM2ForCausalLM", "FlexOlmoForCausalLM", "SolarOpenForCausalLM",
            "ExaoneMoeForCausalLM", "Cohere2MoeForCausalLM", "Glm4MoeLiteForCausalLM", "GraniteMoeSWAForCausalLM",
            "MellumForCausalLM", "AriaTextForCausalLM", "Kolibri1ForCausalLM", "HYV3ForCausalLM",
            "AfmoeForCausalLM", "LagunaForCausalLM", "Gemma4ForCausalLM")


APPROXIMATED = {
    "GPTNeoXJapaneseForCausalLM": "GPT-NeoX-Japanese rotates a fraction of each head (partial_rotary_factor) and "
                                  "adds its last layer's dense_bias after the attention",
    "CpmAntForCausalLM": "CPM-Ant adds a learned relative position bias per head and segment to its attention scores "
                         "and prepends prompt_length prompt tokens to the sequence",
    "ModernBertDecoderForCausalLM": "ModernBERT's decoder has no attention norm in its first layer, a LayerNorm on the "
                                    "embeddings, a GeLU-gated MLP and a prediction head (dense, activation, norm)",
    "PhiForCausalLM": "Phi runs attention and MLP in parallel after one LayerNorm",
    "GPTJForCausalLM": "GPT-J runs attention and MLP in parallel after one LayerNorm, its MLP alone biased",
    "CodeGenForCausalLM": "CodeGen runs attention and MLP in parallel after one LayerNorm, its MLP alone biased",
    "MptForCausalLM": "MPT's attention has ALiBi position biases (no RoPE)",
    "MPTForCausalLM": "MPT's attention has ALiBi position biases (no RoPE)",
    "Glm4ForCausalLM": "GLM-4 normalises the sub-layers' outputs too (post_self_attn / post_mlp layernorms)",
    "ArceeForCausalLM": "Arcee's MLP is up / down projections with ReLU squared",
    "NemotronForCausalLM": "Nemotron's MLP is up / down projections with ReLU squared",
    "PersimmonForCausalLM": "Persimmon's MLP is ReLU squared and its per-head q / k norms are LayerNorms with bias",
    "Qwen2MoeForCausalLM": "Qwen2-MoE gates its shared expert by a sigmoid (shared_expert_gate)",
    "Ernie4_5_MoeForCausalLM": "ERNIE 4.5's router adds a learned correction bias",
    "Llama4ForCausalLM": "Llama 4 normalises q and k by an L2 norm and skips RoPE on some layers",
    "XGLMForCausalLM": "XGLM adds sinusoidal positions (no RoPE)",
    "GPTNeoForCausalLM": "GPT-Neo alternates global and local attention and biases out_proj and the MLP only",
    "CTRLLMHeadModel": "CTRL adds sinusoidal positions (no RoPE) and its MLP is ReLU",
    "OpenAIGPTLMHeadModel": "GPT-1 normalises each sub-layer's residual sum (post-norm) and has no final norm",
    "OPTForCausalLM": "OPT's MLP is ReLU",
    "BloomForCausalLM": "BLOOM's attention has ALiBi position biases (no RoPE) and its embeddings a LayerNorm",
    "OlmoForCausalLM": "OLMo's LayerNorms have no weights",
    "NanoChatForCausalLM": "nanochat's RMSNorms have no weights and its MLP is ReLU squared",
    "Jais2ForCausalLM": "Jais 2's MLP is up / down projections with ReLU squared",
    "GraniteSWAForCausalLM": "Granite-SWA's attention has sinks",
    "GraniteMoeSWAForCausalLM": "Granite-MoE-SWA's attention has sinks",
    "AfmoeForCausalLM": "AFMoE gates the attention output by a sigmoid of a linear of the layer input and normalises "
                        "the sub-layers' outputs too",
    "DiffLlamaForCausalLM": "DiffLlama's attention subtracts a second softmax's attention (differential attention)",
    "ApertusForCausalLM": "Apertus's MLP is up / down projections with the xIELU activation",
    "BitNetForCausalLM": "BitNet normalises the attention output and the MLP's gated product before their "
                         "projections (sub-norms) and gates its MLP by a squared ReLU",
    "LagunaForCausalLM": "Laguna gates the attention output by a softplus of a linear of the layer input",
    "Kolibri1ForCausalLM": "Kolibri normalises the sub-layers' outputs too (post_self_attn / post_mlp layernorms)",
    "FlexOlmoForCausalLM": "FlexOlmo normalises the sub-layers' outputs (post-norms) and the whole Q and K",
    "Cohere2MoeForCausalLM": "Cohere2-MoE runs attention and MLP in parallel after one LayerNorm without bias",
    "CohereCompassForCausalLM": "Cohere Compass runs attention and MLP in parallel after one LayerNorm without bias",
    "MiniMaxM2ForCausalLM": "MiniMax-M2 normalises the whole Q and K",
    "Gemma4ForCausalLM": "Gemma 4's layers differ by kind (the full-attention layers' own head width and K / V heads; "
                         "per-layer inputs, K / V reused by the last layers and experts beside the MLP where the config "
                         "sets them)",
    "Gemma4UnifiedForCausalLM": "Gemma 4's layers differ by kind (the full-attention layers' own head width and K / V "
                                "heads; K / V reused by the last layers where the config sets them)",
}
