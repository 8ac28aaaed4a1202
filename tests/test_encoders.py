"""Issue 22: the BERT-like encoders transformers builds as causal LMs (ELECTRA's and RemBERT's factorised embeddings
among them; RoCBERT's, X-MOD's, XLM's, BigBird's and ProphetNet's own tensors as ModelSpec.extra_tensors; GPT-NeoX-Japanese,
ModernBERT's decoder and CPM-Ant, decoder-only LMs with their own tensors too), and the decoders of MVP, TrOCR and BigBird-Pegasus
(encoder-decoder models) run alone (memplan/presets/hf_encoders.py).

Each family's parameters equal transformers' count of the model built on the meta device, for the registry walk's
tiny configs (tests/test_registry.py) and here for the config classes' full-size defaults and the switches the
reader reads; what it does not count is refused in one line; `--impl megatron*` and `--emit megatron` refuse the
families (Megatron-LM's BERT and T5 are other models); a traced sample equals a real CPU run's saved bytes."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("transformers")

from memplan.check import registry  # noqa: E402
from memplan.core.errors import MemplanError  # noqa: E402
from memplan.launch.megatron import launch_refusal  # noqa: E402
from memplan.presets.hf_config import read_hf_config  # noqa: E402
from validation import hf as _hf  # noqa: E402
from memplan.check.validate import measured_buckets  # noqa: E402
from memplan.inventory.traced_file import TracedFile, bucket_bytes  # noqa: E402
from validation.registry import architectures, measure, meta_params, tiny_config, trace  # noqa: E402

BERT_LIKES = ["bert", "bert-generation", "roberta", "roberta-prelayernorm", "xlm-roberta", "xlm-roberta-xl",
              "camembert", "ernie", "data2vec-text", "megatron-bert"]


def _defaults(model_type: str) -> dict:
    """The config class's own full-size defaults as a config.json (not shrunk)."""
    data = json.loads(json.dumps(_hf._transformers().CONFIG_MAPPING[model_type]().to_dict(), default=str))
    return {**data, "architectures": [architectures()[model_type]], "model_type": model_type}


@pytest.mark.parametrize("model_type", ["bert-generation", "roberta", "roberta-prelayernorm", "xlm-roberta-xl",
                                        "megatron-bert", "ernie", "mvp", "trocr", "bigbird_pegasus",
                                        "rembert", "roformer", "whisper"])  # bert, electra, whisper: below
def test_the_full_size_defaults_count_exactly(model_type):
    assert registry.memplan_params(_defaults(model_type)) == meta_params(_defaults(model_type))


def test_bert_base_in_its_lm_head_form():
    """BertConfig's defaults are bert-base: by hand, the embeddings 30522 x 768 + 512 x 768 + 2 x 768 + a LayerNorm
    2 x 768 = 23,837,184; a layer 4 (768^2 + 768) + 2 x 768 x 3072 + 3072 + 768 + two LayerNorms 4 x 768 = 7,087,872,
    twelve of them 85,054,464; the head's transform 768^2 + 768 + 2 x 768 = 592,128 and its bias 30,522 (the
    decoder's weight tied): 109,514,298 (no pooler: BertLMHeadModel builds BertModel without one)."""
    assert registry.memplan_params(_defaults("bert")) == 109_514_298 == meta_params(_defaults("bert"))


def test_electra_generator_defaults_by_hand():
    """ElectraConfig's defaults (v 30522, e = embedding_size 128, h 256, 12 layers of 4 heads, f 1024, 512 positions,
    2 token types), ElectraForCausalLM by hand: the embeddings e wide 30522 x 128 + 512 x 128 + 2 x 128 + their
    LayerNorm 2 x 128 = 3,972,864; embeddings_project 128 x 256 + 256 = 33,024; a layer 4 (256^2 + 256) + 256 x 1024
    + 1024 + 1024 x 256 + 256 + two LayerNorms 4 x 256 = 789,760, twelve of them 9,477,120; generator_predictions
    256 x 128 + 128 + a LayerNorm 2 x 128 = 33,152; generator_lm_head's bias 30,522 (its weight tied): 13,546,682."""
    assert registry.memplan_params(_defaults("electra")) == 13_546_682 == meta_params(_defaults("electra"))


