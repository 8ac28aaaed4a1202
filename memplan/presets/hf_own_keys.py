"""The config.json readers of the transformers families with their own key names (GPT-J's n_embd, MPT's d_model,
DBRX's nested configs, OPT, BioGPT, GPT-1, GPT-NeoX-Japanese, ModernBERT's decoder, CPM-Ant with tensors of their own
in ModelSpec.extra_tensors, ...), split from hf_families.py: ``OWN_KEYS`` gives each family's whole
spec but name, sequence and vocabulary, ``POSITIONS`` its position limit's key and default; each checked by the
registry walk (memplan/check/registry.py) against transformers' parameter count of the model on the meta device."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from memplan.core.errors import MemplanError
from memplan.core.spec_checks import ExtraTensor
from memplan.core.spec_base import echo
from memplan.presets.hf_families import YAML_HINT, flag, nat


def _gptj(data: dict, path: Path) -> dict[str, Any]:
    """GPT-J / CodeGen: one LayerNorm before attention and MLP in parallel; the MLP (fc_in, fc_out, n_inner or 4h
    wide) and lm_head biased, the attention not."""
    h = nat(data, "n_embd", 4096, path)
    return dict(num_layers=nat(data, "n_layer", 28, path), hidden_size=h, num_attention_heads=nat(data, "n_head", 16,
                                                                                                   path),
                ffn_hidden_size=data.get("n_inner"), norm="layernorm", mlp="gelu", bias=False, mlp_bias=True,
                head_bias=True, norms_per_layer=1, layer_layout="parallel", position_embedding="rope",
                tied_embeddings=flag(data, "tie_word_embeddings", False, path), norm_eps=data.get("layer_norm_epsilon"))


def _mpt(data: dict, path: Path) -> dict[str, Any]:
    """MPT (transformers' MptBlock): LayerNorms and linears without biases and a GeLU MLP 4 x d_model wide whatever
    no_bias and expansion_ratio say (a file asking otherwise is refused: MPT's own code would build another model),
    ALiBi (no position parameters), tied embeddings."""
    if not flag(data, "no_bias", True, path) or data.get("expansion_ratio", 4) != 4:
        raise MemplanError(f"{path}: MPT with no_bias false or expansion_ratio other than 4: transformers' MptForCausalLM "
                           f"builds neither (no biases, a 4 x d_model MLP), MPT's own code does; {YAML_HINT}")
    h = nat(data, "d_model", 2048, path)
    return dict(num_layers=nat(data, "n_layers", 24, path), hidden_size=h,
                num_attention_heads=nat(data, "n_heads", 16, path), ffn_hidden_size=4 * h, norm="layernorm",
                norm_bias=False, mlp="gelu", bias=False, position_embedding="rope",
                tied_embeddings=flag(data, "tie_word_embeddings", True, path), norm_eps=data.get("layer_norm_epsilon"))


def _dbrx(data: dict, path: Path) -> dict[str, Any]:
    """DBRX (DbrxBlock): LayerNorms without bias, no linear biases, attn_config's kv_n_heads K / V heads, every
    layer ffn_config's moe_num_experts gated experts ffn_hidden_size wide, top moe_top_k."""
    attn, ffn = data.get("attn_config") or {}, data.get("ffn_config") or {}
    if not isinstance(attn, dict) or not isinstance(ffn, dict):
        raise MemplanError(f"{path}: attn_config / ffn_config: expected JSON objects")
    return dict(num_layers=nat(data, "n_layers", 24, path), hidden_size=nat(data, "d_model", 2048, path),
                num_attention_heads=nat(data, "n_heads", 16, path), num_kv_heads=nat(attn, "kv_n_heads", 1, path),
                ffn_hidden_size=nat(ffn, "ffn_hidden_size", 3584, path), norm="layernorm", norm_bias=False,
                mlp="swiglu", bias=False, position_embedding="rope", num_experts=nat(ffn, "moe_num_experts", 4, path),
                moe_top_k=nat(ffn, "moe_top_k", 1, path), rope_theta=attn.get("rope_theta"),
                tied_embeddings=flag(data, "tie_word_embeddings", False, path))


def _gpt_bigcode(data: dict, path: Path) -> dict[str, Any]:
    """GPT-BigCode (StarCoder 1): GPT-2's layer (LayerNorms and linears biased, learned positions, tied) with one K /
    V head (multi_query) or a."""
    a = nat(data, "n_head", 12, path)
    return dict(num_layers=nat(data, "n_layer", 12, path), hidden_size=nat(data, "n_embd", 768, path),
                num_attention_heads=a, num_kv_heads=1 if flag(data, "multi_query", True, path) else a,
                ffn_hidden_size=data.get("n_inner"), norm="layernorm", mlp="gelu", bias=True,
                position_embedding="learned", tied_embeddings=flag(data, "tie_word_embeddings", True, path),
                norm_eps=data.get("layer_norm_epsilon"))


def _openai_gpt(data: dict, path: Path) -> dict[str, Any]:
    """GPT-1 (openai-gpt): GPT-2's widths (LayerNorms and linears biased, a GeLU MLP 4h wide, learned positions,
    tied) with post-norm layers (ln_1(x + attn), ln_2(n + mlp)) and no final norm."""
    return dict(num_layers=nat(data, "n_layer", 12, path), hidden_size=nat(data, "n_embd", 768, path),
                num_attention_heads=nat(data, "n_head", 12, path), norm="layernorm", mlp="gelu", bias=True,
                position_embedding="learned", final_norm=False,
                tied_embeddings=flag(data, "tie_word_embeddings", True, path), norm_eps=data.get("layer_norm_epsilon"))


def _opt(data: dict, path: Path) -> dict[str, Any]:
    """OPT: pre-LayerNorms with bias, q / k / v / out_proj and a ReLU MLP ffn_dim wide (biased unless enable_bias is
    false), max_position_embeddings + 2 learned position rows, tied embeddings; OPT-350m's post-norm layers with
    project_in / project_out (word_embed_proj_dim != hidden_size) are refused."""
    h = nat(data, "hidden_size", 768, path)
    if not flag(data, "do_layer_norm_before", True, path) or data.get("word_embed_proj_dim", h) != h or \
            flag(data, "_remove_final_layer_norm", False, path) or \
            not flag(data, "layer_norm_elementwise_affine", True, path):
        raise MemplanError(f"{path}: OPT with post-norm layers, project_in / project_out (word_embed_proj_dim "
                           f"{echo(data.get('word_embed_proj_dim'))} != hidden_size {h}) or norms without weights: "
                           f"memplan reads pre-norm OPT only; {YAML_HINT}")
    return dict(num_layers=nat(data, "num_hidden_layers", 12, path), hidden_size=h,
                num_attention_heads=nat(data, "num_attention_heads", 12, path),
                ffn_hidden_size=nat(data, "ffn_dim", 3072, path), norm="layernorm", mlp="gelu",
                bias=flag(data, "enable_bias", True, path), position_embedding="learned", position_offset=2,
                tied_embeddings=flag(data, "tie_word_embeddings", True, path))


def _biogpt(data: dict, path: Path) -> dict[str, Any]:
    """BioGPT: pre-LayerNorms with bias, every linear biased, a GeLU MLP intermediate_size wide, scaled word
    embeddings (no parameter), max_position_embeddings + 2 learned position rows, tied output_projection."""
    return dict(num_layers=nat(data, "num_hidden_layers", 24, path), hidden_size=nat(data, "hidden_size", 1024, path),
                num_attention_heads=nat(data, "num_attention_heads", 16, path),
                ffn_hidden_size=nat(data, "intermediate_size", 4096, path), norm="layernorm", mlp="gelu", bias=True,
                position_embedding="learned", position_offset=2, norm_eps=data.get("layer_norm_eps"),
                tied_embeddings=flag(data, "tie_word_embeddings", True, path))


def _gpt_neo(data: dict, path: Path) -> dict[str, Any]:
    """GPT-Neo: LayerNorms with bias, q / k / v without bias, out_proj and the MLP (intermediate_size or 4h) biased,
    learned positions, local / global attention (no parameters), tied embeddings."""
    return dict(num_layers=nat(data, "num_layers", 24, path), hidden_size=nat(data, "hidden_size", 2048, path),
                num_attention_heads=nat(data, "num_heads", 16, path), ffn_hidden_size=data.get("intermediate_size"),
                norm="layernorm", mlp="gelu", bias=False, mlp_bias=True, out_bias=True, position_embedding="learned",
                tied_embeddings=flag(data, "tie_word_embeddings", True, path), norm_eps=data.get("layer_norm_epsilon"))


def _xglm(data: dict, path: Path) -> dict[str, Any]:
    """XGLM: pre-LayerNorms with bias, every linear biased, a GeLU MLP ffn_dim wide, sinusoidal positions (a buffer,
    no parameters), tied embeddings."""
    return dict(num_layers=nat(data, "num_layers", 24, path), hidden_size=nat(data, "d_model", 1024, path),
                num_attention_heads=nat(data, "attention_heads", 16, path), ffn_hidden_size=nat(data, "ffn_dim", 4096,
                                                                                                 path),
                norm="layernorm", mlp="gelu", bias=True, position_embedding="rope",
                tied_embeddings=flag(data, "tie_word_embeddings", True, path))


def _bloom(data: dict, path: Path) -> dict[str, Any]:
    """BLOOM: a LayerNorm on the embeddings, LayerNorms and linears biased, a GeLU MLP 4h wide, ALiBi (no position
    parameters), tied embeddings."""
    h = nat(data, "hidden_size", data.get("n_embed", 64), path)  # BloomConfig's n_embed alias
    return dict(num_layers=nat(data, "n_layer", 2, path), hidden_size=h,
                num_attention_heads=nat(data, "n_head", 8, path), norm="layernorm", mlp="gelu", bias=True,
                embedding_norm=True, position_embedding="rope", norm_eps=data.get("layer_norm_epsilon"),
                tied_embeddings=flag(data, "tie_word_embeddings", True, path))


def _ctrl(data: dict, path: Path) -> dict[str, Any]:
    """CTRL: pre-LayerNorms with bias, every linear biased, a ReLU MLP dff wide, sinusoidal positions (no
    parameters), tied embeddings with lm_head's bias."""
    return dict(num_layers=nat(data, "n_layer", 48, path), hidden_size=nat(data, "n_embd", 1280, path),
                num_attention_heads=nat(data, "n_head", 16, path), ffn_hidden_size=nat(data, "dff", 8192, path),
                norm="layernorm", mlp="gelu", bias=True, head_bias=True, position_embedding="rope",
                norm_eps=data.get("layer_norm_epsilon"), tied_embeddings=flag(data, "tie_word_embeddings", True, path))


def _gpt_neox_japanese(data: dict, path: Path) -> dict[str, Any]:
    """GPT-NeoX-Japanese: pre-LayerNorm layers with bias, query_key_value, dense and a GeLU MLP int(h x
    intermediate_multiple_size) wide, none biased, and the last layer's dense_bias (an h-wide parameter added after its
    attention: an extra tensor on the last stage); rotary positions, a final LayerNorm; embed_out tied unless
    tie_word_embeddings is false (GPTNeoXJapaneseConfig's defaults for missing keys)."""
    h = nat(data, "hidden_size", 2560, path)
    width = data.get("intermediate_multiple_size", 4)
    if isinstance(width, bool) or not isinstance(width, (int, float)) or int(h * width) <= 0:
        raise MemplanError(f"{path}: intermediate_multiple_size: expected a positive number (got {echo(width)})")
    return dict(num_layers=nat(data, "num_hidden_layers", 32, path), hidden_size=h,
                num_attention_heads=nat(data, "num_attention_heads", 32, path), ffn_hidden_size=int(h * width),
                norm="layernorm", mlp="gelu", bias=False, position_embedding="rope", norm_eps=data.get("layer_norm_eps"),
                tied_embeddings=flag(data, "tie_word_embeddings", True, path),
                extra_tensors=(ExtraTensor(name="last layer's attention dense_bias", scope="last", rows=h),))


def _modernbert_decoder(data: dict, path: Path) -> dict[str, Any]:
    """ModernBERT's decoder (ModernBertDecoderForCausalLM): LayerNorms with a bias only with norm_bias, on the
    embeddings, before each layer's attention but the first's (attn_norm is an identity in layer 0: those L - 1 norms
    are extra tensors of the first stage, exact for the whole model) and MLP, and after the last layer; q / k / v / Wo
    biased with attention_bias, a GeLU-gated MLP (Wi h -> 2 f, Wo f -> h) biased with mlp_bias; rotary positions;
    the prediction head (lm_head: dense h x h, biased with classifier_bias, the activation, a LayerNorm) as extra
    tensors of the last stage; the decoder tied unless tie_word_embeddings is false, biased with decoder_bias
    (ModernBertDecoderConfig's defaults for missing keys)."""
    h, L = nat(data, "hidden_size", 768, path), nat(data, "num_hidden_layers", 22, path)
    norm_bias = flag(data, "norm_bias", False, path)
    extra = [ExtraTensor(name="attention norms of the layers but the first", scope="first", rows=h,
                         count=(L - 1) * (1 + norm_bias))] if L > 1 else []
    extra += [ExtraTensor(name="prediction head dense weight", scope="last", rows=h, cols=h),
              ExtraTensor(name="prediction head norm", scope="last", rows=h, count=1 + norm_bias)]
    extra += [ExtraTensor(name="prediction head dense bias", scope="last", rows=h)] * flag(data, "classifier_bias",
                                                                                           False, path)
    return dict(num_layers=L, hidden_size=h, num_attention_heads=nat(data, "num_attention_heads", 12, path),
                ffn_hidden_size=nat(data, "intermediate_size", 1152, path), norm="layernorm", norm_bias=norm_bias,
                norms_per_layer=1, embedding_norm=True, mlp="swiglu", gate_activation="gelu", bias=False,
                attention_bias=flag(data, "attention_bias", False, path), mlp_bias=flag(data, "mlp_bias", False, path),
                head_bias=flag(data, "decoder_bias", True, path), position_embedding="rope",
                norm_eps=data.get("norm_eps"), tied_embeddings=flag(data, "tie_word_embeddings", True, path),
                extra_tensors=tuple(extra))


def _cpmant(data: dict, path: Path) -> dict[str, Any]:
    """CPM-Ant: pre-norm layers with weight-only RMS norms (CpmAntLayerNorm), q / k / v / attention_out a x dim_head
    wide, a GeLU-gated MLP dim_ff wide, no biases, a final norm; segment embeddings (segment_types rows: the token
    types') beside input_embedding, whose prompt_types x prompt_length rows after the vocabulary's and the relative
    position bias ((segment_types^2 + position_bias_num_buckets) x a) are extra tensors of the first stage; lm_head
    v x h, never tied (CpmAntForCausalLM ties none; CpmAntConfig's defaults for missing keys)."""
    h, a = nat(data, "hidden_size", 4096, path), nat(data, "num_attention_heads", 32, path)
    segments = nat(data, "segment_types", 32, path)
    prompts = nat(data, "prompt_types", 32, path) * nat(data, "prompt_length", 32, path)
    buckets = nat(data, "position_bias_num_buckets", 512, path)
    return dict(num_layers=nat(data, "num_hidden_layers", 48, path), hidden_size=h, num_attention_heads=a,
                head_dim=nat(data, "dim_head", 128, path), ffn_hidden_size=nat(data, "dim_ff", 10240, path),
                norm="rmsnorm", mlp="swiglu", gate_activation="gelu", bias=False, position_embedding="rope",
                token_type_rows=segments, norm_eps=data.get("eps"), tied_embeddings=False,
                extra_tensors=(ExtraTensor(name="prompt rows of input_embedding", scope="first", rows=prompts, cols=h),
                               ExtraTensor(name="relative position bias", scope="first",
                                           rows=segments * segments + buckets, cols=a)))


OWN_KEYS: dict[str, Callable[[dict, Path], dict[str, Any]]] = {
    "GPTJForCausalLM": _gptj, "CodeGenForCausalLM": _gptj, "MptForCausalLM": _mpt, "DbrxForCausalLM": _dbrx,
    "GPTBigCodeForCausalLM": _gpt_bigcode, "XGLMForCausalLM": _xglm, "GPTNeoForCausalLM": _gpt_neo, "BloomForCausalLM": _bloom,
    "CTRLLMHeadModel": _ctrl, "OpenAIGPTLMHeadModel": _openai_gpt, "GPTNeoXJapaneseForCausalLM": _gpt_neox_japanese,
    "ModernBertDecoderForCausalLM": _modernbert_decoder, "CpmAntForCausalLM": _cpmant,
    "OPTForCausalLM": _opt, "BioGptForCausalLM": _biogpt,
    "MPTForCausalLM": _mpt,  # MPT's Hub files name the class of their own remote code (the same layout)
}

# the position limit's key and default of the OWN_KEYS families
POSITIONS = {"GPTJForCausalLM": ("n_positions", 2048), "CodeGenForCausalLM": ("n_positions", 2048),
             "MptForCausalLM": ("max_seq_len", 2048), "MPTForCausalLM": ("max_seq_len", 2048), "DbrxForCausalLM": ("max_seq_len", 2048),
             "GPTBigCodeForCausalLM": ("n_positions", 1024), "XGLMForCausalLM": ("max_position_embeddings", 2048),
             "BloomForCausalLM": ("seq_length", 2048), "GPTNeoForCausalLM": ("max_position_embeddings", 2048), "CTRLLMHeadModel": ("n_positions", 256),
             "OpenAIGPTLMHeadModel": ("n_positions", 512), "OPTForCausalLM": ("max_position_embeddings", 2048),
             "BioGptForCausalLM": ("max_position_embeddings", 1024),
             "GPTNeoXJapaneseForCausalLM": ("max_position_embeddings", 2048),
             "ModernBertDecoderForCausalLM": ("max_position_embeddings", 8192),
             "CpmAntForCausalLM": ("position_bias_max_distance", 2048)}  # relative positions: no table, no limit
