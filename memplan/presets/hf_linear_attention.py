"""The config.json readers of the linear-attention hybrids (issue 22): the gated-DeltaNet ones, Qwen3-Next, Qwen3.5
(dense and MoE, their text configs) and OLMo-hybrid, and the Kimi Delta Attention ones beside latent attention, Kimi
Linear and Bailing-hybrid (layer_pattern K / B: ``_kda``; parameters core/hybrid.py kda_counts), and MiniMax-01's
lightning attention beside softmax attention (layer_pattern L; core/hybrid.py lightning_counts), from transformers'
own modelling code (transformers 5.23): each layer a gated DeltaNet (layer_pattern D, "linear_attention") or full
attention (A, "full_attention"), then an MLP; the DeltaNet's widths in
ModelSpec's ssm_* fields (ssm_heads: linear_num_value_heads, ssm_head_dim: linear_value_head_dim, ssm_groups:
linear_num_key_heads, ssm_state_size: linear_key_head_dim, ssm_conv_kernel: linear_conv_kernel_dim; no biases), its
parameters memory/states.py delta_groups. Each is checked by the registry walk (memplan/check/registry.py) against
transformers' parameter count of the model built on the meta device.

``LINEAR_ATTENTION`` gives each family's spec but name, sequence and vocabulary (as hf_hybrids.HYBRIDS, which takes
them in); ``LINEAR_ATTENTION_MOE`` the ones whose experts are read; ``LINEAR_TEXT_MODELS`` the text configs of the
multimodal Qwen3.5 files (hf_multimodal.TEXT_MODELS). Their activations are traced (--impl hf-*; the chunked delta rule's
loop over chunks: validation/trace_fit.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from memplan.core.errors import MemplanError
from memplan.core.spec_base import echo
from memplan.presets.hf_families import YAML_HINT, flag, layer_types, nat, nat_or_default

_KINDS = {"linear_attention": "D", "full_attention": "A"}


def _pattern(data: dict, path: Path, default: Callable[[int], str]) -> str:
    """The layers' kinds as layer_pattern characters: layer_types when the config has it, else the family's default
    (``default``: the layer count -> the pattern)."""
    if data.get("layer_types") is None:
        return default(nat(data, "num_hidden_layers", 48, path))
    return layer_types(data, "layer_types", _KINDS, path)


def _interval(data: dict, path: Path) -> Callable[[int], str]:
    """Qwen3-Next's and Qwen3.5's default layout: every full_attention_interval-th layer full attention (default 4)."""
    n = nat(data, "full_attention_interval", 4, path)
    return lambda L: "".join("A" if (i + 1) % n == 0 else "D" for i in range(L))


def _delta(data: dict, path: Path, defaults: tuple[int, int, int, int]) -> dict[str, Any]:
    """The gated DeltaNet's widths (the config class's defaults for missing keys): value heads, their width, key
    heads, their width, and the convolution's width."""
    Hv, dv, Hk, dk = (nat_or_default(data, k, d, path) for k, d in zip(
        ("linear_num_value_heads", "linear_value_head_dim", "linear_num_key_heads", "linear_key_head_dim"), defaults))
    if Hv % Hk:
        raise MemplanError(f"{path}: linear_num_value_heads = {Hv} is not divisible by linear_num_key_heads = {Hk}")
    return dict(ssm_heads=Hv, ssm_head_dim=dv, ssm_groups=Hk, ssm_state_size=dk,
                ssm_conv_kernel=nat(data, "linear_conv_kernel_dim", 4, path), ssm_conv_bias=False, ssm_norm=False)


def _qwen_attention(data: dict, path: Path, h: int) -> dict[str, Any]:
    """Qwen3-Next's gated attention (Qwen3.5's too): q_proj twice as wide (the output gate, one value per channel:
    attention_output_gate full), q / k norms per head, head_dim 256; no attention_bias (its gate's bias is not
    counted)."""
    if flag(data, "attention_bias", False, path):
        raise MemplanError(f"{path}: attention_bias with Qwen3-Next's gated q_proj (a bias on the gate too): not "
                           f"counted; {YAML_HINT}")
    return dict(hidden_size=h, num_attention_heads=nat(data, "num_attention_heads", 16, path),
                num_kv_heads=nat(data, "num_key_value_heads", 2, path), head_dim=nat(data, "head_dim", 256, path),
                qk_norm=True, attention_output_gate="full", norm="rmsnorm", position_embedding="rope", bias=False,
                mlp="swiglu", tied_embeddings=flag(data, "tie_word_embeddings", False, path),
                norm_eps=data.get("rms_norm_eps"))