def test_whisper_tiny_decoder_by_hand():
    """WhisperConfig's defaults are whisper-tiny's decoder (v 51865, d 384, 448 positions, 4 layers, f 1536): the
    embeddings 51865 x 384 + 448 x 384 = 20,088,192; a layer's self- and cross-attention 4 x 384^2 each with the
    biases of q, v and out (3 x 384; k_proj has none): 2 x 590,976, its MLP 2 x 384 x 1536 + 1536 + 384 = 1,181,568
    and three LayerNorms 6 x 384: 2,365,824, four of them 9,463,296; the final LayerNorm 768; proj_out tied:
    29,552,256."""
    assert registry.memplan_params(_defaults("whisper")) == 29_552_256 == meta_params(_defaults("whisper"))


def test_extra_tensors_are_checked_in_one_line(tmp_path):
    """ModelSpec.extra_tensors (memplan/core/spec_checks.py ExtraTensor): a name given twice, a scope memplan does not place or
    a size that is not a positive integer is refused in one line."""
    from memplan.core.model import ModelSpec
    from memplan.core.spec_base import build

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=512)
    table = {"name": "language embedding", "scope": "first", "rows": 3, "cols": 64}
    model = build(ModelSpec, {**base, "extra_tensors": (table,)})
    assert model.extra_tensors[0].numel == 192
    for bad, says in [((table, table), "given twice"), (({**table, "scope": "moe"},), "scope"),
                      (({**table, "rows": 0},), "rows")]:
        with pytest.raises(MemplanError, match=says) as err:
            build(ModelSpec, {**base, "extra_tensors": bad})
        assert "\n" not in str(err.value)


def test_roc_bert_defaults_by_hand():
    """RoCBertConfig's defaults are bert-base's (109,514,298 in BertLMHeadModel's form, above) and beside the word
    embeddings a pronunciation table 910 x 768 = 698,880, a shape table 24858 x 512 = 12,727,296 and, with
    concat_input, map_inputs_layer from the three concatenated (768 + 768 + 512 = 2048) to 768 with its bias:
    1,572,864 + 768 = 1,573,632; in all 124,514,106."""
    assert registry.memplan_params(_defaults("roc_bert")) == 124_514_106 == meta_params(_defaults("roc_bert"))


def test_xmod_defaults_by_hand():
    """XmodConfig's defaults are bert-base's widths with RoBERTa's embeddings (512 position rows, numbered from
    pad_token_id + 1): 109,514,298 in BertLMHeadModel's form (above), and in each of the 12 layers one language's
    adapter (languages ("en_XX",)), dense1 768 -> 768 // 2 = 384 and dense2 back, with their biases: 384 x 768 + 384
    + 768 x 384 + 768 = 590,976, twelve of them 7,091,712; in all 116,606,010."""
    assert registry.memplan_params(_defaults("xmod")) == 116_606_010 == meta_params(_defaults("xmod"))


def test_xlm_defaults_by_hand():
    """XLMConfig's defaults (v 30145, h = emb_dim 2048, 12 layers, an MLP 4 h = 8192 wide, 512 positions, one
    language: no language table): the embeddings 30145 x 2048 + 512 x 2048 + a LayerNorm 2 x 2048 = 62,789,632; a
    layer 4 (2048^2 + 2048) + 2048 x 8192 + 8192 + 8192 x 2048 + 2048 + two LayerNorms 4 x 2048 = 50,358,272, twelve
    of them 604,299,264; pred_layer.proj's bias 30,145 (its weight tied): 667,119,041."""
    assert registry.memplan_params(_defaults("xlm")) == 667_119_041 == meta_params(_defaults("xlm"))


def test_xlm_sinusoidal_positions_are_a_frozen_table(tmp_path):
    """With sinusoidal_embeddings, XLM fills its position table and sets requires_grad false
    (create_sinusoidal_embeddings): the same count (transformers counts it), a table without gradient or optimizer
    state (frozen_position_rows, h wide, as Pegasus's)."""
    from memplan.memory.states import param_groups

    config = {**tiny_config("xlm"), "sinusoidal_embeddings": True}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    groups = {g.name: g for g in param_groups(read_hf_config(str(path)).model)}
    assert not groups["frozen position table"].trained and "position embedding" not in groups
    assert registry.memplan_params(config) == meta_params(config) == meta_params(tiny_config("xlm"))


def test_xlm_traced_with_its_lengths_bounded_equals_a_real_cpu_run():
    """XLM asserts lengths.max().item() <= s, a value fake tensors do not hold; the trace tells the ShapeEnv that
    0 <= lengths <= s (validation/trace_saves.py _xlm_lengths) and runs transformers' own code: causal, with three
    languages (their table built, not added without langs), its bytes equal a real CPU run's at two (s, b)."""
    config = {**tiny_config("xlm"), "causal": True, "n_langs": 3}  # emb_dim 64 (validation/registry.py _SMALL)
    traced = TracedFile.model_validate(trace(config))
    for s, b in ((32, 2), (48, 3)):
        assert bucket_bytes(traced, s, b) == measured_buckets(measure(config, s, b))


