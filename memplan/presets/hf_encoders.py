"""The config.json readers of the encoder families that transformers builds as causal LMs (issue 22): the BERT-like
encoders BERT, RoBERTa and its copies, ERNIE, BERT-generation, Megatron-BERT, RoBERTa-PreLayerNorm, XLM-RoBERTa-XL,
and those with factorised embeddings (ModelSpec.embedding_widths: ELECTRA's generator, RemBERT, RoFormer) or tensors
of their own (ModelSpec.extra_tensors: RoCBERT, X-MOD, XLM, BigBird), each run with ``is_decoder`` (XLM: ``causal``;
causal self-attention) by ``*ForCausalLM`` / ``BertLMHeadModel`` / ``XLMWithLMHeadModel`` (``encoder_kind`` bert),
and the decoders of the encoder-decoder models BART, mBART, PLBart, Pegasus, Blenderbot, Blenderbot-Small, Marian,
MVP, TrOCR (``_BART_LIKE``), BigBird-Pegasus, Whisper and ProphetNet run alone (seq2seq: their cross-attention
counted, not run).
``ENCODERS`` gives each family's whole spec but name, sequence and vocabulary (as hf_own_keys.OWN_KEYS does),
``position_start`` where its position ids start, ``ENCODER_NOTES`` what an estimate of one says; each checked by the
registry walk (memplan/check/registry.py) against transformers' parameter count of the model on the meta device, and
its traced saved bytes against a real CPU run.

Every BERT-like here: learned absolute positions (and, but BERT-generation, token-type embeddings), LayerNorms with
bias, every linear biased, a plain MLP intermediate_size wide (hidden_act: GeLU), an output head with a bias v wide
(tied to the word embeddings: an untied file is refused) and, but BERT-generation, a transform before it
(a dense h x h, the activation, a LayerNorm).  Post-LN blocks (BERT: a LayerNorm after each residual add, a
LayerNorm on the embeddings, no final norm) or pre-LN ones (Megatron-BERT, XLM-RoBERTa-XL: no embedding norm;
RoBERTa-PreLayerNorm: with one; each a final norm)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from memplan.core.errors import MemplanError
from memplan.core.spec_checks import ExtraTensor
from memplan.core.spec_base import echo
from memplan.presets.hf_families import YAML_HINT, flag, nat

# the RoBERTa copies: position ids start after padding_idx (pad_token_id + 1, RobertaEmbeddings), so the table's
# first pad_token_id + 1 rows are never used
_ROBERTA_LIKE = ("RobertaForCausalLM", "CamembertForCausalLM", "XLMRobertaForCausalLM", "Data2VecTextForCausalLM",
                 "RobertaPreLayerNormForCausalLM", "XLMRobertaXLForCausalLM", "XmodForCausalLM",
                 "ProphetNetForCausalLM")  # ProphetNetPositionalEmbeddings: cumsum of the mask + padding_idx


def position_start(arch: str, data: dict) -> int:
    """The first position id the family uses: pad_token_id + 1 for RoBERTa's copies (default pad 1), else 0."""
    if arch not in _ROBERTA_LIKE:
        return 0
    pad = data.get("pad_token_id", 1)
    return pad + 1 if isinstance(pad, int) and not isinstance(pad, bool) and pad >= 0 else 0