def _experts(data: dict, path: Path, E: int, k: int) -> dict[str, Any]:
    """Qwen3-Next's sparse MoE block: E experts moe_intermediate_size wide (gated), top num_experts_per_tok, a router
    E x h, a shared expert shared_expert_intermediate_size wide behind a sigmoid gate (shared_expert_gate h -> 1)."""
    return dict(num_experts=nat(data, "num_experts", E, path), moe_top_k=nat(data, "num_experts_per_tok", k, path),
                moe_ffn_hidden_size=nat(data, "moe_intermediate_size", 512, path),
                moe_shared_ffn_hidden_size=nat(data, "shared_expert_intermediate_size", 512, path),
                moe_shared_gate=True)


def _qwen3_next(data: dict, path: Path) -> dict[str, Any]:
    """Qwen3NextForCausalLM: gated DeltaNet and gated attention layers (layer_types, else every
    full_attention_interval-th full attention), each with the sparse MoE block where num_experts > 0, the layer is not
    in mlp_only_layers and its number is a multiple of decoder_sparse_step (else a SwiGLU MLP intermediate_size wide:
    layer_pattern d / a)."""
    pattern = _pattern(data, path, _interval(data, path))
    E, step = data.get("num_experts", 512), nat(data, "decoder_sparse_step", 1, path)
    dense_only = data.get("mlp_only_layers") or []
    if not isinstance(dense_only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense_only):
        raise MemplanError(f"{path}: mlp_only_layers: expected a list of layer indices (got {echo(dense_only)})")
    if isinstance(E, bool) or not isinstance(E, int) or E < 0:
        raise MemplanError(f"{path}: num_experts: expected a count of experts, 0 for none (got {echo(E)})")
    spec = dict(_qwen_attention(data, path, nat(data, "hidden_size", 2048, path)), num_layers=len(pattern),
                ffn_hidden_size=nat(data, "intermediate_size", 5632, path),
                **_delta(data, path, (32, 128, 16, 128)))
    moe = [E > 0 and i not in dense_only and (i + 1) % step == 0 for i in range(len(pattern))]
    if not any(moe):
        return dict(spec, layer_pattern=pattern)
    return dict(spec, layer_pattern="".join(c if m else c.lower() for c, m in zip(pattern, moe)),
                **_experts(data, path, 512, 10))


def _qwen3_5(data: dict, path: Path) -> dict[str, Any]:
    """Qwen3_5ForCausalLM (the text model, Qwen3_5TextConfig): Qwen3-Next's layers with a SwiGLU MLP
    intermediate_size wide in every layer (the DeltaNet's projections as in_proj_qkv, in_proj_z, in_proj_b, in_proj_a:
    the same widths)."""
    pattern = _pattern(data, path, _interval(data, path))
    return dict(_qwen_attention(data, path, nat(data, "hidden_size", 4096, path)), num_layers=len(pattern),
                layer_pattern=pattern, ffn_hidden_size=nat(data, "intermediate_size", 12288, path),
                **_delta(data, path, (32, 128, 16, 128)))


def _qwen3_5_moe(data: dict, path: Path) -> dict[str, Any]:
    """Qwen3_5MoeForCausalLM (the text model, Qwen3_5MoeTextConfig): Qwen3.5's layers, each with Qwen3-Next's sparse
    MoE block (no dense layers)."""
    pattern = _pattern(data, path, _interval(data, path))
    return dict(_qwen_attention(data, path, nat(data, "hidden_size", 2048, path)), num_layers=len(pattern),
                layer_pattern=pattern, **_delta(data, path, (32, 128, 16, 128)), **_experts(data, path, 256, 8))