def test_prophetnet_decoder_defaults_by_hand():
    """ProphetNetConfig's defaults, its decoder alone (v 30522, h 1024, 12 layers of 16 heads, f 4096, 512 positions,
    ngram 2, 32 buckets): the embeddings 30522 x 1024 + 512 x 1024 + the ngram table 2 x 1024 + a LayerNorm 2 x 1024
    = 31,782,912; a layer's n-gram self-attention 4 (1024^2 + 1024) = 4,198,400 with relative_pos_embeddings
    1024 x (32 x 16) + 512 = 524,800, its cross-attention 4,198,400, its MLP 1024 x 4096 + 4096 + 4096 x 1024 + 1024 =
    8,393,728 and three LayerNorms 6,144: 17,321,472, twelve of them 207,857,664; lm_head tied: 239,640,576."""
    assert registry.memplan_params(_defaults("prophetnet")) == 239_640_576 == meta_params(_defaults("prophetnet"))


@pytest.mark.skipif(not os.environ.get("MEMPLAN_ENCODERS_SLOW"), reason="~6 s of CPU: MEMPLAN_ENCODERS_SLOW=1 (the registry walk traces it too)")
def test_prophetnet_fitted_trace_equals_a_real_cpu_run():
    """ProphetNet's decoder computes its relative position buckets for max_position_embeddings and slices them to s
    (s pinned): its saves, the ngram streams' among them, are traced at concrete (s, b) and fitted (validation/
    trace_fit.py SLICED); equal to a real CPU run's bytes, layer by layer, off the fit's points."""
    config = tiny_config("prophetnet")
    traced = TracedFile.model_validate(trace(config))
    assert any(c.startswith("fitted") for c in traced.conditions)
    for s, b in ((40, 2), (56, 3)):
        assert bucket_bytes(traced, s, b) == measured_buckets(measure(config, s, b))


def test_big_bird_with_full_attention_by_hand():
    """BigBirdConfig's defaults with attention_type original_full (v 50358, h 768, 12 layers, f 3072, 4096 positions,
    2 token types): the embeddings 50358 x 768 + 4096 x 768 + 2 x 768 + a LayerNorm 2 x 768 = 41,823,744; twelve
    BERT layers 12 x 7,087,872 = 85,054,464; the head's transform 768^2 + 768 + 2 x 768 = 592,128 and its bias 50,358;
    the pooler 768^2 + 768 = 590,592: 128,111,286."""
    config = {**_defaults("big_bird"), "attention_type": "original_full"}
    assert registry.memplan_params(config) == 128_111_286 == meta_params(config)


def test_gpt_neox_japanese_defaults_by_hand(run_cli, tmp_path):
    """GPTNeoXJapaneseConfig's defaults (v 32000, h 2560, 32 layers, f = 4 h = 10240, tied): embed_in 32000 x 2560 =
    81,920,000; a layer's query_key_value 3 x 2560^2, dense 2560^2 and MLP 2 x 2560 x 10240, none biased, and two
    LayerNorms 4 x 2560: 78,653,440, 32 of them 2,516,910,080; the final LayerNorm 5,120 and the last layer's
    dense_bias 2,560: 2,598,837,760. A decoder-only LM, but Megatron-LM builds no dense_bias: --emit megatron refuses
    it in one line."""
    assert registry.memplan_params(_defaults("gpt_neox_japanese")) == 2_598_837_760 == \
        meta_params(_defaults("gpt_neox_japanese"))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_config("gpt_neox_japanese")))
    code, out, err = run_cli("estimate", "--hf-config", str(path), "--seq-len", "32", "--emit", "megatron")
    assert code == 2 and "dense_bias" in err and len(err.strip().splitlines()) == 1


def test_modernbert_decoder_defaults_by_hand():
    """ModernBertDecoderConfig's defaults (v 50368, h 768, 22 layers, f 1152, LayerNorms without bias, no linear
    biased but the decoder's): tok_embeddings 50368 x 768 and their norm 768 = 38,683,392; a layer's q / k / v / Wo
    4 x 768^2, Wi 768 x 2 x 1152, Wo 1152 x 768 and mlp_norm 768: 5,014,272, 22 of them 110,313,984; attn_norm in the
    21 layers after the first 16,128; the final norm 768; lm_head's dense 768^2 and norm 768: 590,592; the decoder's
    bias 50,368 (its weight tied): 149,655,232."""
    assert registry.memplan_params(_defaults("modernbert-decoder")) == 149_655_232 == \
        meta_params(_defaults("modernbert-decoder"))


