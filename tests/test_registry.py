"""Issue 22: the whole causal-LM registry of the installed transformers (memplan/check/registry.py).

Every architecture of MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, as a tiny config of its own config class's defaults
(validation/registry.py), is either read by memplan with transformers' exact parameter count (the model built on
the meta device) or listed in EXCLUDED with the reason, and EXCLUDED lists nothing the walk does not find; a sample
is traced and the trace, as memplan reads it, equals a real CPU run's saved bytes bucket by bucket. The full walk
with every trace: `python -m memplan.check.registry` (docs/reference.md, section The transformers registry)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from memplan.check import registry  # noqa: E402
from memplan.core.errors import MemplanError  # noqa: E402
from memplan.memory.shapes import weight_shapes  # noqa: E402
from memplan.memory.states import total_params  # noqa: E402
from memplan.presets.hf_config import read_hf_config  # noqa: E402
from validation.registry import architectures, meta_params, text_model, tiny_config  # noqa: E402
from validation.trace_config import build_model  # noqa: E402

DOCS = Path(__file__).resolve().parents[1] / "docs" / "reference.md"
TABLE = re.compile(r"<!-- registry-exclusions -->\n(?P<body>.*?)\n<!-- end registry-exclusions -->", re.DOTALL)

# the families issue 22 names (model_type), each estimated with the exact count
NAMED = ["olmo2", "granite", "falcon", "gpt_neox", "starcoder2", "cohere", "phimoe", "deepseek_v2", "gpt_oss",
         "gemma3", "gemma3_text"]
# the families the third wave read (memplan/presets/hf_families.py), each estimated with the exact count
WIDENED = ["qwen2_moe", "glm4_moe", "llama4_text", "llama4", "hunyuan_v1_moe", "ernie4_5_moe", "dots1", "phi", "gptj",
           "codegen", "bloom", "olmo", "glm", "glm4", "nemotron", "persimmon", "arcee", "ministral", "mpt", "dbrx",
           "gpt_neo", "gpt_bigcode", "minimax_m2", "glm4_moe_lite", "fuyu", "got_ocr2",
           "openai-gpt", "opt", "biogpt",  # the fourth wave's: GPT-1 (no final norm), 2 more position rows
           "afmoe", "laguna",  # the fifth wave's: a gate on the attention output (attention_output_gate),
           "diffllama", "apertus",  # differential attention's lambdas, xIELU's two scalars (activation_params)
           "emu3", "bitnet",  # Emu3: its text_config (Emu3TextConfig, which transformers' causal-LM mapping does not name)
           "gpt_neox_japanese", "modernbert-decoder", "cpmant",  # the sixth wave's: extra tensors
           "cohere_compass_text"]  # Cohere 2's parallel block without q / k norms (its tiny config: rotary per kind)
# the hybrids with Mamba-2 mixers or short convolutions (memplan/presets/hf_hybrids.py; tests/test_hybrids.py traces
# Bamba and LFM2) or gated DeltaNets (memplan/presets/hf_linear_attention.py; tests/test_linear_attention.py traces
# Qwen3-Next) or Kimi Delta Attention beside latent attention (the same file), and the recurrent decoders
# (memplan/presets/hf_recurrent.py; MiniMax: hf_linear_attention.py; tests/test_recurrent.py)
HYBRIDS = ["mamba2", "bamba", "nemotron_h", "granitemoehybrid", "falcon_h1", "lfm2", "lfm2_moe", "lfm3", "qwen3_next",
           "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "olmo_hybrid", "kimi_linear", "bailing_hybrid",
           "recurrent_gemma", "rwkv", "minimax", "xlstm", "jetmoe", "doge", "hrm_text"]
# the BERT-like encoders trained as causal LMs and encoder-decoder models' decoders alone
# (memplan/presets/hf_encoders.py; tests/test_encoders.py, tests/test_seq2seq_decoders.py)
ENCODERS = ["bert", "bert-generation", "roberta", "roberta-prelayernorm", "xlm-roberta", "xlm-roberta-xl", "camembert",
            "ernie", "data2vec-text", "megatron-bert", "mvp", "trocr", "bigbird_pegasus", "bart", "mbart", "plbart",
            "pegasus", "blenderbot", "blenderbot-small", "marian", "roc_bert", "big_bird", "xmod", "xlm", "prophetnet"]


@pytest.fixture(scope="module")
def rows():
    # the models memplan refuses are not built (the refusal needs none): the walk's CPU time is its imports
    return registry.walk(build_all=False)


def test_every_architecture_is_estimated_exactly_or_excluded_with_its_reason(rows):
    assert len(rows) == len(architectures()) > 150
    walked = {r.model_type: registry.excluded_as_walked(r) for r in rows}
    # every exclusion is still true (an architecture memplan learns to read, or transformers fixes, leaves the list)
    assert {k: kind for k, (kind, _) in registry.EXCLUDED.items() if kind != "trace"} == \
        {k: kind for k, kind in walked.items() if kind}
    assert all(kind in registry.KINDS and why for kind, why in registry.EXCLUDED.values())
    estimated = [r for r in rows if r.estimated]
    wrong = {r.model_type: (r.memplan_params, r.meta_params) for r in estimated if r.memplan_params != r.meta_params}
    assert not wrong
    assert len(estimated) >= 80
    assert {r.model_type for r in estimated} >= set(NAMED) | set(WIDENED) | set(HYBRIDS) | set(ENCODERS)


@pytest.mark.parametrize("model_type, switches", [
    ("ernie4_5", dict(use_bias=True)),  # a bias on q, k, v, o and the MLP
    ("seed_oss", dict(attention_out_bias=True)),  # o_proj's bias beside q, k, v's
    ("seed_oss", dict(attention_bias=False)),
    ("seed_oss", dict(attention_out_bias=True, mlp_bias=True)),
    ("stablelm", dict(use_qkv_bias=True)),
    ("hyperclovax", dict(use_post_norm=False)),  # without its post_norm1 / post_norm2
    ("cohere2", dict(tie_word_embeddings=False)),
    ("exaone4", dict(tie_word_embeddings=True)),
    ("granitemoeshared", dict(shared_intermediate_size=48)),  # the shared expert (0 by default: none)
    ("olmoe", dict(num_experts=6)),
    ("glm4_moe", dict(use_qk_norm=True, attention_bias=True)),  # q / k norms per head; biases on q, k, v only
    ("glm", dict(attention_bias=False)),
    ("qwen2_moe", dict(qkv_bias=False, shared_expert_intermediate_size=48)),
    ("llama4_text", dict(moe_layers=[1])),  # a dense first layer intermediate_size_mlp wide
    ("ernie4_5_moe", dict(moe_num_shared_experts=0)),
    ("exaone_moe", dict(mlp_layer_types=["dense", "dense", "sparse"])),
    ("cohere2_moe", dict(num_shared_experts=1)),
    ("persimmon", dict(qk_layernorm=False)),
    ("gpt_bigcode", dict(multi_query=False)),
    ("laguna", dict(gating=False)),  # g_proj one gate per channel (h x q), not per head (h x a)
    ("laguna", dict(num_attention_heads_per_layer=[8, 8])),  # the layers' own head count, not num_attention_heads
    ("afmoe", dict(num_shared_experts=1, num_dense_layers=0)),
    ("diffllama", dict(head_dim=32)),  # the four lambdas are head_dim wide
    ("apertus", dict(hidden_act="gelu")),  # no xIELU: no learned scalars
])
def test_the_switches_of_the_widened_families_count_exactly(model_type, switches):
    config = {**tiny_config(model_type), **switches}
    assert registry.memplan_params(config) == meta_params(config) != meta_params(tiny_config(model_type))


@pytest.mark.parametrize("layout", ["fused", "separate"])
@pytest.mark.parametrize("model_type", ["olmo", "nanochat", "ernie4_5_moe", "persimmon", "qwen2_moe", "gptj", "bloom",
                                        "gpt_neo", "afmoe", "laguna", "diffllama", "apertus",
                                        "bitnet", "bert", "bert-generation", "megatron-bert",
                                        "trocr", "bigbird_pegasus", "electra", "rembert", "roformer",
                                        "whisper", "pegasus", "mbart", "roc_bert", "big_bird", "xmod",
                                        "gpt_neox_japanese", "modernbert-decoder", "xlm", "cpmant", "prophetnet"])
def test_the_tensors_of_the_new_fields_hold_the_counted_parameters(model_type, layout, tmp_path):
    """weight_shapes (the tensors the allocator and the optimizers replay) hold what param_groups count, for the
    fields the walk's families added: norms without weights, the router's bias, biased per-head q / k LayerNorms, the
    shared experts' gate, MLP-only and out_proj biases, the embedding norm, token-type embeddings and the head's
    transform (BERT), the cross-attention of a decoder run alone (TrOCR), factorised embeddings with their projection
    and a head e_out wide (ELECTRA tied, RemBERT untied), RoFormer's frozen rotary table, Whisper's k_proj without bias,
    Pegasus's frozen sinusoidal table h wide and final norm, mBART's learned positions from row 2 and final norm, a
    family's extra tensors (RoCBERT's tables and map_inputs_layer, BigBird's pooler, X-MOD's adapters, XLM's language
    table, GPT-NeoX-Japanese's dense_bias, CPM-Ant's prompt rows and relative position bias, ProphetNet's ngram table
    and relative_pos_embeddings, ModernBERT's attention norms and prediction head)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_config(model_type)))
    model = read_hf_config(str(path)).model
    values, k = model.symbols(t=1), model.moe_first_dense_layers
    shapes = weight_shapes(model, layout)
    held = sum(times * w.count * int(w.numel.evaluate(values)) for scope, times in (
        ("first", 1), ("dense_layer", k), ("layer", model.num_layers - k), ("last", 1), ("head", 0 if
                                                                                          model.tied_embeddings else 1))
        for w in shapes[scope])
    assert held == total_params(model)


