"""A transformers config.json read as a model preset: the architectures memplan models, their fields mapped onto ModelSpec
(mixture of experts, latent attention, sliding windows, norms), and the shipped traced inventory it is matched to."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from memplan.core.datafile import load_json_text, read_text
from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.core.spec_base import build, echo
from memplan.inventory.traced_file import inventory_dir
from memplan.presets.files import ModelPreset, configs_dir

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
}


# Gated activations of the Llama-layout MLP (gate and up projections f wide, the product into down_proj).
_GATED_ACTS = ("silu", "gelu_pytorch_tanh", "gelu")


# The config keys that make a model a mixture of experts; the MoE architectures memplan reads (_read_moe)
# and the key of their routed-expert count. Other MoE architectures are refused.
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


_MOE_ARCHITECTURES = {"MixtralForCausalLM": "num_local_experts", "Qwen3MoeForCausalLM": "num_experts",
                      "DeepseekV3ForCausalLM": "n_routed_experts"}


# model types whose attention normalises each head's queries and keys (q_norm, k_norm)
_QK_NORM_TYPES = ("qwen3", "qwen3_moe", "gemma3_text", "gemma3")


_QKV_BIAS_TYPES = ("qwen2",)  # Qwen2Attention: q_proj, k_proj, v_proj with bias=True, o_proj without


_SANDWICH_NORM_TYPES = ("gemma2", "gemma3_text", "gemma3")  # post_attention / pre- and post_feedforward norms


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


def _flag(data: dict, key: str, default: bool, path: Path) -> bool:
    """A true / false field of a config.json: JSON's true or false (a string "false" is refused, not read as true);
    missing or null: transformers' default."""
    value = data.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise MemplanError(f"{path}: {key}: expected true or false (got {echo(value)})")
    return value


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
    if arch == "MixtralForCausalLM":
        return dict(num_experts=data.get("num_local_experts", 8), moe_top_k=data.get("num_experts_per_tok", 2))
    if arch == "DeepseekV3ForCausalLM":
        return _read_deepseek_v3(data)
    experts = data.get("num_experts", 128)
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
    return dict(num_experts=experts, moe_top_k=data.get("num_experts_per_tok", 8),
                moe_ffn_hidden_size=data.get("moe_intermediate_size", 768), moe_first_dense_layers=len(dense))