def _bert_like(data: dict, path: Path, *, pre_norm: bool = False, embedding_norm: bool = True,
               token_types: bool = True, transform: bool = True, one_head_bias: bool = False) -> dict[str, Any]:
    """The spec of one BERT-like encoder (the keys BertConfig names; transformers' defaults for missing ones);
    ``one_head_bias``: an untied head keeps one v-wide bias (ELECTRA's generator_lm_head)."""
    arch = (data.get("architectures") or ["?"])[0]
    if flag(data, "add_cross_attention", False, path):
        raise MemplanError(f"{path}: {arch} with add_cross_attention (a cross-attention block per layer for an "
                           f"encoder-decoder pairing): not modelled; {YAML_HINT}")
    if not (one_head_bias or flag(data, "tie_word_embeddings", True, path)):
        raise MemplanError(f"{path}: {arch} with tie_word_embeddings false: transformers then builds the output "
                           "head's own bias beside the LM head's bias (two v-wide biases, one unused): not modelled; "
                           f"{YAML_HINT}")
    if position_start(arch, data) > 8:  # ModelSpec.position_offset's bound
        raise MemplanError(f"{path}: pad_token_id {data.get('pad_token_id')}: {arch} numbers its positions from "
                           f"pad_token_id + 1, and memplan models at most 8 unused rows before them; {YAML_HINT}")
    rows = nat(data, "type_vocab_size", 2, path) if token_types else 0
    if token_types and flag(data, "use_task_id", False, path):  # ERNIE: task_type_embeddings beside token types
        rows += nat(data, "task_type_vocab_size", 3, path)
    return dict(num_layers=nat(data, "num_hidden_layers", 12, path), hidden_size=nat(data, "hidden_size", 768, path),
                num_attention_heads=nat(data, "num_attention_heads", 12, path),
                ffn_hidden_size=nat(data, "intermediate_size", 3072, path), norm="layernorm", mlp="gelu", bias=True,
                position_embedding="learned", position_offset=position_start(arch, data), token_type_rows=rows,
                embedding_norm=embedding_norm, final_norm=pre_norm, head_bias=True, head_transform=transform,
                layer_layout="sequential" if pre_norm else "post-norm", encoder_kind="bert",
                norm_eps=data.get("layer_norm_eps"), tied_embeddings=flag(data, "tie_word_embeddings", True, path))


def _electra(data: dict, path: Path) -> dict[str, Any]:
    """ELECTRA's generator as a causal LM (ElectraForCausalLM): BERT's post-LN layers over embeddings embedding_size
    (e) wide (the word, position and token-type tables and their LayerNorm), embeddings_project e -> h where e != h;
    generator_predictions (a dense h -> e, GeLU, a LayerNorm e wide) and generator_lm_head e -> v with its bias, tied
    to the word embeddings unless tie_word_embeddings is false (ElectraConfig's defaults for missing keys)."""
    data = {"hidden_size": 256, "num_attention_heads": 4, "intermediate_size": 1024, **data}
    h, e = nat(data, "hidden_size", 256, path), nat(data, "embedding_size", 128, path)
    return {**_bert_like(data, path, one_head_bias=True), "embedding_widths": (e, e) if e != h else None}


def _rembert(data: dict, path: Path) -> dict[str, Any]:
    """RemBERT as a causal LM (RemBertForCausalLM): BERT's post-LN layers over embeddings input_embedding_size wide,
    always projected to h (encoder.embedding_hidden_mapping_in); the head a dense h -> output_embedding_size, the
    activation, a LayerNorm, and a decoder to v with its bias, never tied (the class ties none, whatever
    tie_word_embeddings says; RemBertConfig's defaults for missing keys)."""
    data = {"hidden_size": 1152, "num_hidden_layers": 32, "num_attention_heads": 18, "intermediate_size": 4608,
            **data, "tie_word_embeddings": False}
    widths = nat(data, "input_embedding_size", 256, path), nat(data, "output_embedding_size", 1664, path)
    return {**_bert_like(data, path, one_head_bias=True), "embedding_widths": widths}