@pytest.mark.skipif(not os.environ.get("MEMPLAN_ENCODERS_SLOW"), reason="~3 s of CPU: MEMPLAN_ENCODERS_SLOW=1 (the registry walk traces it too)")
def test_modernbert_decoder_traced_equals_a_real_cpu_run():
    """Its trace (built under fake tensors without initialising: trunc_normal_ reads values; validation/
    trace_config.py build_model) with biased LayerNorms and lm_head's dense bias equals a real CPU run's bytes, layer by
    layer (the first without attn_norm), below and above the 16-token sliding window of the shrunk config."""
    config = {**tiny_config("modernbert-decoder"), "norm_bias": True, "classifier_bias": True}
    traced = TracedFile.model_validate(trace(config))
    assert registry.memplan_params(config) == meta_params(config)
    for s, b in ((32, 2), (96, 3)):
        assert bucket_bytes(traced, s, b) == measured_buckets(measure(config, s, b))


def test_cpmant_defaults_by_hand():
    """CpmAntConfig's defaults (v 30720, h 4096, 32 heads of dim_head 128, dim_ff 10240, 48 layers, 32 x 32 prompt
    rows, 32 segment types, 512 buckets): input_embedding (30720 + 1024) x 4096 = 130,023,424, segment_embedding
    32 x 4096 = 131,072, the relative position bias (32^2 + 512) x 32 = 49,152; a layer's q / k / v / attention_out
    4 x 4096 x 4096, its gated MLP 3 x 4096 x 10240 and two norms 2 x 4096: 192,946,176, 48 of them 9,261,416,448;
    the final norm 4,096 and lm_head 30720 x 4096 = 125,829,120 (never tied): 9,517,453,312."""
    assert registry.memplan_params(_defaults("cpmant")) == 9_517_453_312 == meta_params(_defaults("cpmant"))


@pytest.mark.skipif(not os.environ.get("MEMPLAN_ENCODERS_SLOW"), reason="~3 s of CPU: MEMPLAN_ENCODERS_SLOW=1 (the registry walk traces it too)")
def test_cpmant_fitted_trace_equals_a_real_cpu_run():
    """CPM-Ant's left-padding mask is a Python list s long (s pinned): its saves are traced at concrete (s, b) and
    fitted (validation/trace_fit.py SLICED); equal to a real CPU run's bytes, layer by layer, at (s, b) off the fit's
    points."""
    config = tiny_config("cpmant")
    traced = TracedFile.model_validate(trace(config))
    assert any(c.startswith("fitted") for c in traced.conditions)
    for s, b in ((40, 2), (56, 3)):
        assert bucket_bytes(traced, s, b) == measured_buckets(measure(config, s, b))


