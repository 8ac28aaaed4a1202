"""A transformers config.json read as a model preset: the architectures memplan models, their fields mapped onto ModelSpec
(mixture of experts, latent attention, sliding windows, norms), and the shipped traced inventory it is matched to."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from memplan.core.datafile import load_json_text, read_text
from memplan.core.errors import MemplanError
from memplan.core.model import MAX_LAYERS, ModelSpec
from memplan.core.spec_base import build, echo
from memplan.inventory.traced_file import inventory_dir
from memplan.presets.files import ModelPreset, configs_dir
from memplan.presets.hf_families import (APPROXIMATED, LLAMA_KEYED, MOE_READ, NO_DENSE_WIDTH, deepseek_experts,
                                         flag as _flag)
from memplan.presets.hf_encoders import ENCODER_NOTES, ENCODERS, NOT_READ, is_decoder_note, position_start
from memplan.presets.hf_encoders import POSITIONS as ENCODER_POSITIONS
from memplan.presets.hf_hybrids import HYBRID_MOE, HYBRIDS
from memplan.presets.hf_latent import LATENT_APPROXIMATED, LATENT_KEYED
from memplan.presets.hf_multimodal import FLAT, OWN_FIELDS, TEXT_MODELS, own_notes, text_model
from memplan.presets.hf_own_keys import OWN_KEYS, POSITIONS
from memplan.presets.hf_recurrent import POSITIONS as RECURRENT_POSITIONS

# transformers architectures whose layer layout memplan models, and how to read their config.json:
# "gpt2" and "llama" have hand-written, measured inventories (terms_hf.py); "traced" families read
# like Llama (RMSNorm, gated MLP, RoPE; Gemma's gate is GeLU-tanh, the same shapes) and their --impl
# hf-* inventories are traced from transformers' code (memplan trace, memplan/inventory/traced.py).
HF_ARCHITECTURES = {
    "GPT2LMHeadModel": "gpt2",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",  # the Llama layout (its sliding window does not change what is stored)
    "Qwen2ForCausalLM": "traced",
    "Qwen3ForCausalLM": "traced",
    "GemmaForCausalLM": "traced",
    "Gemma2ForCausalLM": "traced",
    "Gemma3ForCausalLM": "traced",
    "Phi3ForCausalLM": "traced",
    "MixtralForCausalLM": "traced",  # mixture of experts (issue 11): see _read_moe
    "Qwen3MoeForCausalLM": "traced",
    "DeepseekV3ForCausalLM": "traced",  # mixture of experts and multi-head latent attention
    # issue 22: families whose parameters ModelSpec's layout fields count exactly (_FAMILIES says how) and whose
    # layers --impl hf-* traces; --impl megatron* approximates their layer by the pre-norm layer (_APPROXIMATED)
    "DeepseekV2ForCausalLM": "traced",
    "Olmo2ForCausalLM": "traced",
    "GraniteForCausalLM": "traced",
    "FalconForCausalLM": "traced",
    "GPTNeoXForCausalLM": "traced",
    "Starcoder2ForCausalLM": "traced",
    "CohereForCausalLM": "traced",
    "PhimoeForCausalLM": "traced",
    "GptOssForCausalLM": "traced",
    "Gemma3ForConditionalGeneration": "traced",  # its text_config: the text model alone (hf_multimodal.text_model)
    # the registry walk (memplan/check/registry.py): Llama-layout families (sliding windows from layer_types: CWM;
    # layers without RoPE: SmolLM3; Gemma's GeLU gate: VaultGemma) and the variants _family reads, each checked
    # against transformers' meta-device count (tests/test_registry.py)
    "CwmForCausalLM": "traced",
    "Ernie4_5ForCausalLM": "traced",
    "HeliumForCausalLM": "traced",
    "Ministral3ForCausalLM": "traced",
    "SmolLM3ForCausalLM": "traced",
    "VaultGemmaForCausalLM": "traced",
    "Olmo3ForCausalLM": "traced",
    "Cohere2ForCausalLM": "traced",
    "Exaone4ForCausalLM": "traced",
    "SeedOssForCausalLM": "traced",
    "HyperCLOVAXForCausalLM": "traced",
    "StableLmForCausalLM": "traced",
    "GraniteMoeForCausalLM": "traced",  # Mixtral's experts with Granite's multipliers (constants)
    "GraniteMoeSharedForCausalLM": "traced",  # and a shared expert shared_intermediate_size wide
    "OlmoeForCausalLM": "traced",  # Mixtral-like experts, whole-width q / k norms
    # and the families memplan/presets/hf_families.py reads (the registry walk checks each)
    **{arch: "traced" for arch in (*LLAMA_KEYED, *LATENT_KEYED, *OWN_KEYS, *HYBRIDS, *ENCODERS, *FLAT, *OWN_FIELDS)},
}


# Where each family's layer differs from the sequential pre-norm layer the --impl megatron* inventories model:
# a note on every estimate of that family (its parameters are counted exactly; --impl hf-* traces its own code).
_APPROXIMATED = {
    "Olmo2ForCausalLM": "OLMo-2 normalises the sub-layers' outputs (post-norms) and the whole Q and K",
    "Olmo3ForCausalLM": "OLMo-3 normalises the sub-layers' outputs (post-norms) and the whole Q and K",
    "Exaone4ForCausalLM": "EXAONE 4 normalises the sub-layers' outputs (post-norms) and each head's Q and K",
    "CohereForCausalLM": "Cohere runs attention and MLP in parallel after one LayerNorm without bias",
    "Cohere2ForCausalLM": "Cohere 2 runs attention and MLP in parallel after one LayerNorm without bias",
    "HyperCLOVAXForCausalLM": "HyperCLOVA X normalises the sub-layers' outputs too (post_norm1, post_norm2)",
    "FalconForCausalLM": "Falcon runs attention and MLP in parallel on the same normalised input",
    "GPTNeoXForCausalLM": "GPT-NeoX runs attention and MLP in parallel (use_parallel_residual) with a rotary "
                          "fraction of each head",
    "PhimoeForCausalLM": "Phi-3.5-MoE's LayerNorms and attention carry biases",
    "GptOssForCausalLM": "gpt-oss alternates sliding-window and full attention with attention sinks and clamped "
                         "SwiGLU experts",
    "Starcoder2ForCausalLM": "StarCoder2's LayerNorms and linears carry biases and its attention a sliding window",
}


# Gated activations of the Llama-layout MLP (gate and up projections f wide, the product into down_proj).
_GATED_ACTS = ("silu", "gelu_pytorch_tanh", "gelu", "relu2")
_GATE_ACTIVATION = {"silu": "silu", "relu2": "relu2"}  # ModelSpec.gate_activation; the GeLU variants: gelu


# The config keys that make a model a mixture of experts; the MoE architectures memplan reads (_read_moe)
# and the key of their routed-expert count. Other MoE architectures are refused.
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


_MOE_ARCHITECTURES = {"MixtralForCausalLM": "num_local_experts", "Qwen3MoeForCausalLM": "num_experts",
                      "DeepseekV3ForCausalLM": "n_routed_experts", "DeepseekV2ForCausalLM": "n_routed_experts",
                      "PhimoeForCausalLM": "num_local_experts", "GptOssForCausalLM": "num_local_experts",
                      "GraniteMoeForCausalLM": "num_local_experts", "GraniteMoeSharedForCausalLM": "num_local_experts",
                      "OlmoeForCausalLM": "num_experts", "Qwen2MoeForCausalLM": "num_experts"}

# the architectures whose experts memplan reads: those above (_read_moe) and hf_families' own
_READS_EXPERTS = (*_MOE_ARCHITECTURES, *MOE_READ, *HYBRID_MOE, *LATENT_KEYED, "DbrxForCausalLM")


# model types whose attention normalises each head's queries and keys (q_norm, k_norm)
_QK_NORM_TYPES = ("qwen3", "qwen3_moe", "gemma3_text", "gemma3", "olmo2", "olmo3", "exaone4")


_QKV_BIAS_TYPES = ("qwen2",)  # Qwen2Attention: q_proj, k_proj, v_proj with bias=True, o_proj without


_SANDWICH_NORM_TYPES = ("gemma2", "gemma3_text", "gemma3")  # post_attention / pre- and post_feedforward norms


# Speculative-decoding drafters: every layer reuses the target model's K / V (no training run of their own to plan)
_DRAFTERS = ("Gemma4AssistantForCausalLM", "Gemma4UnifiedAssistantForCausalLM")


# Families whose config defaults max_position_embeddings to 2048 (FalconConfig, GPTNeoXConfig)
_OLD_DEFAULTS = ("FalconForCausalLM", "GPTNeoXForCausalLM")


# What an architecture memplan cannot read from its config.json should do instead (one line, exactly what to run)
_REFUSAL = ("describe it in a model YAML (docs/reference.md, section Model presets) and give it to --model; "
            "pip install 'memplan[trace]' then traces its activations: memplan trace --hf-config config.json "
            "--out DIR/hf-sdpa-cpu.yaml, and the YAML's inventory: DIR uses them")


# The sequence length a config.json gets when --seq-len is not given: its position limit, capped at
# 8192 (Llama 3's pre-training context; Llama 3.1 allows 131072 positions, reached by a late
# context-extension phase, not the length most runs train with).
HF_DEFAULT_SEQ = 8192


def _probability(data: dict, key: str, default: float, path: Path) -> float:
    """A dropout probability of a config.json: a number in [0, 1]."""
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise MemplanError(f"{path}: {key}: expected a dropout probability between 0 and 1 (got {echo(value)})")
    return float(value)


def _head_dim(data: dict) -> Any:
    """A config's head_dim when it differs from h/a (Mistral-Nemo: 128 with h/a = 160); None when it
    is h/a (many configs state it), so such a model equals its preset."""
    head_dim, h, a = data.get("head_dim"), data.get("hidden_size"), data.get("num_attention_heads")
    if isinstance(h, int) and isinstance(a, int) and a > 0 and not h % a and head_dim == h // a:
        return None
    return head_dim


def _read_moe(data: dict, arch: str, path: Path) -> dict[str, Any]:
    """The ModelSpec fields of a mixture-of-experts config.json (transformers' defaults for missing keys).
    Mixtral: num_local_experts experts of intermediate_size each, top num_experts_per_tok, every layer MoE.
    Qwen3-MoE: num_experts experts of moe_intermediate_size, top num_experts_per_tok; a layer is dense
    (intermediate_size wide) when in mlp_only_layers or when (i + 1) % decoder_sparse_step != 0
    (Qwen3MoeDecoderLayer): memplan models dense layers first only, and refuses other patterns."""
    if arch in ("MixtralForCausalLM", "PhimoeForCausalLM"):  # every layer MoE, experts intermediate_size wide
        return dict(num_experts=data.get("num_local_experts", 8 if arch == "MixtralForCausalLM" else 16),
                    moe_top_k=data.get("num_experts_per_tok", 2))
    if arch in ("GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM"):  # GraniteMoeParallelExperts: f wide
        shared = data.get("shared_intermediate_size", 0) if arch == "GraniteMoeSharedForCausalLM" else 0
        return dict(num_experts=data.get("num_local_experts", 8), moe_top_k=data.get("num_experts_per_tok", 2),
                    **({"moe_shared_ffn_hidden_size": shared} if shared else {}))
    if arch == "OlmoeForCausalLM":  # OlmoeSparseMoeBlock: num_experts (num_local_experts) experts f wide
        return dict(num_experts=data.get("num_experts", data.get("num_local_experts", 64)),
                    moe_top_k=data.get("num_experts_per_tok", 8))
    if arch == "GptOssForCausalLM":  # GptOssMLP: router with bias, experts with biases (GptOssExperts)
        return dict(num_experts=data.get("num_local_experts", 128), moe_top_k=data.get("num_experts_per_tok", 4),
                    moe_bias=True)
    if arch in ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"):
        if data.get("moe_layer_freq", 1) != 1:
            raise MemplanError(f"{path}: moe_layer_freq = {echo(data['moe_layer_freq'])}: memplan models an MoE "
                               "layer in every layer after the first_k_dense_replace dense ones (moe_layer_freq 1)")
        return _read_deepseek_v3(data, arch)
    # transformers 5 writes Qwen3-MoE's count as num_local_experts (Qwen3MoeConfig.attribute_map), the Hub's
    # files as num_experts; Qwen2-MoE's the same (Qwen2MoeConfig's defaults: 60 experts, top 4, 1408 wide)
    E, k, fe = (60, 4, 1408) if arch == "Qwen2MoeForCausalLM" else (128, 8, 768)
    experts = data.get("num_experts", data.get("num_local_experts", E))
    step, dense = data.get("decoder_sparse_step", 1), data.get("mlp_only_layers") or []
    if experts == 0:  # transformers builds every layer dense (Qwen3MoeDecoderLayer: num_experts > 0)
        return {}
    if step != 1:
        raise MemplanError(f"{path}: decoder_sparse_step = {echo(step)}: memplan models an MoE layer in every "
                           "layer after the dense ones (decoder_sparse_step 1, mlp_only_layers [0, ..., k-1])")
    if not isinstance(dense, list) or dense != list(range(len(dense))):
        shown = json.dumps(dense)
        shown = shown if len(shown) <= 60 else shown[:60] + "..."
        raise MemplanError(f"{path}: mlp_only_layers = {shown}: memplan models dense layers first only "
                           "(mlp_only_layers [0, 1, ..., k-1])")
    return dict(num_experts=experts, moe_top_k=data.get("num_experts_per_tok", k),
                moe_ffn_hidden_size=data.get("moe_intermediate_size", fe), moe_first_dense_layers=len(dense))


# transformers' DeepseekV2Config / DeepseekV3Config defaults for the keys a config.json may leave out
_DEEPSEEK_DEFAULTS = {
    "DeepseekV3ForCausalLM": dict(n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
                                  n_shared_experts=1, first_k_dense_replace=3),
    "DeepseekV2ForCausalLM": dict(n_routed_experts=64, num_experts_per_tok=None, moe_intermediate_size=1407,
                                  n_shared_experts=2, first_k_dense_replace=0),
}


def _read_deepseek_v3(data: dict, arch: str = "DeepseekV3ForCausalLM") -> dict[str, Any]:
    """DeepSeek-V3 (DeepseekV3ForCausalLM, transformers' defaults for missing keys): first_k_dense_replace
    dense layers intermediate_size wide, then MoE layers of n_routed_experts experts of moe_intermediate_size,
    top num_experts_per_tok, and n_shared_experts shared ones (one MLP n_shared_experts x moe_intermediate_size
    wide, DeepseekV3MoE); multi-head latent attention. Its multi-token-prediction layer
    (num_nextn_predict_layers, ModelSpec.mtp_layers) is not built by transformers: memplan models it for --impl
    megatron* (memplan/inventory/mla.py), not in the parameter total (DeepSeek-V3's 671 B excludes it)."""
    d = {**_DEEPSEEK_DEFAULTS[arch], **{k: v for k, v in data.items() if k in _DEEPSEEK_DEFAULTS[arch]}}
    return dict(deepseek_experts(d), kv_lora_rank=data.get("kv_lora_rank", 512), q_lora_rank=data.get("q_lora_rank", 1536),
                qk_nope_head_dim=data.get("qk_nope_head_dim", 128), qk_rope_head_dim=data.get("qk_rope_head_dim", 64),
                v_head_dim=data.get("v_head_dim", 128), mtp_layers=data.get("num_nextn_predict_layers", 0))


def _rope_theta(data: dict) -> Any:
    """RoPE's base: rope_theta at the top (transformers 4) or in rope_parameters (transformers 5); with a base per
    layer type (Gemma 3: sliding and full attention), the full-attention layers'. None when the file has none."""
    if data.get("rope_theta") is not None:
        return data["rope_theta"]
    params = data.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    return params.get("rope_theta") if isinstance(params, dict) else None


def _sliding_window(data: dict) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The sliding window as ModelSpec's sliding_window / sliding_window_pattern, from the layers transformers makes
    slide: layer_types where the file lists them; else as the config class fills them in (Gemma 2: every other
    layer, the first sliding; Gemma 3: all but every sliding_window_pattern-th, default 6; Qwen2 / Qwen3 with
    use_sliding_window: the layers from max_window_layers on; Mistral, Phi-3, Mixtral: every layer). A pattern
    that is none of these is left out, with a note."""
    window, kind = data.get("sliding_window"), data.get("model_type")
    if not window or data.get("use_sliding_window") is False or kind == "moshi":  # Moshi's: stored, never applied
        return {}, ()
    types, L = data.get("layer_types"), data.get("num_hidden_layers")
    if not isinstance(L, int) or isinstance(L, bool) or L <= 0:
        return {}, ()
    if isinstance(types, list) and types:
        slides = [t == "sliding_attention" for t in types]
    elif kind == "gemma2":
        slides = [(i + 1) % 2 != 0 for i in range(L)]
    elif kind in ("gemma3", "gemma3_text", "gemma4_text", "gemma4_unified_text"):  # Gemma 4: hf_families._gemma4
        n = data.get("sliding_window_pattern", 6)
        slides = [(i + 1) % n != 0 for i in range(L)] if isinstance(n, int) and n > 0 else []
    elif data.get("use_sliding_window"):
        first = data.get("max_window_layers", 0)
        slides = [i >= first for i in range(L)] if isinstance(first, int) else []
    else:
        slides = [True] * L
    if slides and all(slides):
        return dict(sliding_window=window), ()
    if not any(slides):
        return {}, ()
    n = slides.index(False) + 1
    if n > 1 and slides == [(i + 1) % n != 0 for i in range(len(slides))]:
        return dict(sliding_window=window, sliding_window_pattern=n), ()
    return {}, (f"the sliding window ({echo(window)} tokens) on some layers only, in a pattern other than every n-th "
                "layer full: not carried into the model (memory is the same; --emit megatron gives no window)",)


def _names(archs: list) -> str:
    """Architecture names for an error line: as they are when they are Python names, else quoted with their escapes
    (a newline in a name must not break the line), the first three only."""
    shown = [a if a.isidentifier() else echo(a) for a in archs[:3]]
    return ", ".join(shown) + (f" and {len(archs) - 3:,} more" if len(archs) > 3 else "")


def _falcon(data: dict, path: Path) -> dict[str, Any]:
    """Falcon (FalconForCausalLM; transformers' FalconConfig defaults): a parallel attention + MLP block (parallel_attn)
    with one shared LayerNorm, or two (ln_attn, ln_mlp) with new_decoder_architecture; K and V heads num_kv_heads
    (new_decoder_architecture), 1 (multi_query) or a; a GeLU MLP ffn_hidden_size wide; `bias` on every linear."""
    a = data.get("num_attention_heads", data.get("n_head", 71))
    new, parallel = _flag(data, "new_decoder_architecture", False, path), _flag(data, "parallel_attn", True, path)
    kv = data.get("num_kv_heads", a) if new else 1 if _flag(data, "multi_query", True, path) else a
    lns = data.get("num_ln_in_parallel_attn") or (2 if new else 1)
    h = data.get("hidden_size", 4544)
    return dict(num_layers=data.get("num_hidden_layers", data.get("n_layer", 32)), hidden_size=h,
                num_attention_heads=a, num_kv_heads=kv, ffn_hidden_size=data.get("ffn_hidden_size"),
                norm="layernorm", mlp="gelu", bias=_flag(data, "bias", False, path),
                norms_per_layer=2 if not parallel else lns, layer_layout="parallel" if parallel else "sequential",
                tied_embeddings=_flag(data, "tie_word_embeddings", True, path),
                dropout=max(_probability(data, "attention_dropout", 0.0, path),
                            _probability(data, "hidden_dropout", 0.0, path)) > 0)


def _family(arch: str, data: dict, path: Path) -> dict[str, Any]:
    """What a family's config.json sets beyond the Llama layout's fields (transformers' defaults for missing keys):
    norms, biases, q / k norms, gated or plain MLP, tied embeddings (checked against the meta-device model by
    tests/test_hub_configs.py; hf_families.LLAMA_KEYED: the families the registry walk added)."""
    if arch in LLAMA_KEYED or arch in OWN_FIELDS or arch in LATENT_KEYED:
        return {**LLAMA_KEYED, **OWN_FIELDS, **LATENT_KEYED}[arch](data, path)
    if arch == "GPTNeoXForCausalLM":  # GPTNeoXLayer: two LayerNorms, biased query_key_value, dense and MLP
        if not _flag(data, "attention_bias", True, path):
            raise MemplanError(f"{path}: GPT-NeoX with attention_bias false keeps its MLP biases: memplan puts a bias "
                               "on every linear or on the attention's only; write a model YAML (docs/reference.md, "
                               "Model presets)")
        return dict(norm="layernorm", mlp="gelu", bias=True, tied_embeddings=_flag(data, "tie_word_embeddings",
                                                                                   False, path),
                    layer_layout="parallel" if _flag(data, "use_parallel_residual", True, path) else "sequential")
    if arch == "Starcoder2ForCausalLM":  # LayerNorm with bias, c_fc / c_proj GeLU MLP, use_bias on every linear
        return dict(norm="layernorm", mlp="gelu", bias=_flag(data, "use_bias", True, path),
                    tied_embeddings=_flag(data, "tie_word_embeddings", True, path))
    if arch in ("CohereForCausalLM", "Cohere2ForCausalLM"):  # one CohereLayerNorm (no bias) before the parallel block; q / k norms per head
        return dict(norm="layernorm", norm_bias=False, norms_per_layer=1, layer_layout="parallel",
                    qk_norm=_flag(data, "use_qk_norm", False, path),
                    qk_norm_width="full", tied_embeddings=_flag(data, "tie_word_embeddings", True, path))
    if arch in ("Olmo2ForCausalLM", "Olmo3ForCausalLM"):  # q_norm over q, k_norm over q g/a; post-norms
        return dict(qk_norm=True, qk_norm_width="full", layer_layout="post-norm")
    if arch == "OlmoeForCausalLM":  # q_norm over q, k_norm over q g/a; pre-norms
        return dict(qk_norm=True, qk_norm_width="full")
    if arch == "Exaone4ForCausalLM":  # q_norm, k_norm over one head; post_attention / post_feedforward norms
        return dict(layer_layout="post-norm")
    if arch == "HyperCLOVAXForCausalLM":  # use_post_norm: post_norm1, post_norm2 beside the two pre-norms
        return dict(sandwich_norms=_flag(data, "use_post_norm", True, path))
    if arch == "Ernie4_5ForCausalLM":  # use_bias: q, k, v, o and the MLP's linears
        return dict(bias=_flag(data, "use_bias", False, path))
    if arch == "SeedOssForCausalLM":  # attention_bias: q, k, v; attention_out_bias: o_proj
        qkv, out = _flag(data, "attention_bias", True, path), _flag(data, "attention_out_bias", False, path)
        if out and not qkv or _flag(data, "mlp_bias", False, path) and not out:
            raise MemplanError(f"{path}: Seed-OSS with attention_bias {str(qkv).lower()}, attention_out_bias "
                               f"{str(out).lower()} and mlp_bias: memplan puts biases on q, k, v, on all four, or on "
                               "every linear; write a model YAML (docs/reference.md, Model presets)")
        return dict(qkv_bias=qkv and not out, attention_bias=out)
    if arch == "StableLmForCausalLM":  # LayerNorm with bias; use_qkv_bias: q, k, v
        if _flag(data, "qk_layernorm", False, path) or _flag(data, "use_parallel_residual", False, path):
            raise MemplanError(f"{path}: StableLM with qk_layernorm (a LayerNorm per head) or use_parallel_residual: "
                               "not modelled; write a model YAML (docs/reference.md, Model presets)")
        return dict(norm="layernorm", qkv_bias=_flag(data, "use_qkv_bias", False, path))
    if arch == "PhimoeForCausalLM":  # nn.LayerNorm with bias, lm_head_bias
        return dict(norm="layernorm", head_bias=_flag(data, "lm_head_bias", False, path))
    if arch == "GptOssForCausalLM":  # sinks, q / k / v / o biases (attention_bias, default true)
        return dict(attention_sinks=True, attention_bias=_flag(data, "attention_bias", True, path))
    return {}


def read_hf_config(path_text: str) -> ModelPreset:
    """A transformers config.json read as data (no code runs, nothing is downloaded); a directory: its config.json."""
    path = Path(path_text)
    if path.is_dir():
        path = path / "config.json"
    text = read_text(path, "config.json")
    data = load_json_text(text, str(path), infinity=True)  # transformers writes Mamba-2's time_step_limit [0, Infinity]
    if not isinstance(data, dict):
        raise MemplanError(f"{path}: expected a JSON object")
    archs = data.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise MemplanError(f"{path}: architectures: expected a list of class names (got {echo(archs)})")
    if not isinstance(data.get("model_type", ""), str):
        raise MemplanError(f"{path}: model_type: expected a name (got {echo(data['model_type'])})")
    if any(a in _DRAFTERS for a in archs):
        raise MemplanError(f"{path}: {_names(archs)} is a speculative-decoding drafter whose layers all reuse its target "
                           "model's keys and values: memplan estimates the target model's config.json")
    known = [a for a in archs if a in HF_ARCHITECTURES]
    notes: tuple[str, ...] = ()
    text_config = data.get("text_config")
    if known and known[0] == "Gemma3ForConditionalGeneration" or isinstance(text_config, dict) and \
            text_config.get("model_type") in TEXT_MODELS:
        data, text, notes = text_model(data, path)
        known = data["architectures"]
    moe = [k for k in _MOE_KEYS if isinstance(data.get(k), int) and data[k] > 1]
    if moe and not (known and known[0] in _READS_EXPERTS):
        arch = known[0] if known else _names(archs) or f"model_type {echo(data.get('model_type'))}"
        names = [a.removesuffix("ForCausalLM") for a in _READS_EXPERTS]
        raise MemplanError(f"{path}: {arch} with {moe[0]} = {data[moe[0]]}: memplan reads the experts of "
                           f"{', '.join(names[:3])} and {len(names) - 3} more architectures (docs/reference.md, "
                           f"config.json architectures) only; {_REFUSAL}")
    if not known and archs and archs[0] in NOT_READ:  # a family transformers builds as a causal LM, not read
        raise MemplanError(f"{path}: {NOT_READ[archs[0]]}: not read; {_REFUSAL}")
    if not known:
        name = _names(archs) if archs else f"model_type {echo(data.get('model_type'))}"
        raise MemplanError(f"{path}: architecture {name} is not one memplan reads from a config.json; {_REFUSAL}")
    layout = HF_ARCHITECTURES[known[0]]
    name = data.get("_name_or_path") if isinstance(data.get("_name_or_path"), str) else None
    name = name or str(path)
    positions_key, default = {**POSITIONS, **ENCODER_POSITIONS, **RECURRENT_POSITIONS}.get(
        known[0], ("n_positions", 1024) if layout == "gpt2" else ("max_position_embeddings", 2048 if
                                                                  known[0] in _OLD_DEFAULTS else 4096))
    positions = data.get(positions_key, default)
    if isinstance(positions, bool) or not isinstance(positions, int) or positions <= 0:
        raise MemplanError(f"{path}: {positions_key}: expected a positive integer (got {echo(positions)})")
    positions -= position_start(known[0], data)  # RoBERTa: rows before padding_idx + 1 unused (position_offset)
    seq = min(positions, HF_DEFAULT_SEQ)
    note = (f"s = {seq:,} from the config's {positions_key}" if seq == positions else
            f"s = {seq:,}: the config allows {positions:,} positions ({positions_key}), a context few train "
            f"with from the start; --seq-len sets s")
    window_notes: tuple[str, ...] = ()
    layers = [k for k in ("num_hidden_layers", "n_layer", "num_layers") if isinstance(data.get(k), int)
              and not isinstance(data[k], bool) and data[k] > MAX_LAYERS]  # before a reader builds a pattern L long
    if layers:
        raise MemplanError(f"{path}: {layers[0]}: at most {MAX_LAYERS:,} layers (got {data[layers[0]]:,})")
    try:
        if layout == "gpt2":
            dropout = any(_probability(data, k, 0.1, path) > 0 for k in ("resid_pdrop", "attn_pdrop", "embd_pdrop"))
            spec = dict(name=name, num_layers=data["n_layer"], hidden_size=data["n_embd"],
                        num_attention_heads=data["n_head"], seq_length=seq,
                        vocab_size=data["vocab_size"], ffn_hidden_size=data.get("n_inner"), dropout=dropout,
                        tied_embeddings=_flag(data, "tie_word_embeddings", True, path), attention="eager",
                        norm_eps=data.get("layer_norm_epsilon"))
        elif known[0] == "FalconForCausalLM":
            spec = dict(name=name, seq_length=seq, vocab_size=data["vocab_size"], position_embedding="rope",
                        attention="flash", **_falcon(data, path))
        elif known[0] in HYBRIDS:  # state-space hybrids (hf_hybrids): dropout on attention or the residual
            spec = dict(name=name, seq_length=seq, vocab_size=data["vocab_size"], attention="flash",
                        dropout=any(_probability(data, k, 0.0, path) > 0 for k in ("attention_dropout", "hidden_dropout")),
                        **HYBRIDS[known[0]](data, path))
        elif known[0] in OWN_KEYS or known[0] in ENCODERS:  # GPT-J, MPT, BERT, ...: dropout anywhere
            parts = (data, *[c for c in [data.get("attn_config")] if isinstance(c, dict)])
            drops = [(d, k) for d in parts for k in ("resid_pdrop", "embd_pdrop", "emb_pdrop", "attn_pdrop", "dropout",
                                                     "attention_dropout", "activation_dropout", "resid_dropout",
                                                     "embed_dropout", "hidden_dropout_prob",
                                                     "attention_probs_dropout_prob") if k in d]
            spec = dict(name=name, seq_length=seq, vocab_size=data["vocab_size"], attention="flash",
                        dropout=any(_probability(d, k, 0.0, path) > 0 for d, k in drops),
                        **{**OWN_KEYS, **ENCODERS}[known[0]](data, path))
        else:
            family = _family(known[0], data, path)
            gated = family.get("mlp", "swiglu") == "swiglu"
            act_key = "hidden_activation" if data.get("hidden_activation") else "hidden_act"
            acts = ("silu",) if layout == "llama" else _GATED_ACTS
            if gated and data.get(act_key, "silu") not in acts:
                raise MemplanError(f"{path}: {act_key} {data[act_key]!r}: memplan models the gated MLP with "
                                   f"{' / '.join(acts)}")
            attention_bias = _flag(data, "attention_bias", False, path)
            if _flag(data, "mlp_bias", False, path) and not attention_bias:
                raise MemplanError(f"{path}: mlp_bias without attention_bias: memplan puts a bias on every linear or "
                                   "on the attention's only; write a model YAML (docs/reference.md, Model presets)")
            spec = dict(name=name, num_layers=data["num_hidden_layers"], hidden_size=data["hidden_size"],
                        num_attention_heads=data["num_attention_heads"],
                        num_kv_heads=data.get("num_key_value_heads"),
                        ffn_hidden_size=None if known[0] in (*NO_DENSE_WIDTH, *OWN_FIELDS) else
                        data["intermediate_size"],
                        head_dim=_head_dim(data),
                        seq_length=seq, vocab_size=data["vocab_size"],
                        norm="rmsnorm", mlp="swiglu", position_embedding="rope",
                        tied_embeddings=_flag(data, "tie_word_embeddings", layout == "traced" and
                                              data.get("model_type", "").startswith("gemma"), path),
                        dropout=_probability(data, "attention_dropout", 0.0, path) > 0,
                        bias=_flag(data, "mlp_bias", False, path), attention_bias=attention_bias,
                        attention="flash", qk_norm=data.get("model_type") in _QK_NORM_TYPES,
                        qkv_bias=data.get("model_type") in _QKV_BIAS_TYPES,
                        sandwich_norms=data.get("model_type") in _SANDWICH_NORM_TYPES,
                        gate_activation=_GATE_ACTIVATION.get(data.get(act_key, "silu"), "gelu"),
                        rope_theta=_rope_theta(data), norm_eps=data.get("rms_norm_eps"))
            spec.update(family)
            window, window_notes = _sliding_window(data)
            spec.update(window)
            if known[0] in _MOE_ARCHITECTURES:
                spec.update(_read_moe(data, known[0], path))
    except KeyError as err:
        raise MemplanError(f"{path}: missing field {err.args[0]!r} for {known[0]}") from None
    except MemplanError:
        raise
    except (TypeError, ValueError):  # a reader's arithmetic on a field the file gives as null
        nulls = sorted(k for k, v in data.items() if v is None)
        if not nulls:
            raise
        raise MemplanError(f"{path}: {known[0]} needs a value where the file has null: {', '.join(nulls)}") from None
    notes = (note,) + notes + own_notes(known[0]) + window_notes
    if known[0] == "DeepseekV3ForCausalLM" and data.get("num_nextn_predict_layers"):
        notes += ("the multi-token-prediction layers (num_nextn_predict_layers, Megatron-LM --mtp-num-layers) are "
                  "modelled on the last stage for --impl megatron*, not in the parameter total; transformers' "
                  "DeepseekV3ForCausalLM builds none (--impl hf-*: not counted)",)
    notes += tuple(ENCODER_NOTES[a] for a in known[:1] if a in ENCODER_NOTES) + is_decoder_note(known[0], data)
    approximated = {**_APPROXIMATED, **APPROXIMATED, **LATENT_APPROXIMATED}
    if known[0] in approximated:
        notes += (f"{approximated[known[0]]}: its parameters are counted exactly; --impl megatron* approximates its "
                  "activations by a sequential pre-norm layer of the same widths (derived, not traced); --impl "
                  "hf-sdpa / hf-eager traces transformers' own code",)
    if layout == "traced":
        spec["inventory"], how = inventory_dir(data, text, configs_dir() / "traced")
        notes += (how,)
    if spec.get("position_embedding", "learned") == "learned":  # the table transformers builds, whatever s trains
        spec["position_rows"] = positions
    model = build(ModelSpec, {k: v for k, v in spec.items() if v is not None}, where=str(path))
    if model.mla_indexer:  # memplan/memory/indexer_groups.py
        notes += ("the lightning indexer runs under torch.no_grad: its parameters are counted in the weights, with no "
                  "gradient or optimizer state (measured on CPU: validation/untrained.py; under DeepSpeed ZeRO, which "
                  "steps every requires_grad parameter, with both: derived)",)
    return ModelPreset(model, {}, {}, None, str(path), notes)