def _roc_bert(data: dict, path: Path) -> dict[str, Any]:
    """RoCBERT as a causal LM (RoCBertForCausalLM): BERT's, and beside its word embeddings a pronunciation table
    pronunciation_vocab_size x pronunciation_embed_dim and a shape table shape_vocab_size x shape_embed_dim (both
    built whatever enable_pronunciation / enable_shape say); with concat_input, map_inputs_layer, a linear with bias
    from the word embeddings concatenated with the enabled tables' (h + d_p + d_s) to h (RoCBertConfig's defaults
    for missing keys). Without ids for the two tables, the forward looks up their row 0 (concat_input) or not at
    all: what the trace of input_ids alone runs."""
    h = nat(data, "hidden_size", 768, path)
    p_rows, p_dim = nat(data, "pronunciation_vocab_size", 910, path), nat(data, "pronunciation_embed_dim", 768, path)
    s_rows, s_dim = nat(data, "shape_vocab_size", 24858, path), nat(data, "shape_embed_dim", 512, path)
    extra = [ExtraTensor(name="pronunciation embedding", scope="first", rows=p_rows, cols=p_dim),
             ExtraTensor(name="shape embedding", scope="first", rows=s_rows, cols=s_dim)]
    if flag(data, "concat_input", True, path):
        width = h + p_dim * flag(data, "enable_pronunciation", True, path) + s_dim * flag(data, "enable_shape", True,
                                                                                           path)
        extra += [ExtraTensor(name="map_inputs_layer weight", scope="first", rows=h, cols=width),
                  ExtraTensor(name="map_inputs_layer bias", scope="first", rows=h)]
    return {**_bert_like(data, path), "extra_tensors": tuple(extra)}


def _xmod(data: dict, path: Path) -> dict[str, Any]:
    """X-MOD as a causal LM (XmodForCausalLM): RoBERTa's (with pre_norm, pre-LN layers and a final LayerNorm, the
    embedding LayerNorm kept) and in each layer's output one adapter per language of ``languages`` (dense1 h ->
    h // adapter_reduction_factor and dense2 back, each with its bias), all counted, and with adapter_layer_norm a
    LayerNorm before them (XmodConfig's defaults for missing keys). The forward runs each sample through its
    language's adapter (lang_ids; without them, every sample through default_language's)."""
    languages = data.get("languages", ["en_XX"])
    if not isinstance(languages, list) or not languages or not all(isinstance(x, str) for x in languages):
        raise MemplanError(f"{path}: languages: expected a non-empty list of language names (got {echo(languages)})")
    h, r = nat(data, "hidden_size", 768, path), nat(data, "adapter_reduction_factor", 2, path)
    n, width = len(set(languages)), h // r  # adapter_modules: a ModuleDict, one adapter per name
    if not width:
        raise MemplanError(f"{path}: adapter_reduction_factor {r} leaves the adapters no width (h = {h}); {YAML_HINT}")
    extra = [ExtraTensor(name="language adapters' dense1 weight", scope="layer", rows=width, cols=h, count=n),
             ExtraTensor(name="language adapters' dense1 bias", scope="layer", rows=width, count=n),
             ExtraTensor(name="language adapters' dense2 weight", scope="layer", rows=h, cols=width, count=n),
             ExtraTensor(name="language adapters' dense2 bias", scope="layer", rows=h, count=n)]
    if flag(data, "adapter_layer_norm", False, path):
        extra.append(ExtraTensor(name="adapter LayerNorm", scope="layer", rows=h, count=2))
    return {**_bert_like(data, path, pre_norm=flag(data, "pre_norm", False, path)), "extra_tensors": tuple(extra)}