@pytest.mark.parametrize("model_type, switches", [
    ("prophetnet", dict(tie_word_embeddings=False)),  # lm_head and the wrapper's word_embeddings: two more tables
    ("prophetnet", dict(ngram=3, num_buckets=16)),
    ("cpmant", dict(segment_types=4, prompt_types=2, position_bias_num_buckets=16)),
    ("cpmant", dict(dim_head=32)),  # heads dim_head wide, not h / a
    ("xlm", dict(n_langs=3)),  # the language table, 3 x h
    ("xlm", dict(tie_word_embeddings=False)),  # pred_layer.proj's own weight, beside its bias
    ("xlm", dict(gelu_activation=False, max_position_embeddings=64)),
    ("modernbert-decoder", dict(norm_bias=True)),  # every LayerNorm's bias, the head's too
    ("modernbert-decoder", dict(attention_bias=True, mlp_bias=True)),
    ("modernbert-decoder", dict(classifier_bias=True, decoder_bias=False)),  # lm_head.dense's bias, no decoder bias
    ("modernbert-decoder", dict(tie_word_embeddings=False)),
    ("gpt_neox_japanese", dict(tie_word_embeddings=False)),  # embed_out v x h of its own
    ("gpt_neox_japanese", dict(intermediate_multiple_size=2)),  # the MLP 2 h wide
    ("big_bird", dict(use_bias=False)),  # q, k, v without bias; the attention's output dense and the MLP keep theirs
    ("xmod", dict(languages=["en_XX", "de_DE", "fr_XX"], adapter_reduction_factor=4)),  # 3 adapters h / 4 wide
    ("xmod", dict(adapter_layer_norm=True)),  # a LayerNorm before the adapters
    ("xmod", dict(pre_norm=True)),  # pre-LN layers: the encoder's final LayerNorm
    ("xmod", dict(max_position_embeddings=514)),
    ("roc_bert", dict(concat_input=False)),  # no map_inputs_layer; the two tables still built
    ("roc_bert", dict(enable_shape=False)),  # map_inputs_layer without the shape table's width (the table built)
    ("roc_bert", dict(enable_pronunciation=False, shape_embed_dim=32)),
    ("ernie", dict(use_task_id=True)),  # task_type_embeddings, task_type_vocab_size x h, beside the token types
    ("bert", dict(type_vocab_size=4)),
    ("xlm-roberta-xl", dict(max_position_embeddings=514)),  # RoBERTa's table: ids from pad_token_id + 1
    ("trocr", dict(use_learned_position_embeddings=False)),  # sinusoidal positions: a plain tensor, no parameter
    ("trocr", dict(layernorm_embedding=False)),
    ("mvp", dict(tie_word_embeddings=False)),  # lm_head v x h without bias
    ("mvp", dict(decoder_ffn_dim=96, decoder_layers=3)),  # the decoder's keys, not the encoder's
    ("bigbird_pegasus", dict(use_bias=True)),  # biases on the self- and cross-attention too
    ("electra", dict(tie_word_embeddings=False)),  # generator_lm_head's own e x v weight (one bias still)
    ("electra", dict(embedding_size=64)),  # e = h: no embeddings_project
    ("rembert", dict(input_embedding_size=64)),  # e = h: embedding_hidden_mapping_in is built all the same
    ("rembert", dict(tie_word_embeddings=True, output_embedding_size=256)),  # e_out = e: still untied
    ("roformer", dict(embedding_size=None)),  # e = h: no embeddings_project
    ("roformer", dict(max_position_embeddings=64)),  # the frozen rotary table, 64 x h / a
    ("whisper", dict(tie_word_embeddings=False)),  # proj_out v x d without bias
    ("whisper", dict(decoder_ffn_dim=96, decoder_layers=3)),  # the decoder's keys, not the encoder's
])
def test_the_switches_count_exactly(model_type, switches):
    config = {**tiny_config(model_type), **switches}
    assert registry.memplan_params(config) == meta_params(config) != meta_params(tiny_config(model_type))


def test_robertas_sequence_is_its_table_less_the_rows_before_padding(tmp_path):
    """RobertaEmbeddings numbers positions from padding_idx + 1 (pad_token_id 1: from 2), so a Hub file's 514 rows
    hold 512 positions: the default s is 512, and the 514 rows are counted."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**tiny_config("roberta"), "max_position_embeddings": 514, "pad_token_id": 1}))
    preset = read_hf_config(str(path))
    assert preset.model.seq_length == 512
    assert registry.memplan_params(json.loads(path.read_text())) == meta_params(json.loads(path.read_text()))


@pytest.mark.parametrize("model_type, switches, says", [
    ("bert", dict(tie_word_embeddings=False), "tie_word_embeddings"),  # two v-wide biases then, one unused
    ("roformer", dict(tie_word_embeddings=False), "tie_word_embeddings"),  # decoder.bias and predictions.bias
    ("roberta", dict(add_cross_attention=True), "add_cross_attention"),
    ("roberta", dict(pad_token_id=10), "pad_token_id"),  # positions from row 11: past position_offset's 8
    ("mvp", dict(use_prompt=True), "use_prompt"),  # MVP's prompt encoders
    ("trocr", dict(cross_attention_hidden_size=32), "cross_attention_hidden_size"),
    ("big_bird", dict(attention_type="block_sparse"), "block-sparse attention"),  # BigBirdConfig's default
    ("xlm", dict(asm=True), "adaptive-softmax"),
    ("prophetnet", dict(add_cross_attention=False), "add_cross_attention"),
])
def test_what_is_not_counted_is_refused_in_one_line(model_type, switches, says):
    with pytest.raises(MemplanError, match=says) as err:
        registry.memplan_params({**tiny_config(model_type), **switches})
    assert "\n" not in str(err.value) and "model YAML" in str(err.value)


def test_roformer_is_refused_past_its_rotary_table(run_cli, tmp_path):
    """RoFormer looks its sinusoidal table up by position id: s past max_position_embeddings rows fails in
    transformers (an index error), so memplan refuses it in one line."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**tiny_config("roformer"), "max_position_embeddings": 64}))
    code, out, err = run_cli("estimate", "--hf-config", str(path), "--seq-len", "65", "--impl", "hf-eager")
    assert code == 2 and "frozen rotary position table's 64 rows" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("model_type, says", [("roberta", "BERT is another model"), ("trocr", "T5 is another model")])
