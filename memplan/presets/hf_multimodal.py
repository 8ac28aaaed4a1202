"""Multimodal config.json files read as their text model (issue 22): the vision / audio towers and projectors are left
out of the parameters and the activations (a text-only run), and the estimate's notes say so.

Two shapes of file: a ``text_config`` nested in the multimodal config (``TEXT_MODELS``: its ``model_type`` -> the causal
LM memplan reads it as; ``text_model`` rewrites the file as that model's), or a flat config whose top-level keys are the
text model's, the other modalities in ``vision_config`` / ``audio_config`` (``FLAT``: Phi-4-multimodal's Phi-3 decoder;
hf_config reads it under its own architecture name, so --impl hf-* traces its own class); ``OWN_FIELDS``: the text
models read as the Llama layout with fields of their own (Mllama's cross-attention layers, Moshi's temporal
transformer).  Each is checked by the registry walk (memplan/check/registry.py) against transformers' count of the
model on the meta device, its vision / audio parts left out (validation/registry.py ``LEFT_OUT``), and its trace
against a real CPU run's saved bytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from memplan.core.errors import MemplanError
from memplan.presets.hf_linear_attention import LINEAR_TEXT_MODELS

# A multimodal config's text model memplan reads (text_config's model_type -> its causal LM); the rest is left out
TEXT_MODELS = {"gemma3_text": "Gemma3ForCausalLM", "llama4_text": "Llama4ForCausalLM",
               "persimmon": "PersimmonForCausalLM", "qwen2": "Qwen2ForCausalLM", "emu3_text_model": "Emu3ForCausalLM",
               "gemma4_text": "Gemma4ForCausalLM", "gemma4_unified_text": "Gemma4UnifiedForCausalLM",
               "qwen3": "Qwen3ForCausalLM",  # MOSS-Transcribe-Diarize's decoder
               "mllama_text_model": "MllamaForCausalLM",  # Llama 3.2 Vision's, with its cross-attention layers
               **LINEAR_TEXT_MODELS}

# the flat multimodal configs: architecture -> what is left out (the rest of the file is the text model's)
FLAT = {
    "Phi4MultimodalForCausalLM": "Phi-4-multimodal's image and audio embedders (model.embed_tokens_extend: a SigLIP "
                                 "vision tower, a Conformer audio encoder and their projections)",
}


def text_model(data: dict, path: Path) -> tuple[dict, str, tuple[str, ...]]:
    """A multimodal config with a text_config (Gemma 3, Llama 4, Fuyu, GOT-OCR2, Emu3, MOSS-Transcribe-Diarize): its
    text_config read as the text model (its causal LM, TEXT_MODELS), the text that model's trace is keyed by, and a note
    on what is left out.  A *ForConditionalGeneration class ties its head by its own config's tie_word_embeddings
    (PreTrainedModel.get_expanded_tied_weights_keys reads self.config, the multimodal one): the file's top-level key,
    where it has one, wins over the text_config's."""
    text_config = data.get("text_config")
    if not isinstance(text_config, dict):
        raise MemplanError(f"{path}: text_config: expected the text model's config (a JSON object)")
    kind = text_config.get("model_type")
    kind = kind if kind in TEXT_MODELS else "gemma3_text"  # Gemma3ForConditionalGeneration's, whatever the file says
    text_data = {**text_config, "architectures": [TEXT_MODELS[kind]], "model_type": kind}
    archs = data.get("architectures") or []
    if archs and str(archs[0]).endswith("ForConditionalGeneration") and "tie_word_embeddings" in data:
        text_data["tie_word_embeddings"] = data["tie_word_embeddings"]
    left = [k.removesuffix("_config").replace("_", " ") for k in data if k.endswith("_config") and k != "text_config"]
    note = (f"the text model only (text_config, as {TEXT_MODELS[kind]}): the {' and '.join(left) or 'vision'} tower "
            "and the multimodal projector are left out of the parameters and the activations (a text-only run)")
    return text_data, json.dumps(text_data, sort_keys=True), (note,)


def _mllama(data: dict, path: Path) -> dict[str, Any]:
    """Mllama's text model (MllamaForCausalLM on MllamaTextConfig): the Llama layout, but the layers listed in
    cross_attention_layers are MllamaCrossAttentionDecoderLayer (q / k / v / o as a self-attention layer's, q_norm and
    k_norm one head wide, cross_attn_attn_gate and cross_attn_mlp_gate one scalar each, the MLP and two norms), the word
    embedding has vocab_size + 8 rows, the head vocab_size, never tied (MllamaForConditionalGeneration ties nothing)."""
    layers = data.get("cross_attention_layers", [3, 8, 13, 18, 23, 28, 33, 38])
    L = data.get("num_hidden_layers", 40)
    if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise MemplanError(f"{path}: cross_attention_layers: expected a list of layer indices")
    return dict(cross_attention_layers=len({i for i in layers if isinstance(L, int) and 0 <= i < L}),
                vocab_extra_rows=8, tied_embeddings=False, ffn_hidden_size=data.get("intermediate_size", 14336))


def _moshi(data: dict, path: Path) -> dict[str, Any]:
    """Moshi's temporal transformer alone (MoshiForCausalLM; MoshiConfig's defaults): the Llama layout with a gated MLP
    fused in fc1 (h -> ffn_dim, gate and up halves) and fc2 (ffn_dim / 2 -> h), so f = ffn_dim / 2; the word embedding
    vocab_size + 1 rows; its sliding_window never applied (MoshiModel's create_causal_mask: hf_config._sliding_window).
    The depth decoder and the Mimi audio codec (MoshiForConditionalGeneration) are not built."""
    ffn = data.get("ffn_dim", 22528)
    if not isinstance(ffn, int) or isinstance(ffn, bool) or ffn <= 0 or ffn % 2:
        raise MemplanError(f"{path}: ffn_dim: expected an even positive integer (fc1's gate and up halves)")
    return dict(ffn_hidden_size=ffn // 2, vocab_extra_rows=1)


# the text models read as the Llama layout with fields of their own, their MLP's width too (hf_config._family)
OWN_FIELDS = {"MllamaForCausalLM": _mllama, "MoshiForCausalLM": _moshi}


def own_notes(arch: str) -> tuple[str, ...]:
    """What an estimate of a multimodal file's text model says beside its figures: what is left out (FLAT), what a
    text-only step skips (Mllama's cross-attention layers)."""
    if arch in FLAT:
        return (f"the text model only ({arch}'s top-level keys): {FLAT[arch]} are left out of the parameters and the "
                "activations (a text-only run)",)
    if arch == "MoshiForCausalLM":
        return ("MoshiForCausalLM is Moshi's temporal transformer on text tokens alone: the depth decoder and the Mimi "
                "audio codec (depth_decoder_config, audio_encoder_config: MoshiForConditionalGeneration) are not built "
                "by it, and not counted",)
    if arch == "MllamaForCausalLM":
        return ("Mllama's cross-attention layers (cross_attention_layers) are counted in the parameters (each a "
                "self-attention layer's weights, q / k norms one head wide and two tanh gates); a text-only step skips "
                "them (MllamaTextModel without cross_attention_states), so --impl hf-* traces them as saving nothing; "
                "--impl megatron* counts every layer as a self-attention layer (a step with images runs them over the "
                "image states: derived, not traced)",)
    return ()