def _xlm(data: dict, path: Path) -> dict[str, Any]:
    """XLM as a causal LM (XLMWithLMHeadModel; causal true for a causal LM's attention): BERT's post-LN layers emb_dim
    (h) wide, n_layers of n_heads, every linear biased, an MLP 4h wide (GeLU, ReLU without gelu_activation); learned
    positions from 0 (with sinusoidal_embeddings the same table, filled and frozen: frozen_position_rows), a
    LayerNorm on the embeddings, no token types, and with n_langs > 1 and use_lang_emb a language table n_langs x h
    (an extra tensor: the forward adds it only given langs); pred_layer.proj v x h with its bias, tied unless
    tie_word_embeddings is false (XLMConfig's defaults for missing keys). The adaptive-softmax head (asm) is refused;
    transformers builds no decoder (is_encoder false)."""
    if flag(data, "asm", False, path) or not flag(data, "is_encoder", True, path):
        raise MemplanError(f"{path}: XLMWithLMHeadModel with asm (an adaptive-softmax head: clusters of the vocabulary, "
                           f"not modelled) or is_encoder false (transformers builds no XLM decoder); {YAML_HINT}")
    h = nat(data, "emb_dim", 2048, path)
    data = {**data, "hidden_size": h, "num_hidden_layers": nat(data, "n_layers", 12, path),
            "num_attention_heads": nat(data, "n_heads", 16, path), "intermediate_size": 4 * h}
    langs = nat(data, "n_langs", 1, path) if flag(data, "use_lang_emb", True, path) else 1
    extra = (ExtraTensor(name="language embedding", scope="first", rows=langs, cols=h),) if langs > 1 else ()
    spec = {**_bert_like(data, path, token_types=False, transform=False, one_head_bias=True), "extra_tensors": extra}
    if flag(data, "sinusoidal_embeddings", False, path):  # create_sinusoidal_embeddings: filled, requires_grad false
        spec.update(position_embedding="rope", frozen_position_rows=nat(data, "max_position_embeddings", 512, path),
                    frozen_position_width="hidden")
    return spec


def _big_bird(data: dict, path: Path) -> dict[str, Any]:
    """BigBird as a causal LM (BigBirdForCausalLM) with attention_type original_full: BERT's post-LN layers, q, k and
    v biased with use_bias only (the attention's output dense and the MLP always), max_position_embeddings rows
    (default 4096) from 0, and a pooler (a dense h x h with its bias, tanh) on the first token after the last layer
    (BigBirdModel builds one; its forward runs it); block_sparse attention (the default) is refused: it pads s to a
    multiple of block_size and switches to full attention for s up to (5 + 2 num_random_blocks) block_size, so its
    trace specialises s."""
    attention = data.get("attention_type", "block_sparse")
    if attention != "original_full":
        raise MemplanError(f"{path}: BigBirdForCausalLM with attention_type {echo(attention)}: block-sparse attention "
                           "pads s to a multiple of block_size and runs full attention up to (5 + 2 num_random_blocks) "
                           "block_size tokens, so its trace specialises s: not modelled (attention_type original_full "
                           f"is read); {YAML_HINT}")
    biased, h = flag(data, "use_bias", True, path), nat(data, "hidden_size", 768, path)
    pooler = (ExtraTensor(name="pooler weight", scope="last", rows=h, cols=h),
              ExtraTensor(name="pooler bias", scope="last", rows=h))
    return {**_bert_like(data, path), "bias": biased, "mlp_bias": not biased, "out_bias": not biased,
            "extra_tensors": pooler}


# BART's decoder and its copies run alone (*ForCausalLM), each as its config class defaults it and its decoder builds
# it: pre-LN layers ending in a final LayerNorm (mBART, Pegasus, Blenderbot) or post-LN ones without (the others); the
# positions learned from row 2 (BartLearnedPositionalEmbedding's offset), learned from row 0 (Blenderbot's, Blenderbot-
# Small's) or sinusoidal, frozen (Pegasus's and Marian's *SinusoidalPositionalEmbedding: an nn.Embedding with _freeze,
# max_position_embeddings x d_model, requires_grad false); an embedding LayerNorm (layernorm_embedding) or not; the
# defaults of decoder_layers, d_model, decoder_attention_heads, decoder_ffn_dim for a missing key. scale_embedding
# multiplies the embeddings by sqrt(d_model) (no parameter: in the trace); final_logits_bias is a buffer of
# *ForConditionalGeneration only, which *ForCausalLM does not build.
_BART_LIKE: dict[str, dict[str, Any]] = {
    "BartForCausalLM": dict(pre_norm=False, positions="learned", offset=2, embedding_norm=True),
    "MvpForCausalLM": dict(pre_norm=False, positions="learned", offset=2, embedding_norm=True),
    "TrOCRForCausalLM": dict(pre_norm=False, positions="learned", offset=2, embedding_norm=True, keyed=True),
    "PLBartForCausalLM": dict(pre_norm=False, positions="learned", offset=2, embedding_norm=True,
                              defaults=(6, 768, 12, 3072)),
    "MBartForCausalLM": dict(pre_norm=True, positions="learned", offset=2, embedding_norm=True),
    "PegasusForCausalLM": dict(pre_norm=True, positions="frozen", offset=0, embedding_norm=False),
    "BlenderbotForCausalLM": dict(pre_norm=True, positions="learned", offset=0, embedding_norm=False,
                                  defaults=(24, 2560, 32, 10240)),
    "BlenderbotSmallForCausalLM": dict(pre_norm=False, positions="learned", offset=0, embedding_norm=True,
                                       defaults=(8, 512, 16, 2048)),
    "MarianForCausalLM": dict(pre_norm=False, positions="frozen", offset=0, embedding_norm=False),
}