def _read_deepseek_v3(data: dict) -> dict[str, Any]:
    """DeepSeek-V3 (DeepseekV3ForCausalLM, transformers' defaults for missing keys): first_k_dense_replace
    dense layers intermediate_size wide, then MoE layers of n_routed_experts experts of moe_intermediate_size,
    top num_experts_per_tok, and n_shared_experts shared ones (one MLP n_shared_experts x moe_intermediate_size
    wide, DeepseekV3MoE); multi-head latent attention. Its multi-token-prediction layer
    (num_nextn_predict_layers, ModelSpec.mtp_layers) is not built by transformers: memplan models it for --impl
    megatron* (memplan/inventory/mla.py), not in the parameter total (DeepSeek-V3's 671 B excludes it)."""
    fe, shared = data.get("moe_intermediate_size", 2048), data.get("n_shared_experts", 1)
    both_ints = all(isinstance(x, int) and not isinstance(x, bool) for x in (fe, shared))
    return dict(num_experts=data.get("n_routed_experts", 256), moe_top_k=data.get("num_experts_per_tok", 8),
                moe_ffn_hidden_size=fe, moe_shared_ffn_hidden_size=fe * shared if both_ints else shared,
                moe_first_dense_layers=data.get("first_k_dense_replace", 3),
                kv_lora_rank=data.get("kv_lora_rank", 512), q_lora_rank=data.get("q_lora_rank", 1536),
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
    if not window or data.get("use_sliding_window") is False:
        return {}, ()
    types, L = data.get("layer_types"), data.get("num_hidden_layers")
    if not isinstance(L, int) or isinstance(L, bool) or L <= 0:
        return {}, ()
    if isinstance(types, list) and types:
        slides = [t == "sliding_attention" for t in types]
    elif kind == "gemma2":
        slides = [(i + 1) % 2 != 0 for i in range(L)]
    elif kind in ("gemma3", "gemma3_text"):
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


def read_hf_config(path_text: str) -> ModelPreset:
    """A transformers config.json read as data (no code runs, nothing is downloaded)."""
    path = Path(path_text)
    text = read_text(path, "config.json")
    data = load_json_text(text, str(path))
    if not isinstance(data, dict):
        raise MemplanError(f"{path}: expected a JSON object")
    archs = data.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise MemplanError(f"{path}: architectures: expected a list of class names (got {echo(archs)})")
    if not isinstance(data.get("model_type", ""), str):
        raise MemplanError(f"{path}: model_type: expected a name (got {echo(data['model_type'])})")
    known = [a for a in archs if a in HF_ARCHITECTURES]
    moe = [k for k in _MOE_KEYS if isinstance(data.get(k), int) and data[k] > 1]
    if moe and not (known and known[0] in _MOE_ARCHITECTURES):
        arch = known[0] if known else _names(archs) or f"model_type {echo(data.get('model_type'))}"
        raise MemplanError(f"{path}: {arch} with {moe[0]} = {data[moe[0]]}: memplan models the experts of "
                           "Mixtral, Qwen3-MoE and DeepSeek-V3 only (issue 11)")
    if not known:
        name = _names(archs) if archs else f"model_type {echo(data.get('model_type'))}"
        raise MemplanError(f"{path}: architecture {name} is not one memplan models; known: "
                           f"{', '.join(HF_ARCHITECTURES)}")
    layout = HF_ARCHITECTURES[known[0]]
    name = data.get("_name_or_path") if isinstance(data.get("_name_or_path"), str) else None
    name = name or str(path)
    positions_key = "n_positions" if layout == "gpt2" else "max_position_embeddings"
    positions = data.get(positions_key, 1024 if layout == "gpt2" else 4096)
    if isinstance(positions, bool) or not isinstance(positions, int) or positions <= 0:
        raise MemplanError(f"{path}: {positions_key}: expected a positive integer (got {echo(positions)})")
    seq = min(positions, HF_DEFAULT_SEQ)
    note = (f"s = {seq:,} from the config's {positions_key}" if seq == positions else
            f"s = {seq:,}: the config allows {positions:,} positions ({positions_key}), a context few train "
            f"with from the start; --seq-len sets s")
    window_notes: tuple[str, ...] = ()
    try:
        if layout == "gpt2":
            dropout = any(_probability(data, k, 0.1, path) > 0 for k in ("resid_pdrop", "attn_pdrop", "embd_pdrop"))
            spec = dict(name=name, num_layers=data["n_layer"], hidden_size=data["n_embd"],
                        num_attention_heads=data["n_head"], seq_length=seq,
                        vocab_size=data["vocab_size"], ffn_hidden_size=data.get("n_inner"), dropout=dropout,
                        tied_embeddings=_flag(data, "tie_word_embeddings", True, path), attention="eager",
                        norm_eps=data.get("layer_norm_epsilon"))
        else:
            act_key = "hidden_activation" if data.get("hidden_activation") else "hidden_act"
            acts = ("silu",) if layout == "llama" else _GATED_ACTS
            if data.get(act_key, "silu") not in acts:
                raise MemplanError(f"{path}: {act_key} {data[act_key]!r}: memplan models the gated MLP with "
                                   f"{' / '.join(acts)}")
            spec = dict(name=name, num_layers=data["num_hidden_layers"], hidden_size=data["hidden_size"],
                        num_attention_heads=data["num_attention_heads"],
                        num_kv_heads=data.get("num_key_value_heads"), ffn_hidden_size=data["intermediate_size"],
                        head_dim=_head_dim(data),
                        seq_length=seq, vocab_size=data["vocab_size"],
                        norm="rmsnorm", mlp="swiglu", position_embedding="rope",
                        tied_embeddings=_flag(data, "tie_word_embeddings", layout == "traced" and
                                              data.get("model_type", "").startswith("gemma"), path),
                        dropout=_probability(data, "attention_dropout", 0.0, path) > 0,
                        bias=_flag(data, "attention_bias", False, path) or _flag(data, "mlp_bias", False, path),
                        attention="flash", qk_norm=data.get("model_type") in _QK_NORM_TYPES,
                        qkv_bias=data.get("model_type") in _QKV_BIAS_TYPES,
                        sandwich_norms=data.get("model_type") in _SANDWICH_NORM_TYPES,
                        gate_activation="silu" if data.get(act_key, "silu") == "silu" else "gelu",
                        rope_theta=_rope_theta(data), norm_eps=data.get("rms_norm_eps"))
            window, window_notes = _sliding_window(data)
            spec.update(window)
            if known[0] in _MOE_ARCHITECTURES:
                spec.update(_read_moe(data, known[0], path))
    except KeyError as err:
        raise MemplanError(f"{path}: missing field {err.args[0]!r} for {known[0]}") from None
    notes = (note,) + window_notes
    if known[0] == "DeepseekV3ForCausalLM" and data.get("num_nextn_predict_layers"):
        notes += ("the multi-token-prediction layers (num_nextn_predict_layers, Megatron-LM --mtp-num-layers) are "
                  "modelled on the last stage for --impl megatron*, not in the parameter total; transformers' "
                  "DeepseekV3ForCausalLM builds none (--impl hf-*: not counted)",)
    if layout == "traced":
        spec["inventory"], how = inventory_dir(data, text, configs_dir() / "traced")
        notes += (how,)
    model = build(ModelSpec, {k: v for k, v in spec.items() if v is not None}, where=str(path))
    return ModelPreset(model, {}, {}, None, str(path), notes)