def _olmo_hybrid(data: dict, path: Path) -> dict[str, Any]:
    """OlmoHybridForCausalLM: gated DeltaNet layers (pre-norm; q, k, v, a, b, g projections apart) and OLMo-3's
    attention layers (post-norms; q / k norms over the whole Q and K, attention_bias on q, k, v, o), each with a SwiGLU
    MLP intermediate_size wide; the defaults: every fourth layer attention (the last one when there is none), the
    DeltaNet's heads num_attention_heads, keys 0.75 h / heads wide, values twice that."""
    h, a = nat(data, "hidden_size", 3840, path), nat(data, "num_attention_heads", 30, path)

    def default(L: int) -> str:
        pattern = "".join("A" if i % 4 == 3 else "D" for i in range(L))
        return pattern if "A" in pattern else pattern[:-1] + "A"

    pattern = _pattern(data, path, default)
    Hk = nat_or_default(data, "linear_num_key_heads", a, path)
    dk = nat_or_default(data, "linear_key_head_dim", int(0.75 * h / Hk), path)
    return dict(num_layers=len(pattern), hidden_size=h, num_attention_heads=a, layer_pattern=pattern,
                num_kv_heads=data.get("num_key_value_heads"), head_dim=data.get("head_dim"), qk_norm=True,
                qk_norm_width="full", attention_bias=flag(data, "attention_bias", False, path), norm="rmsnorm",
                position_embedding="rope", bias=False, mlp="swiglu",
                ffn_hidden_size=nat(data, "intermediate_size", 11008, path),
                tied_embeddings=flag(data, "tie_word_embeddings", False, path), norm_eps=data.get("rms_norm_eps"),
                **_delta(data, path, (a, 2 * dk, Hk, dk)))


def _alias(data: dict, names: tuple[str, ...], default: Any) -> dict:
    """The field under the first of ``names`` (a config class's attribute_map aliases: the Hub file's key and the one
    transformers writes) present in ``data``, as {names[0]: value} for ``nat``; {} when none is."""
    return next(({names[0]: data[k]} for k in names if data.get(k) is not None), {names[0]: default})


def _kimi_types(data: dict, path: Path, L: int) -> list[str]:
    """Kimi Linear's layer types: layer_types, else linear_attn_config's full_attn_layers / kda_layers (numbered from
    1, as in the published checkpoint), else every fourth layer from the fifth full attention (KimiLinearConfig)."""
    types, linear = data.get("layer_types"), data.get("linear_attn_config") or {}
    if types is None and isinstance(linear, dict) and "full_attn_layers" in linear and "kda_layers" in linear:
        full, kda = linear["full_attn_layers"], linear["kda_layers"]
        if not all(isinstance(x, list) and all(isinstance(i, int) and 1 <= i <= L for i in x) for x in (full, kda)) \
                or sorted(full + kda) != list(range(1, L + 1)):
            raise MemplanError(f"{path}: linear_attn_config: full_attn_layers and kda_layers must number each of the "
                               f"{L} layers once, from 1 (got {echo(full)} and {echo(kda)})")
        types = ["full_attention" if i + 1 in full else "linear_attention" for i in range(L)]
    types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(L)] if types is None else types
    if not isinstance(types, list) or len(types) != L or not all(t in _KINDS for t in types):
        raise MemplanError(f"{path}: layer_types: expected {L} of the layer types {', '.join(sorted(_KINDS))} "
                           f"(got {echo(types)})")
    return types