def _bart_decoder(data: dict, path: Path) -> dict[str, Any]:
    """The decoder of a BART-like encoder-decoder model run alone (``_BART_LIKE``): layers of self-attention,
    cross-attention and a GeLU MLP decoder_ffn_dim wide, every linear biased, three LayerNorms a layer; the head tied
    (unless tie_word_embeddings is false), without bias.  TrOCR's keys choose its positions
    (use_learned_position_embeddings: false, sinusoidal ones in a buffer, no parameters) and its embedding norm
    (layernorm_embedding); Marian's decoder_vocab_size other than vocab_size is refused (its decoder's embeddings
    and its head would differ in rows)."""
    arch = (data.get("architectures") or ["?"])[0]
    kind = _BART_LIKE[arch]
    layers, h, heads, ffn = kind.get("defaults", (12, 1024, 16, 4096))
    h = nat(data, "d_model", h, path)
    keyed = kind.get("keyed", False)  # TrOCR's two switches, read for TrOCR only
    learned = kind["positions"] == "learned" and (not keyed or flag(data, "use_learned_position_embeddings", True,
                                                                     path))
    if flag(data, "use_prompt", False, path) or data.get("cross_attention_hidden_size") not in (None, h):
        raise MemplanError(f"{path}: {arch} with use_prompt (MVP's prompt encoders) or cross_attention_hidden_size "
                           f"other than d_model: not modelled; {YAML_HINT}")
    if data.get("decoder_vocab_size") not in (None, data.get("vocab_size")):
        raise MemplanError(f"{path}: {arch} with decoder_vocab_size {echo(data['decoder_vocab_size'])} other than "
                           f"vocab_size {echo(data.get('vocab_size'))}: not modelled; {YAML_HINT}")
    frozen = (dict(frozen_position_rows=nat(data, "max_position_embeddings", 1024, path),
                   frozen_position_width="hidden") if kind["positions"] == "frozen" else {})
    return dict(num_layers=nat(data, "decoder_layers", layers, path), hidden_size=h,
                num_attention_heads=nat(data, "decoder_attention_heads", heads, path),
                ffn_hidden_size=nat(data, "decoder_ffn_dim", ffn, path), norm="layernorm", mlp="gelu", bias=True,
                position_embedding="learned" if learned else "rope", position_offset=kind["offset"] if learned else 0,
                **frozen,
                embedding_norm=flag(data, "layernorm_embedding", True, path) if keyed else kind["embedding_norm"],
                final_norm=kind["pre_norm"], norms_per_layer=3,
                layer_layout="sequential" if kind["pre_norm"] else "post-norm", encoder_kind="seq2seq",
                tied_embeddings=flag(data, "tie_word_embeddings", True, path))


