"""The whole causal-LM registry of the installed transformers, walked with a tiny config of each architecture.

``architectures()`` is transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (model_type -> class).
``tiny_config(model_type)`` is that architecture's config class's own defaults, shrunk (``_SMALL``: two decoder
layers, h = 64, 4 heads, v = 512, 4 experts of which top 2, small latent ranks, a 16-token window), keeping what
makes the architecture what it is: the experts and shared experts, the latent attention, dense-first layers
(one), and the per-layer pattern of ``layer_types`` (one layer of each kind, in the order the defaults first show
them), nested sub-configs (``text_config``) shrunk the same way.  For each architecture:

* ``meta_params``: transformers' own parameter count of ``AutoModelForCausalLM.from_config`` on the meta device
  (a multimodal model's vision tower and projector left out, as memplan estimates the text model);
* ``memplan_params``: memplan's count from ``memplan/presets/hf_config.read_hf_config`` on the config's
  ``to_dict()`` written as a config.json, or the one-line refusal it gives;
* ``trace``: ``validation/trace.py``'s ``trace_hf_config`` (sdpa where the class has it, else eager; composed
  per layer kind), and ``measured``: its saved bytes at (s, b) against a real CPU run (``measure_hf_config``).

``EXCLUDED`` is the one list of the architectures memplan cannot estimate from a config.json or whose trace
fails, each with the reason; tests/test_registry.py checks it against the walk (parameters of every
architecture, traces of a sample) and docs/reference.md prints it (``python -m validation.registry --docs``
rewrites that table).  ``python -m validation.registry`` runs the whole walk, traces included, and prints a
summary (the figures in docs/reference.md, section "The transformers registry").
"""

from __future__ import annotations

import json
from typing import Any

import torch

from . import hf as _hf
from .trace import trace_hf_config
from .trace_config import hf_config
from .trace_measure import measure_hf_config

# the shrunk sizes: applied to each key the config class's to_dict() has (nested sub-configs too)
_SMALL = {
    "num_hidden_layers": 2, "n_layer": 2, "n_layers": 2, "num_layers": 2,
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "emb_dim": 64,
    "intermediate_size": 128, "n_inner": 128, "ffn_hidden_size": 128, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "num_attention_heads": 4, "n_head": 4, "n_heads": 4,
    "num_key_value_heads": 2, "num_kv_heads": 2, "head_dim": 16, "vocab_size": 512,
    "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "first_k_dense_replace": 1, "sliding_window": 16, "max_position_embeddings": 4096, "n_positions": 4096,
    "d_head": 16, "rotary_dim": 8, "index_n_heads": 4, "index_head_dim": 32,
    "index_topk": 16, "vocab_size_per_layer_input": 512, "hidden_size_per_layer_input": 8,
    # an encoder-decoder model's (BART, Whisper, ...): its decoder run alone as the causal LM, its encoder shrunk too
    "decoder_layers": 2, "encoder_layers": 2, "decoder_ffn_dim": 128, "encoder_ffn_dim": 128,
    "decoder_attention_heads": 4, "encoder_attention_heads": 4, "decoder_vocab_size": 512,
    "num_decoder_layers": 2, "num_encoder_layers": 2, "num_decoder_attention_heads": 4,  # ProphetNet's
    "num_encoder_attention_heads": 4,
}