@pytest.mark.parametrize("model_type, switches, says", [
    ("seed_oss", dict(attention_bias=False, attention_out_bias=True), "attention_out_bias"),
    ("stablelm", dict(qk_layernorm=True), "qk_layernorm"),
    ("stablelm", dict(use_parallel_residual=True), "use_parallel_residual"),
    ("phi", dict(qk_layernorm=True), "qk_layernorm"),
    ("llama4_text", dict(moe_layers=[0]), "moe_layers"),  # an MoE layer before a dense one
    ("ernie4_5_moe", dict(moe_layer_interval=2), "moe_layer_interval"),
    ("exaone_moe", dict(mlp_layer_types=["sparse", "dense", "sparse"]), "mlp_layer_types"),
    ("mpt", dict(no_bias=False), "no_bias"),  # transformers' MptBlock builds no bias whatever the file says
    ("laguna", dict(num_attention_heads_per_layer=[4, 8]), "num_attention_heads_per_layer"),
])
def test_layouts_memplan_does_not_count_are_refused(model_type, switches, says):
    with pytest.raises(MemplanError, match=says) as err:
        registry.memplan_params({**tiny_config(model_type), **switches})
    assert "\n" not in str(err.value) and "model YAML" in str(err.value)


@pytest.mark.parametrize("model_type", ["olmo3", "cohere2"])
def test_a_traced_sample_equals_a_real_cpu_run(model_type):
    """Post-norms and alternating sliding / full attention (OLMo-3), a parallel block after one LayerNorm (Cohere 2):
    traced, read by memplan, bucket by bucket equal to what the real model saves on CPU at s = 32, b = 2."""
    row, config = registry.params_row(model_type, "")
    registry.trace_row(row, config)
    assert row.traced and row.measured, row.trace_error


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen2_moe", "bloom", "gptj", "glm4_moe", "llama4", "olmo", "mamba2",
                                        "nemotron_h", "granitemoehybrid", "falcon_h1", "lfm2_moe",
                                        "lfm3"])