def _prophetnet_decoder(data: dict, path: Path) -> dict[str, Any]:
    """ProphetNet's decoder run alone (ProphetNetForCausalLM): post-LN layers (three LayerNorms) of n-gram
    self-attention (q / k / v / out_proj biased, and relative_pos_embeddings, a linear h -> num_buckets x a with its
    bias: extra tensors of each layer), cross-attention (counted, not run) and a GeLU MLP decoder_ffn_dim wide, all
    biased; max_position_embeddings learned rows numbered from pad_token_id + 1, the ngram embeddings (ngram x h, an
    extra tensor) and a LayerNorm on the embeddings, no final norm; lm_head tied unless tie_word_embeddings is false
    (then the wrapper's word_embeddings is a third table: an extra tensor; ProphetNetConfig's defaults for missing
    keys). The forward predicts ngram streams beside the main one (traced)."""
    if not flag(data, "add_cross_attention", True, path):
        raise MemplanError(f"{path}: ProphetNetForCausalLM with add_cross_attention false (decoder layers without "
                           f"cross-attention): not modelled; {YAML_HINT}")
    h, a = nat(data, "hidden_size", 1024, path), nat(data, "num_decoder_attention_heads", 16, path)
    relative = nat(data, "num_buckets", 32, path) * a
    extra = (ExtraTensor(name="ngram embeddings", scope="first", rows=nat(data, "ngram", 2, path), cols=h),
             ExtraTensor(name="relative_pos_embeddings weight", scope="layer", rows=relative, cols=h),
             ExtraTensor(name="relative_pos_embeddings bias", scope="layer", rows=relative))
    tied = flag(data, "tie_word_embeddings", True, path)
    if not tied:  # the wrapper's word_embeddings and the decoder's are then two tables (the decoder's used)
        extra += (ExtraTensor(name="the wrapper's word embeddings (untied)", scope="first",
                              rows=nat(data, "vocab_size", 30522, path), cols=h),)
    return dict(num_layers=nat(data, "num_decoder_layers", 12, path), hidden_size=h, num_attention_heads=a,
                ffn_hidden_size=nat(data, "decoder_ffn_dim", 4096, path), norm="layernorm", mlp="gelu", bias=True,
                position_embedding="learned", position_offset=position_start("ProphetNetForCausalLM", data),
                embedding_norm=True, final_norm=False, norms_per_layer=3, layer_layout="post-norm",
                encoder_kind="seq2seq", tied_embeddings=tied, extra_tensors=extra)


def _bigbird_pegasus_decoder(data: dict, path: Path) -> dict[str, Any]:
    """BigBird-Pegasus's decoder run alone (BigBirdPegasusForCausalLM): pre-LN layers (three LayerNorms) of full
    self-attention and cross-attention, biased with use_bias only, and a GeLU MLP decoder_ffn_dim wide, always biased;
    max_position_embeddings learned rows (no offset); the final norm (its layernorm_embedding, applied after the
    layers); an lm_head of its own whatever tie_word_embeddings says (the class ties none)."""
    biased = flag(data, "use_bias", False, path)
    return dict(num_layers=nat(data, "decoder_layers", 16, path), hidden_size=nat(data, "d_model", 1024, path),
                num_attention_heads=nat(data, "decoder_attention_heads", 16, path),
                ffn_hidden_size=nat(data, "decoder_ffn_dim", 4096, path), norm="layernorm", mlp="gelu", bias=biased,
                mlp_bias=not biased, position_embedding="learned", norms_per_layer=3, encoder_kind="seq2seq",
                tied_embeddings=False)


def _roformer(data: dict, path: Path) -> dict[str, Any]:
    """RoFormer as a causal LM (RoFormerForCausalLM): BERT's post-LN layers with rotary positions, over word and
    token-type embeddings embedding_size (e, default h) wide and their LayerNorm, embeddings_project e -> h where
    e != h; the rotary table a frozen parameter max_position_embeddings x h / a (encoder.embed_positions); the head's
    transform h -> e (dense, activation, LayerNorm) and the decoder e -> v, tied, with its bias (an untied file is
    refused: two v-wide biases then, as BERT's)."""
    h = nat(data, "hidden_size", 768, path)
    e = nat(data, "embedding_size", h, path) if data.get("embedding_size") is not None else h
    return {**_bert_like(data, path), "position_embedding": "rope", "position_offset": 0,
            "frozen_position_rows": nat(data, "max_position_embeddings", 1536, path),
            "embedding_widths": (e, e) if e != h else None}