def test_megatron_refuses_them_in_one_line(model_type, says, run_cli, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**tiny_config(model_type), "is_decoder": True}))
    assert says in launch_refusal(read_hf_config(str(path)).model)
    for extra in (["--impl", "megatron"], ["--impl", "megatron-local"], ["--emit", "megatron"]):
        code, out, err = run_cli("estimate", "--hf-config", str(path), "--seq-len", "32", *extra)
        assert code == 2 and out == "" and says in err and len(err.strip().splitlines()) == 1


def test_the_estimate_says_what_it_is(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_config("bert")))  # is_decoder false, as the defaults
    notes = " ".join(read_hf_config(str(path)).notes)
    assert "BERT-like encoder trained as a causal LM" in notes and "attends bidirectionally" in notes
    path.write_text(json.dumps(tiny_config("trocr")))
    notes = " ".join(read_hf_config(str(path)).notes)
    assert "the encoder is left out" in notes and "not in the activations" in notes
    assert "bidirectionally" not in notes  # a decoder's self-attention is causal whatever is_decoder says


@pytest.mark.parametrize("model_type", ["roberta", "trocr", "rembert", "roc_bert"])
def test_a_traced_post_norm_encoder_equals_a_real_cpu_run(model_type):
    """RoBERTa (post-LN blocks, the embedding LayerNorm, token types, positions from 2, the head's transform),
    TrOCR's decoder (its cross-attention built, not run), RemBERT (embeddings 256 wide projected to h, a head 1664
    wide) and RoCBERT (row 0 of its pronunciation and shape tables concatenated to the word embeddings, mapped to h):
    traced, read by memplan, bucket by bucket equal to what the real model saves on CPU at s = 32, b = 2."""
    row, config = registry.params_row(model_type, "")
    registry.trace_row(row, config)
    assert row.memplan_params == row.meta_params and row.traced and row.measured, row.trace_error


def test_xmod_traced_through_its_language_adapters_equals_a_real_cpu_run():
    """X-MOD selects each language's samples with a boolean mask (a size fake tensors cannot know); the trace tells
    the ShapeEnv what a run without lang_ids does (every sample through default_language's adapter, none through the
    others: validation/trace_saves.py _language_adapters) and runs transformers' own code: with three languages, the
    second the default, and adapter LayerNorms, its bytes equal a real CPU run's, layer by layer, at two (s, b)."""
    config = {**tiny_config("xmod"), "languages": ["en_XX", "de_DE", "fr_XX"], "default_language": "de_DE",
              "adapter_layer_norm": True}
    traced = TracedFile.model_validate(trace(config))
    assert traced.conditions == ["s >= 2", "b >= 2"]
    for s, b in ((32, 2), (48, 3)):
        assert bucket_bytes(traced, s, b) == measured_buckets(measure(config, s, b))


@pytest.mark.skipif(not os.environ.get("MEMPLAN_ENCODERS_SLOW"), reason="~3 s of CPU each: MEMPLAN_ENCODERS_SLOW=1")
@pytest.mark.parametrize("model_type", sorted(set(BERT_LIKES) - {"roberta"}) + ["mvp", "bigbird_pegasus", "electra",
                                                                                 "roformer", "whisper", "big_bird"])
def test_a_traced_sample_of_the_others_equals_a_real_cpu_run(model_type):
    """The same over the others (opt-in): BERT (cls.predictions), BERT-generation (no token types, no transform), the
    pre-LN ones (Megatron-BERT, RoBERTa-PreLayerNorm, XLM-RoBERTa-XL), RoBERTa's copies, MVP's and BigBird-Pegasus's decoders,
    ELECTRA's generator, RoFormer (rotary, embeddings 768 wide projected to h), Whisper's decoder (k_proj unbiased) and
    BigBird with full attention (its pooler run)."""
    row, config = registry.params_row(model_type, "")
    registry.trace_row(row, config)
    assert row.memplan_params == row.meta_params and row.traced and row.measured, row.trace_error