def test_a_traced_sample_of_the_families_read_since_equals_a_real_cpu_run(model_type):
    """The same check over families hf_families.py reads (a gated shared expert, ALiBi with an embedding norm, GPT-J's
    parallel block, GLM-4.5's dense-first experts, Llama 4's text_config, norms without weights) and the Mamba-2
    hybrids hf_hybrids.py reads (mixers alone, Nemotron-H's one-block layers, experts beside mixers, attention and
    mixer in parallel, LFM2-MoE's dense-first layers before experts, LFM3's short convolutions beside full and
    sliding-window attention); the DeltaNet hybrids: tests/test_linear_attention.py."""
    row, config = registry.params_row(model_type, "")
    registry.trace_row(row, config)
    assert row.memplan_params == row.meta_params and row.traced and row.measured, row.trace_error


# the defaults, shrunk, that built no model before validation/registry.py filled what they leave unset (the QSA
# indexer's sizes, rotary per layer kind), kept what the class checks (top-1 routing, the SWA head_dim = nope + rope,
# per_layer_config overrides within the shrunk layers) or built the class with what its validation asks
NOW_BUILT = ["qwen4_exp", "qwen4_exp_text", "cohere_compass_text", "zaya", "dots3_note_text"]


@pytest.mark.parametrize("model_type", NOW_BUILT)
def test_the_shrunk_defaults_that_built_nothing_build(model_type):
    assert meta_params(tiny_config(model_type)) > 0