def _kda(data: dict, path: Path, types: list[str], mixer: str, widths: tuple[int, int, int],
         defaults: dict[str, int]) -> dict[str, Any]:
    """The spec shared by the Kimi Delta Attention hybrids: each layer KDA (``mixer``: K Kimi's, B Bailing's; the
    ``widths`` H heads d wide, the convolution's length) or DeepSeek-V3's latent attention (``types``), each with
    DeepSeek-V3's experts (num_experts routed, n_shared_experts shared as one MLP, a router with a correction-bias
    buffer) or, where mlp_layer_types says dense (default: the first first_k_dense_replace), a SwiGLU MLP
    intermediate_size wide (lower case); the family's ``defaults`` for missing keys (h, f, fe, E, dense)."""
    L, mlp = len(types), data.get("mlp_layer_types")
    if mlp is None:
        dense = nat({"k": data.get("first_k_dense_replace", defaults["dense"]) or None}, "k", None, path) or 0
        mlp = ["dense" if i < dense else "sparse" for i in range(L)]
    if not isinstance(mlp, list) or len(mlp) != L or not all(t in ("dense", "sparse") for t in mlp):
        raise MemplanError(f"{path}: mlp_layer_types: expected {L} of dense, sparse, one per layer (got {echo(mlp)}"
                           f"{f' of {len(mlp)}' if isinstance(mlp, list) else ''})")
    if flag(data, "attention_bias", False, path):
        raise MemplanError(f"{path}: attention_bias with latent attention beside Kimi Delta Attention: not counted; "
                           f"{YAML_HINT}")
    moe = [t == "sparse" for t in mlp]
    pattern = "".join((mixer if t == "linear_attention" else "A") if m or not any(moe) else
                      (mixer.lower() if t == "linear_attention" else "a") for t, m in zip(types, moe))
    fe = nat(data, "moe_intermediate_size", defaults["fe"], path)
    shared = nat(_alias(data, ("n_shared_experts", "num_shared_experts"), 1), "n_shared_experts", 1, path)
    experts = dict(num_experts=nat(_alias(data, ("num_experts", "num_local_experts"), defaults["E"]), "num_experts",
                                   defaults["E"], path),
                   moe_top_k=nat(_alias(data, ("num_experts_per_tok", "num_experts_per_token"), 8),
                                 "num_experts_per_tok", 8, path),
                   moe_ffn_hidden_size=fe, moe_shared_ffn_hidden_size=fe * shared) if any(moe) else {}
    H, d, kernel = widths
    return dict(num_layers=L, hidden_size=nat(data, "hidden_size", defaults["h"], path),
                num_attention_heads=nat(data, "num_attention_heads", 32, path), layer_pattern=pattern,
                kv_lora_rank=nat(data, "kv_lora_rank", 512, path), qk_nope_head_dim=nat(data, "qk_nope_head_dim", 128,
                                                                                          path),
                qk_rope_head_dim=nat(data, "qk_rope_head_dim", 64, path), v_head_dim=nat(data, "v_head_dim", 128, path),
                norm="rmsnorm", position_embedding="rope", bias=False, mlp="swiglu",
                ffn_hidden_size=nat(data, "intermediate_size", defaults["f"], path),
                tied_embeddings=flag(data, "tie_word_embeddings", False, path), norm_eps=data.get("rms_norm_eps"),
                ssm_heads=H, ssm_head_dim=d, ssm_groups=H, ssm_state_size=d, ssm_conv_kernel=kernel,
                ssm_conv_bias=False, ssm_norm=False, **experts)


def _kimi_linear(data: dict, path: Path) -> dict[str, Any]:
    """KimiLinearForCausalLM: Kimi Delta Attention layers (layer_pattern K, transformers KimiLinearDeltaAttention:
    linear_num_heads heads linear_head_dim wide, short convolutions linear_conv_kernel_dim long, the forget and output
    gates low rank; the published file keeps them in linear_attn_config) and latent attention without RoPE (q_lora_rank
    optional, default none; no position table: memplan's "rope", which holds no parameters); ``_kda``'s MLPs, one
    dense layer first by default."""
    linear = data.get("linear_attn_config") or {}
    if not isinstance(linear, dict):
        raise MemplanError(f"{path}: linear_attn_config: expected an object (got {echo(linear)})")
    widths = tuple(nat({key: linear[inner] if linear.get(inner) is not None else data.get(key, default)}, key,
                       default, path) for key, inner, default in (
        ("linear_num_heads", "num_heads", 32), ("linear_head_dim", "head_dim", 128),
        ("linear_conv_kernel_dim", "short_conv_kernel_size", 4)))  # linear_attn_config's keys before the top's
    spec = _kda(data, path, _kimi_types(data, path, nat(data, "num_hidden_layers", 27, path)), "K", widths,
                dict(h=2304, f=9216, fe=1024, E=256, dense=1))
    return dict(spec, q_lora_rank=data.get("q_lora_rank"))