# a Mamba-2 mixer's shrunk sizes (the configs with a time_step_limit: Mamba-2, Bamba, Nemotron-H, Granite 4 hybrids,
# Falcon-H1): 8 heads 16 wide (= 2 h, the expand the config classes check), a 16-wide state, 16-token chunks (s = 32
# runs two chunks of the scan); defaults with mixers only (Bamba's, Granite 4's) get attention in their last layer
_SMALL_SSM = {"num_heads": 8, "mamba_n_heads": 8, "mamba_num_heads": 8, "head_dim": 16, "mamba_d_head": 16,
              "mamba_head_dim": 16, "state_size": 16, "mamba_d_state": 16, "ssm_state_size": 16, "n_groups": 2,
              "mamba_n_groups": 2, "chunk_size": 16, "mamba_chunk_size": 16, "time_step_rank": 8, "mamba_d_ssm": 128,
              "shared_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32}

# a gated DeltaNet's shrunk sizes (the configs with linear_num_value_heads: Qwen3-Next, Qwen3.5, OLMo-hybrid): 4 value
# heads 16 wide, 2 key heads 8 wide (None in OLMo-hybrid's defaults: derived from h there, left so)
_SMALL_DELTA = {"linear_num_value_heads": 4, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
                "linear_key_head_dim": 8}

# Kimi Delta Attention's shrunk sizes (the configs with linear_num_heads: Kimi Linear, Bailing-hybrid): 4 heads 16 wide;
# their experts' top-k and groups under attribute_map's names (num_experts_per_token, num_expert_group)
_SMALL_KDA = {"linear_num_heads": 4, "linear_head_dim": 16, "num_experts_per_token": 2, "num_expert_group": 1}


# RecurrentGemma's shrunk sizes: the RG-LRU 96 wide (not h, so the reader must take lru_width: 4 heads of 24), a
# 16-token attention window (the walk's s = 32 runs past it)
_SMALL_RGLRU = {"lru_width": 96, "attention_window_size": 16}
# RWKV's: the time mixing 96 wide (not h, so the reader must take attention_hidden_size)
_SMALL_RWKV = {"attention_hidden_size": 96}
# MiniMax's: the lightning attention's blocks 16 tokens (the walk's s = 32 runs two)
_SMALL_LIGHTNING = {"block_size": 16}
# Doge's: its dynamic mask keeps the top 16 keys (the walk's s = 32 runs past it, as sliding_window's 16)
_SMALL_DOGE = {"keep_window_size": 16}
# HRM's: two layers per stack (num_layers_per_stack; num_hidden_layers the slots of its cycles, 2 x H_cycles x
# (L_cycles + 1), as HrmTextConfig writes it)
_SMALL_HRM = {"num_layers_per_stack": 2}
# xLSTM's: its num_blocks and embedding_dim (what xLSTMModel builds) as the shrunk layers and h
_SMALL_MLSTM = {"num_blocks": 2, "embedding_dim": _SMALL["hidden_size"]}

# keys whose default None builds no model: given their shrunk size (head_dim 16 = h / a)
_NONE_FILLED = ("num_experts_per_tok", "head_dim", "num_key_value_heads", "n_routed_experts", "n_shared_experts")

# a config class whose defaults its own validation refuses, built with what that validation asks (Gemma 4's
# assistant, a drafter: a text model without per-layer inputs, experts or double-wide MLPs, as the published one)
_BUILT_WITH = {"gemma4_assistant": {"text_config": {"model_type": "gemma4_text", "hidden_size_per_layer_input": 0,
                                                    "vocab_size_per_layer_input": 0, "enable_moe_block": False,
                                                    "use_double_wide_mlp": False}}}

# a multimodal model's parts outside its text model (memplan estimates the text model: memplan/presets/hf_multimodal.py)
LEFT_OUT = ("vision_tower.", "multi_modal_projector.", "vision_model.", "audio_tower.", "embed_vision.",
            "vision_embed_tokens.", "embed_audio.",  # Fuyu: its patch projection
            "embed_tokens_extend.")  # Phi-4-multimodal's image and audio embedders


def architectures() -> dict[str, str]:
    """transformers' causal-LM mapping: model_type -> the class AutoModelForCausalLM builds."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _shrink(data: dict) -> dict:
    out = dict(data)
    layers_key = next((k for k in ("num_hidden_layers", "n_layer", "n_layers", "num_layers") if k in data), None)
    n_old = data.get(layers_key) if layers_key else None
    for k, v in data.items():
        if k in _SMALL and isinstance(v, int) and not isinstance(v, bool) and v > 0:
            out[k] = _SMALL[k]
        elif k in _NONE_FILLED and v is None:  # a default that cannot run (DeepSeek-V2's top-k, Ministral's head_dim,
            out[k] = _SMALL[k]  # dots1's experts): a published config.json writes the number
        elif k == "attn_config" and isinstance(v, dict) and "kv_n_heads" in v:  # DBRX's attention config: no
            # rope_theta default (the model reads it), clip_qkv None (a clamp without bounds): DBRX's published values
            out[k] = {**v, "rope_theta": 500000.0, "clip_qkv": v.get("clip_qkv") or 8.0}
        elif isinstance(v, dict) and "model_type" in v:
            out[k] = _shrink(v)
    if "time_step_limit" in data:
        out.update({k: v for k, v in _SMALL_SSM.items() if k in data and isinstance(data[k], int)})
    if "linear_num_value_heads" in data:
        out.update({k: v for k, v in _SMALL_DELTA.items() if isinstance(data.get(k), int)})
    if "linear_num_heads" in data:
        out.update({k: v for k, v in _SMALL_KDA.items() if isinstance(data.get(k), int)})
    if "lru_width" in data:
        out.update(_SMALL_RGLRU)
    if "rescale_every" in data:
        out.update(_SMALL_RWKV)
    if "linear_attn_alpha_factor" in data:
        out.update(_SMALL_LIGHTNING)
    if "num_layers_per_stack" in data and "H_cycles" in data:
        out.update(_SMALL_HRM)
    if "keep_window_size" in data:
        out.update(_SMALL_DOGE)
    if "qk_dim_factor" in data:
        out.update(_SMALL_MLSTM)
    for k, v in data.items():  # token ids inside the shrunk vocabulary (a padding id must index the embedding)
        if k.endswith("_token_id") and isinstance(v, int) and not isinstance(v, bool) and v >= _SMALL["vocab_size"]:
            out[k] = 0
        elif k.endswith("_token_id") and isinstance(v, list):
            out[k] = [0 if isinstance(x, int) and x >= _SMALL["vocab_size"] else x for x in v]
    if "qk_rope_head_dim" in data and "head_dim" in data:  # DeepSeek's rotary tables are qk_rope_head_dim wide
        out["head_dim"] = out["qk_rope_head_dim"]
    if "qk_head_dim" in data and "qk_nope_head_dim" in data:  # the derived width the defaults wrote out
        out["qk_head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    if data.get("attention_hidden_size") == 2 * data.get("hidden_size", 0):  # Zamba's shared block: [x, embedding]
        out["attention_hidden_size"] = 2 * out["hidden_size"]
        if data.get("attention_head_dim") == data["attention_hidden_size"] // data.get("num_attention_heads", 0):
            out["attention_head_dim"] = out["attention_hidden_size"] // out["num_attention_heads"]
    if "word_embed_proj_dim" in data and data["word_embed_proj_dim"] == data.get("hidden_size"):  # OPT: no projection
        out["word_embed_proj_dim"] = out["hidden_size"]
    if "kv_lora_rank" in data and "num_key_value_heads" in data:  # latent attention: one K / V per query head
        out["num_key_value_heads"] = out["num_attention_heads"]
    n = _SMALL.get(layers_key, 2) if layers_key else None
    if out.get("first_k_dense_replace"):
        n = 3  # one dense layer, then two MoE layers
    if "lru_width" in data:
        n = 3  # RecurrentGemma: block_types' period, two recurrent layers and an attention one
    if "num_layers_per_stack" in data and "H_cycles" in data:  # HRM: the slots of its cycles
        n = _SMALL_HRM["num_layers_per_stack"] * data["H_cycles"] * (data["L_cycles"] + 1)
    types = data.get("layer_types")
    if isinstance(types, list) and types and n:
        kinds = list(dict.fromkeys(types))
        n = max(n, len(kinds))
        # one layer of each kind in the order the defaults first show them, the last kind repeated up to n
        out["layer_types"] = kinds + [kinds[-1]] * (n - len(kinds))
    if isinstance(data.get("per_layer_config"), dict) and isinstance(types, list) and "layer_types" in out:
        out["per_layer_config"] = _shrink_overrides(data, out, types)
    if "time_step_limit" in data and "attn_layer_indices" in data and not data["attn_layer_indices"]:
        out["attn_layer_indices"] = [1]
    if "time_step_limit" in data and out.get("layer_types") == ["linear_attention"] * 2:
        out["layer_types"] = ["linear_attention", "full_attention"]
    if n and layers_key:
        out[layers_key] = n
        for k, v in data.items():  # other per-layer lists (mlp_only_layers is a list of indices: left as is)
            if k != "layer_types" and isinstance(v, list) and n_old and len(v) == n_old and n_old > n:
                out[k] = v[:n]
        kinds = list(dict.fromkeys(data.get("mlp_layer_types") or []))
        if len(set(out.get("mlp_layer_types") or [])) < len(kinds) <= n:  # the first n lost a kind (DeepSeek-V3.2's
            # dense layers, then MoE ones): one of each kind, the last repeated (first_k_dense_replace's one dense)
            out["mlp_layer_types"] = kinds + [kinds[-1]] * (n - len(kinds))
        if data.get("num_experts") and set(range(n)) <= set(data.get("mlp_only_layers") or []):  # Flint's [0, 1]: no
            out["mlp_only_layers"] = [0]  # MoE layer left in n layers; one dense layer, then MoE ones
    if "mamba_headdim" in data and "hybrid_layer_ids" in data:  # Zamba 2: the widths its config derives (a file's
        # own win over them), a Mamba-2 layer and a hybrid one (a use of the shared block, its adapters rank 8)
        out.update({k: v for k, v in _SMALL_SSM.items() if k in data and isinstance(data[k], int)},
                   layers_block_type=["linear_attention", "hybrid"], hybrid_layer_ids=[1], adapter_rank=8)
        out["mamba_headdim"] = int(out["mamba_expand"] * out["hidden_size"]) // out["n_mamba_heads"]
    if data.get("cross_attention_layers") and n and layers_key:  # Mllama's text model: its second layer attends to
        out["cross_attention_layers"] = [n - 1]  # the image states (the defaults' first such layer is the fourth)
    if "conv_L_cache" in data and out.get("layer_types") == ["full_attention"] * 2:  # LFM2's defaults: attention only
        out["layer_types"], out["full_attn_idxs"] = ["conv", "full_attention"], [1]
    if data.get("attention_type") == "block_sparse":  # BigBird: full attention, what memplan reads (block-sparse
        out["attention_type"] = "original_full"  # attention specialises s: refused, tests/test_encoders.py)
    if "conv_L_cache" in data and "num_dense_layers" in data:  # LFM2-MoE: no default layer_types; one dense layer
        out.update(num_hidden_layers=3, num_dense_layers=1, layer_types=["conv", "full_attention", "conv"])
    if n and data.get("num_kv_shared_layers") == n_old:  # every layer reuses K / V (Gemma 4's assistant): still every
        out["num_kv_shared_layers"] = n
    _fill(out)
    return out


def _fill(out: dict) -> None:
    """Per architecture, what its defaults leave unset or set so that no model builds, as a config.json writes it."""
    kind, types = out.get("model_type"), out.get("layer_types") or []
    if kind == "qwen4_exp_text" and "indexed_attention" in types and out.get("indexer_n_heads") is None:
        # its indexed_attention layers always build the QSA indexer, whose sizes default to None: 4 query heads and
        # the one key head the class requires, h / a wide (the rotary part must fit), 16 tokens picked from blocks of 4
        out.update(indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=16,
                   indexer_compress_ratio=4)
    if kind == "cohere_compass_text" and not out.get("rope_parameters"):
        # rotary set per layer kind (the defaults write none): as the published North config, the full-attention
        # layers without position encoding (None), the sliding ones with rotary (base 50000)
        out["rope_parameters"] = {t: None if t == "full_attention" else {"rope_type": "default", "rope_theta": 50000.0}
                                  for t in dict.fromkeys(types)}
    if kind == "dots3_note_text":  # its sliding layers' heads are qk_nope_head_dim + qk_rope_head_dim wide (checked)
        for layer in (out.get("per_layer_config") or {}).values():
            if "qk_nope_head_dim" in layer:
                layer["head_dim"] = layer["qk_nope_head_dim"] + layer.get("qk_rope_head_dim", out["qk_rope_head_dim"])
    if kind == "zaya":  # its config class accepts top-1 routing only: the defaults' one expert per token kept
        out["num_experts_per_tok"] = 1


def _shrink_overrides(data: dict, out: dict, types: list) -> dict:
    """per_layer_config (layer index -> overrides) for the shrunk layers: each shrunk layer takes the overrides of the
    first default layer of its kind, so the overrides agree with the shrunk layer_types (transformers refuses an index
    past the last layer); a size keeps its ratio to the default it overrides (Gemma 4's full-attention heads twice as
    wide: 32 against 16; dots3's sliding layers' half as many heads, twice the latent rank), unlike the shrunk
    defaults so that the reader must take them; latent attention keeps one K / V per query head there too."""
    by_index = {int(k): v for k, v in data["per_layer_config"].items()}
    shrunk = {}
    for i, kind in enumerate(out["layer_types"]):
        first = types.index(kind)
        if by_index.get(first):
            shrunk[str(i)] = {k: _override(v, data.get(k), out.get(k)) for k, v in by_index[first].items()}
            if "kv_lora_rank" in data and "num_attention_heads" in shrunk[str(i)]:
                shrunk[str(i)]["num_key_value_heads"] = shrunk[str(i)]["num_attention_heads"]
    return shrunk


def _override(value: Any, default: Any, small: Any) -> Any:
    """An override's shrunk size: small * value / default when that is a whole number, else the shrunk default."""
    if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (value, default, small)):
        return value
    return small * value // default if small * value % default == 0 else small