def _whisper_decoder(data: dict, path: Path) -> dict[str, Any]:
    """Whisper's decoder run alone (WhisperForCausalLM): pre-LN layers (three LayerNorms) of self-attention and
    cross-attention, q_proj, v_proj and out_proj biased but not k_proj (key_bias false), and a GeLU MLP
    decoder_ffn_dim wide with biases; max_target_positions learned positions; a final LayerNorm; proj_out without
    bias, tied unless tie_word_embeddings is false (WhisperConfig's defaults for missing keys)."""
    return dict(num_layers=nat(data, "decoder_layers", 4, path), hidden_size=nat(data, "d_model", 384, path),
                num_attention_heads=nat(data, "decoder_attention_heads", 6, path),
                ffn_hidden_size=nat(data, "decoder_ffn_dim", 1536, path), norm="layernorm", mlp="gelu", bias=True,
                key_bias=False, position_embedding="learned", norms_per_layer=3, encoder_kind="seq2seq",
                tied_embeddings=flag(data, "tie_word_embeddings", True, path))


ENCODERS: dict[str, Callable[[dict, Path], dict[str, Any]]] = {
    **{arch: _bert_like for arch in ("BertLMHeadModel", "RobertaForCausalLM", "CamembertForCausalLM",
                                     "XLMRobertaForCausalLM", "Data2VecTextForCausalLM", "ErnieForCausalLM")},
    "ElectraForCausalLM": _electra,
    "RemBertForCausalLM": _rembert,
    "RoFormerForCausalLM": _roformer,
    "RoCBertForCausalLM": _roc_bert,
    "XmodForCausalLM": _xmod,
    "XLMWithLMHeadModel": _xlm,
    "BigBirdForCausalLM": _big_bird,
    "BertGenerationDecoder": lambda data, path: _bert_like(data, path, token_types=False, transform=False),
    "MegatronBertForCausalLM": lambda data, path: _bert_like(data, path, pre_norm=True, embedding_norm=False),
    "RobertaPreLayerNormForCausalLM": lambda data, path: _bert_like(data, path, pre_norm=True),
    "XLMRobertaXLForCausalLM": lambda data, path: _bert_like(data, path, pre_norm=True, embedding_norm=False),
    **{arch: _bart_decoder for arch in _BART_LIKE},
    "BigBirdPegasusForCausalLM": _bigbird_pegasus_decoder,
    "ProphetNetForCausalLM": _prophetnet_decoder,
    "WhisperForCausalLM": _whisper_decoder,
}

# the families transformers builds as causal LMs beside the encoders that memplan does not read, and why (their
# refusal says it; memplan/check/registry.py EXCLUDED lists them)
NOT_READ = {
    "GitForCausalLM": "GIT: its loss drops the first image_patch_tokens logits (197 at the defaults) as image "
                      "positions, so a text-only step with labels fails (s - 197 logits against s - 1 labels), and a "
                      "step with images runs its CLIP image encoder, which memplan does not model",
}

# the position limit's key and default of each (the config classes' defaults)
POSITIONS = {**{arch: ("max_position_embeddings", 512) for arch in ENCODERS},
             "RoFormerForCausalLM": ("max_position_embeddings", 1536),
             **{arch: ("max_position_embeddings", 1024) for arch in _BART_LIKE},
             "BlenderbotForCausalLM": ("max_position_embeddings", 128),
             "BlenderbotSmallForCausalLM": ("max_position_embeddings", 512),
             "TrOCRForCausalLM": ("max_position_embeddings", 512),
             "BigBirdPegasusForCausalLM": ("max_position_embeddings", 4096),
             "BigBirdForCausalLM": ("max_position_embeddings", 4096),
             "WhisperForCausalLM": ("max_target_positions", 448)}

# what an estimate of each says beside its figures
_BERT_NOTE = ("a BERT-like encoder trained as a causal LM ({arch} with is_decoder): its parameters are counted "
              "exactly (the token-type embeddings, the LM head's transform and bias included); only --impl hf-sdpa / "
              "hf-eager estimates its activations (traced from transformers' code); Megatron-LM's BERT is another "
              "model (--impl megatron* and --emit megatron refuse it)")