def _bailing_hybrid(data: dict, path: Path) -> dict[str, Any]:
    """BailingHybridForCausalLM (Ling 3.0): Kimi Delta Attention layers with full-rank gates (layer_pattern B,
    BailingHybridDeltaAttention: f_proj, g_proj h x V), num_attention_heads heads head_dim wide, convolutions
    short_conv_kernel_size long (the linear_* keys transformers writes win where a file has them), and latent
    attention with RoPE, q_proj direct (no q_lora_rank) and a gate per head (g_proj h x a); layer_types, else every
    layer_group_size-th layer attention; ``_kda``'s MLPs, two dense layers first by default. Its multi-token-prediction
    layers (num_nextn_predict_layers) are not built by transformers."""
    L, n = nat(data, "num_hidden_layers", 42, path), nat(data, "layer_group_size", 6, path)
    types = data.get("layer_types")
    types = ["full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(L)] if types is None else types
    if not isinstance(types, list) or len(types) != L or not all(t in _KINDS for t in types):
        raise MemplanError(f"{path}: layer_types: expected {L} of the layer types {', '.join(sorted(_KINDS))} "
                           f"(got {echo(types)})")
    widths = tuple(nat({own: data[own] if data.get(own) is not None else data.get(key, default)}, own, default, path)
                   for own, key, default in (("linear_num_heads", "num_attention_heads", 32),
                                             ("linear_head_dim", "head_dim", 128),
                                             ("linear_conv_kernel_dim", "short_conv_kernel_size", 4)))
    return dict(_kda(data, path, types, "B", widths, dict(h=2560, f=6144, fe=768, E=512, dense=2)),
                attention_output_gate="head")


def _minimax(data: dict, path: Path) -> dict[str, Any]:
    """MiniMaxForCausalLM (MiniMax-01): each layer lightning attention (layer_pattern L, "linear_attention":
    MiniMaxLightningAttention, the attention's heads: qkv_proj, output_gate, out_proj, an RMSNorm over the heads) or
    Mixtral's attention (A, "full_attention"; layer_types, else MiniMaxConfig's alternation, full attention first), then
    Mixtral's experts (num_local_experts of intermediate_size, gated, top num_experts_per_tok, a router without bias);
    the residual's alpha / beta factors hold no parameters; no biases."""
    L = nat(data, "num_hidden_layers", 32, path)
    pattern = layer_types(data, "layer_types", {"linear_attention": "L", "full_attention": "A"}, path) \
        if data.get("layer_types") is not None else "".join("A" if i % 2 == 0 else "L" for i in range(L))
    if data.get("hidden_act", "silu") != "silu":
        raise MemplanError(f"{path}: hidden_act {echo(data['hidden_act'])}: memplan models MiniMax's experts and "
                           f"lightning attention with silu; {YAML_HINT}")
    f = nat(data, "intermediate_size", 14336, path)
    return dict(num_layers=len(pattern), hidden_size=nat(data, "hidden_size", 4096, path), layer_pattern=pattern,
                num_attention_heads=nat(data, "num_attention_heads", 32, path),
                num_kv_heads=data.get("num_key_value_heads", 8), head_dim=data.get("head_dim"), norm="rmsnorm",
                position_embedding="rope", bias=False, mlp="swiglu", ffn_hidden_size=f,
                num_experts=nat(data, "num_local_experts", 8, path), moe_top_k=nat(data, "num_experts_per_tok", 2, path),
                moe_ffn_hidden_size=f, tied_embeddings=flag(data, "tie_word_embeddings", False, path),
                norm_eps=data.get("rms_norm_eps"))


LINEAR_ATTENTION: dict[str, Callable[[dict, Path], dict[str, Any]]] = {
    "Qwen3NextForCausalLM": _qwen3_next, "Qwen3_5ForCausalLM": _qwen3_5, "Qwen3_5MoeForCausalLM": _qwen3_5_moe,
    "OlmoHybridForCausalLM": _olmo_hybrid, "KimiLinearForCausalLM": _kimi_linear,
    "BailingHybridForCausalLM": _bailing_hybrid, "MiniMaxForCausalLM": _minimax,
}
LINEAR_ATTENTION_MOE = ("Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM", "KimiLinearForCausalLM",
                        "BailingHybridForCausalLM", "MiniMaxForCausalLM")
# the multimodal Qwen3.5 files' text_config (Qwen3_5ForConditionalGeneration): its model_type -> the causal LM read
LINEAR_TEXT_MODELS = {"qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}