def tiny_config(model_type: str) -> dict:
    """The config.json of a tiny model of the architecture: its config class's defaults, shrunk."""
    tf = _hf._transformers()
    data = tf.CONFIG_MAPPING[model_type](**_BUILT_WITH.get(model_type, {})).to_dict()
    data = json.loads(json.dumps(_shrink(data), default=str))
    data["architectures"] = [architectures()[model_type]]
    data["model_type"] = model_type
    return data


def meta_params(config: dict) -> int:
    """transformers' count: the model built on the meta device, each tensor once, the vision parts left out."""
    tf = _hf._transformers()
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(hf_config(config))
    return sum(p.numel() for name, p in model.named_parameters() if not any(part in name for part in LEFT_OUT))


def impl_of(config: dict) -> str:
    """hf-sdpa where the architecture's class has an sdpa path, else hf-eager (Gemma 2, ...)."""
    tf = _hf._transformers()
    cls = getattr(tf, config["architectures"][0])
    return "hf-sdpa" if getattr(cls, "_supports_sdpa", False) else "hf-eager"


def text_model(config: dict) -> dict:
    """The config traced: a multimodal config's text_config as its own causal LM (what memplan estimates), else
    the config itself."""
    text = config.get("text_config")
    if not isinstance(text, dict) or "model_type" not in text:
        return config
    if text["model_type"] in architectures():
        return {**text, "architectures": [architectures()[text["model_type"]]]}
    # a causal LM whose own config class is the text model's (Emu3ForCausalLM: Emu3TextConfig)
    cls = getattr(_hf._transformers(), config["architectures"][0], None)
    own = getattr(getattr(cls, "config_class", None), "model_type", None)
    return {**text, "architectures": config["architectures"]} if own == text["model_type"] else config


def trace(config: dict) -> dict:
    """The traced inventory of the tiny config (saved tensors only, composed per layer kind)."""
    config = text_model(config)
    return trace_hf_config(config, impl=impl_of(config), kernels="cpu", moments=False)


def measure(config: dict, s: int, b: int) -> dict:
    """What a real CPU run of the tiny model saves at (s, b) (validation/trace_measure.py measure_hf_config)."""
    config = text_model(config)
    return measure_hf_config(config, s, b, impl=impl_of(config))


__all__ = ["architectures", "tiny_config", "meta_params", "trace", "measure", "impl_of", "text_model"]