def test_the_gemma4_assistant_config_is_made_and_refused_as_a_drafter():
    """Its defaults fail its own validation (per-layer inputs): made with a text model without them, every layer
    reusing K / V (num_kv_shared_layers = the shrunk 2 layers); memplan refuses a drafter in one line."""
    config = tiny_config("gemma4_assistant")
    assert config["text_config"]["num_kv_shared_layers"] == config["text_config"]["num_hidden_layers"] == 2
    with pytest.raises(MemplanError, match="speculative-decoding drafter") as err:
        registry.memplan_params(config)
    assert "\n" not in str(err.value)


def test_the_published_cohere_compass_layout_counts_and_traces_exactly():
    """North's layout: sliding layers with (M-)RoPE, full ones without position encoding (rope_parameters None), a
    logit scale, here with attention biases: memplan's count is transformers' (meta device), the biases 2 layers x
    (q 64 + k 32 + v 32 + o 64) = 384 parameters more (h = 64, 2 K / V heads 16 wide); the trace equals a real CPU run."""
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 50000.0, "mrope_section": [2, 1, 1]},
            "full_attention": None}
    plain = {**tiny_config("cohere_compass_text"), "layer_types": ["sliding_attention", "full_attention"],
             "rope_parameters": rope, "logit_scale": 0.25}
    biased = {**plain, "attention_bias": True}
    assert registry.memplan_params(biased) == meta_params(biased) == meta_params(plain) + 384
    row = registry.Row("cohere_compass_text", "CohereCompassForCausalLM")
    registry.trace_row(row, biased)
    assert row.traced and row.measured, row.trace_error


def test_a_text_model_the_mapping_does_not_name_is_built_by_its_class():
    """Emu3's text_config (Emu3TextConfig) is no key of AutoModelForCausalLM's mapping: the trace builds the class the
    config names (Emu3ForCausalLM), whose own config class it is, as transformers does for the whole Emu3Config."""
    model = build_model(text_model(tiny_config("emu3")), dtype="float32")
    assert type(model).__name__ == "Emu3ForCausalLM" and model.training
    assert sum(p.numel() for p in model.parameters()) == meta_params(tiny_config("emu3"))


def test_the_docs_print_the_exclusions():
    found = TABLE.search(DOCS.read_text())
    assert found, "docs/reference.md has no registry-exclusions table"
    assert found["body"] == registry.render_table()