_SEQ2SEQ_NOTE = ("the decoder of an encoder-decoder model trained alone as a causal LM ({arch}): the encoder is left "
                 "out; each layer's cross-attention (encoder_attn and its LayerNorm) is counted in the weights, not in the "
                 "activations, gradients or optimizer states (transformers' forward without encoder states skips it: "
                 "measured, no .grad; validation/untrained.py); only --impl hf-sdpa / hf-eager estimates "
                 "its activations (traced); Megatron-LM's T5 is another model (--impl megatron* and --emit megatron "
                 "refuse it)")
_SEQ2SEQ = (*_BART_LIKE, "BigBirdPegasusForCausalLM", "WhisperForCausalLM", "ProphetNetForCausalLM")
ENCODER_NOTES = {arch: (_SEQ2SEQ_NOTE if arch in _SEQ2SEQ else _BERT_NOTE).format(arch=arch) for arch in ENCODERS}
ENCODER_NOTES["RoCBertForCausalLM"] += ("; its pronunciation and shape tables and map_inputs_layer are counted (extra "
                                        "tensors); the trace passes input_ids alone, so the forward looks up row 0 of "
                                        "each table (what transformers does without pronunciation / shape ids)")
ENCODER_NOTES["XmodForCausalLM"] += ("; its per-language adapters (one per name of languages, in every layer) are "
                                     "counted, and the trace runs every sample through one (default_language's, or "
                                     "the first language's where the config names none, as set_default_language "
                                     "must before transformers runs it); a mix of languages saves the same bytes "
                                     "(derived: each sample goes through one adapter of the same widths)")
ENCODER_NOTES["XLMWithLMHeadModel"] += ("; its language embeddings (n_langs > 1) are counted, and added by the "
                                        "forward only given langs (the trace passes none); with sinusoidal_embeddings "
                                        "its position table, filled and frozen (requires_grad false), is counted with "
                                        "the parameters and the weights, with no gradient or optimizer state (as "
                                        "Pegasus's: validation/untrained.py)")
ENCODER_NOTES["ProphetNetForCausalLM"] += ("; its ngram predicting streams (beside the main stream) are traced, fitted at "
                                           "concrete s (its relative position buckets are computed for "
                                           "max_position_embeddings and sliced to s); the ngram embeddings and each "
                                           "layer's relative_pos_embeddings are counted (extra tensors)")
ENCODER_NOTES["BigBirdForCausalLM"] += ("; full attention (attention_type original_full); its pooler (a dense h x h "
                                        "with its bias and tanh on the first token, which BigBirdModel runs) is "
                                        "counted and traced")
ENCODER_NOTES["RoFormerForCausalLM"] += ("; its frozen rotary table (encoder.embed_positions, max_position_embeddings "
                                         "x h / a, requires_grad false) is counted with the parameters and the "
                                         "weights, with no gradient or optimizer state (measured: "
                                         "validation/untrained.py)")
for _arch in ("PegasusForCausalLM", "MarianForCausalLM"):
    ENCODER_NOTES[_arch] += ("; its sinusoidal positions (decoder.embed_positions, an nn.Embedding of "
                             "max_position_embeddings x d_model built frozen, requires_grad false) are counted with "
                             "the parameters, as transformers counts them, and the weights, with no gradient or "
                             "optimizer state (measured: validation/untrained.py)")


def is_decoder_note(arch: str, data: dict) -> tuple[str, ...]:
    """A note when the file does not set is_decoder (XLM: causal): transformers then runs the encoder's bidirectional
    attention."""
    key = "causal" if arch == "XLMWithLMHeadModel" else "is_decoder"
    if arch in ENCODERS and arch not in _SEQ2SEQ and data.get(key) is not True:
        return (f"{key} is not true in this config.json: transformers' {arch} then attends bidirectionally (an "
                f"encoder's attention); a causal-LM run sets {key} true",)
    return ()
