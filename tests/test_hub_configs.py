"""Issue 22: the config.json of every family the issue names (tests/hub/, Hub shapes) is read by --hf-config with
transformers' exact parameter count (the model built on the meta device), honest notes where --impl megatron*
approximates the layer, and refusals that say what to do (an unknown architecture, Gemma 2 with --impl hf-sdpa)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.memory.shapes import weight_shapes
from memplan.memory.states import param_groups, total_params
from memplan.presets.hf_config import read_hf_config

HUB = Path(__file__).parent / "hub"
FIXTURES = sorted(p.stem for p in HUB.glob("*.json"))
# the families issue 22 names, each with a fixture (two for Falcon, Cohere and DeepSeek-V2: both layouts)
FAMILIES = ["olmo2-7b", "granite-3.1-8b", "falcon-7b", "falcon-40b", "pythia-1b", "starcoder2-3b", "command-r-v01",
            "command-r-plus", "phi-3.5-moe", "deepseek-v2-lite", "deepseek-v2", "gpt-oss-20b", "gemma3-4b",
            # and families the registry walk added (memplan/presets/hf_families.py)
            "qwen1.5-moe-a2.7b", "phi-2", "gpt-j-6b", "bloom-560m", "mpt-7b", "gpt-neo-125m",
            "openai-gpt", "opt-125m", "biogpt"]


def _meta_params(config: dict) -> int:
    """transformers' own count: the model built on the meta device (no memory), each tensor once (tied embeddings
    once); a multimodal model's vision tower and projector left out (validation/registry.py, the registry walk's)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from validation.registry import meta_params

    return meta_params(config)


def test_every_named_family_has_a_fixture():
    assert FIXTURES == sorted(FAMILIES)


@pytest.mark.parametrize("name", FAMILIES)
def test_parameter_count_is_transformers_meta_model(name):
    """Biases (StarCoder2, GPT-NeoX, Phi-3.5-MoE's attention and head, gpt-oss's attention, router and experts),
    LayerNorm with and without bias, one norm per parallel block (Falcon-7B, Cohere), full-width q / k norms
    (OLMo-2, Command-R+), sinks, MLA with and without a query latent, shared experts, dense-first layers, tied
    embeddings: each fixture exercises one, so removing a term fails its family here."""
    pytest.importorskip("transformers")
    config = json.loads((HUB / f"{name}.json").read_text())
    assert total_params(read_hf_config(str(HUB / f"{name}.json")).model) == _meta_params(config)


@pytest.mark.parametrize("layout", ["fused", "separate"])
@pytest.mark.parametrize("name", FAMILIES)
def test_weight_shapes_add_up_to_the_parameter_groups(name, layout):
    """The tensors the allocator replays (weight_shapes) hold the same parameters as the groups, group by group."""
    model = read_hf_config(str(HUB / f"{name}.json")).model
    v, k = model.symbols(t=1), model.moe_first_dense_layers
    shapes = weight_shapes(model, layout)
    got: dict[str, int] = {}
    for scope, times in (("first", 1), ("dense_layer", k), ("layer", model.num_layers - k), ("last", 1)):
        for w in shapes[scope]:
            got[w.group] = got.get(w.group, 0) + times * w.count * int(w.numel.evaluate(v))
    layers = {"layer": model.num_layers, "moe": model.num_layers - k, "dense": k, "first": 1, "last": 1}
    want: dict[str, int] = {}
    for g in param_groups(model):
        want[g.name] = want.get(g.name, 0) + layers[g.scope] * int(g.count.evaluate(v))
    assert got == want


def test_gemma3_multimodal_reads_the_text_model_and_says_what_is_left_out():
    preset = read_hf_config(str(HUB / "gemma3-4b.json"))
    assert preset.model.num_layers == 34 and preset.model.sandwich_norms and preset.model.tied_embeddings
    assert any("vision tower" in n and "projector" in n and "left out" in n for n in preset.notes)


@pytest.mark.parametrize("name", ["falcon-7b", "pythia-1b", "command-r-v01", "olmo2-7b"])
def test_parallel_and_post_norm_layers_say_their_activations_are_approximated(name):
    notes = read_hf_config(str(HUB / f"{name}.json")).notes
    assert any("approximates its activations" in n and "derived" in n for n in notes), notes


def test_a_directory_given_to_hf_config_uses_its_config_json(tmp_path):
    (tmp_path / "config.json").write_text((HUB / "pythia-1b.json").read_text())
    read = read_hf_config(str(tmp_path))
    assert read.model.name == str(tmp_path / "config.json")
    assert read.model.model_copy(update={"name": "x"}) == read_hf_config(str(HUB / "pythia-1b.json")).model.model_copy(
        update={"name": "x"})


def test_an_unknown_architecture_says_how_to_write_a_model_yaml_and_what_to_install(run_cli, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"architectures": ["XLNetLMHeadModel"], "model_type": "xlnet"}))  # RWKV is read since
    code, _, err = run_cli("estimate", "--hf-config", str(path))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "Model presets" in err and "pip install 'memplan[trace]'" in err and "--model" in err


@pytest.mark.parametrize("model_type, arch", [("gemma2", "Gemma2ForCausalLM"), ("gpt_oss", "GptOssForCausalLM")])
def test_no_sdpa_architectures_answer_use_hf_eager_before_tracing(run_cli, tmp_path, monkeypatch, model_type, arch):
    """transformers' Gemma2ForCausalLM and GptOssForCausalLM have no sdpa attention (_supports_sdpa false): before
    this check, Gemma 2 with --impl hf-sdpa traced and ended in transformers' ValueError cut off mid-sentence."""
    config = {"architectures": [arch], "model_type": model_type, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "vocab_size": 256, "max_position_embeddings": 512, "sliding_window": 32}
    if model_type == "gpt_oss":
        config.update(num_local_experts=4, num_experts_per_tok=2)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    monkeypatch.setenv("MEMPLAN_CACHE", str(tmp_path / "cache"))
    code, _, err = run_cli("estimate", "--hf-config", str(path), "--impl", "hf-sdpa")
    assert code == 2 and err.strip().endswith("use --impl hf-eager") and len(err.strip().splitlines()) == 1, err


def test_no_sdpa_list_agrees_with_transformers():
    """NO_SDPA names the read architectures transformers builds without sdpa, and only those."""
    transformers = pytest.importorskip("transformers")
    from memplan.inventory.traced_file import NO_SDPA
    from memplan.presets.hf_config import HF_ARCHITECTURES

    types = {"Gemma2ForCausalLM": "gemma2", "GptOssForCausalLM": "gpt_oss", "VaultGemmaForCausalLM": "vaultgemma",
             "GraniteSWAForCausalLM": "granite_swa", "GraniteMoeSWAForCausalLM": "granitemoe_swa",
             "BloomForCausalLM": "bloom", "MptForCausalLM": "mpt", "MPTForCausalLM": "mpt", "GPTJForCausalLM": "gptj",
             "CodeGenForCausalLM": "codegen", "XGLMForCausalLM": "xglm", "GPTNeoForCausalLM": "gpt_neo",
             "OpenAIGPTLMHeadModel": "openai-gpt", "Mamba2ForCausalLM": "mamba2",
             "MambaForCausalLM": "mamba", "FalconMambaForCausalLM": "falcon_mamba",
             "MegatronBertForCausalLM": "megatron-bert", "MvpForCausalLM": "mvp", "TrOCRForCausalLM": "trocr",
             "BigBirdPegasusForCausalLM": "bigbird_pegasus", "RemBertForCausalLM": "rembert",
             "RoFormerForCausalLM": "roformer", "FlintForCausalLM": "flint", "MiMoV2FlashForCausalLM": "mimo_v2_flash",
             "RwkvForCausalLM": "rwkv", "xLSTMForCausalLM": "xlstm"}
    # MPTForCausalLM: the Hub's spelling (MPT's own remote code), read as transformers' MptForCausalLM
    classes = {a: getattr(transformers, "MptForCausalLM" if a == "MPTForCausalLM" else a) for a in HF_ARCHITECTURES}
    missing = [a for a, cls in classes.items() if not getattr(cls, "_supports_sdpa", False)]
    assert sorted({types[a] for a in missing}) == sorted(NO_SDPA)


def test_opt_350m_projections_are_refused_in_one_line(tmp_path):
    """OPT-350m (post-norm, word_embed_proj_dim 512 != hidden_size 1024: project_in / project_out) is not read."""
    config = {**json.loads((HUB / "opt-125m.json").read_text()), "hidden_size": 1024, "word_embed_proj_dim": 512,
              "do_layer_norm_before": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(MemplanError, match="project_in / project_out") as err:
        read_hf_config(str(tmp_path / "config.json"))
    assert "\n" not in str(err.value)


def test_mlp_bias_alone_is_refused_in_one_line(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads((HUB / "granite-3.1-8b.json").read_text()), "mlp_bias": True}))
    with pytest.raises(MemplanError, match="mlp_bias without attention_bias"):
        read_hf_config(str(path))


def test_trace_takes_a_directory_and_refuses_sdpa_for_gemma2_before_tracing(run_cli, tmp_path):
    config = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256}
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli("trace", "--hf-config", str(tmp_path), "--impl", "hf-sdpa")
    assert code == 2 and err.strip().endswith("use --impl hf-eager"), err


def test_gpt_oss_active_parameters_leave_out_the_idle_experts_biases():
    """gpt-oss-20b, by hand: transformers builds 20,914,757,184 parameters (tests/hub/README.md); each of the 24
    layers leaves 32 - 4 = 28 experts idle per token, each 3 x 2880 x 2880 weights + 2 x 2880 + 2880 biases =
    24,891,840; 20,914,757,184 - 24 x 28 x 24,891,840 = 4,187,440,704 active. Without the embedding lookup
    (201,088 x 2,880 = 579,133,440) that is 3.61 B, the active count OpenAI's gpt-oss model card publishes."""
    from memplan.memory.states import active_params

    model = read_hf_config(str(HUB / "gpt-oss-20b.json")).model
    assert total_params(model) == 20_914_757_184
    assert active_params(model) == 4_187_440_704
    assert round((active_params(model) - 201_088 * 2_880) / 1e9, 2) == 3.61


@pytest.mark.parametrize("given", ["config.json", "."])
def test_a_config_json_or_its_directory_given_to_model_points_to_hf_config(run_cli, tmp_path, given):
    (tmp_path / "config.json").write_text((HUB / "pythia-1b.json").read_text())
    code, _, err = run_cli("estimate", "--model", str(tmp_path / given))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "goes with --hf-config" in err, err


def test_complex64_saves_are_sized_as_8_byte_elements():
    """DeepSeek-V2's rotary embedding (view_as_complex of fp32 pairs) saves complex64 tensors: 8 bytes an element
    in torch, the size of the int64 storage kind (a trace of a tiny DeepSeek-V2 was refused before)."""
    torch = pytest.importorskip("torch")
    from memplan.inventory.traced_file import term_dtype
    from memplan.inventory.types import INT64_BYTES

    assert term_dtype("complex64") == "int64"
    assert torch.empty(0, dtype=torch.complex64).element_size() == INT64_BYTES == 8


@pytest.mark.parametrize("name", ["opt-125m", "biogpt", "gpt-neo-125m"])
def test_a_learned_position_table_keeps_its_rows_at_any_seq_len(name):
    # before: the learned table was counted as s rows, so training OPT-125m (2,048 + 2 rows) at s = 512 counted
    # 1,536 x 768 = 1,179,648 parameters fewer than transformers builds. The table is max_position_embeddings rows
    # (+ OPT's / BioGPT's 2) whatever s trains: the count at a shorter s is transformers' meta-device count
    pytest.importorskip("transformers")
    preset = read_hf_config(str(HUB / f"{name}.json"))
    shorter = preset.model.model_copy(update={"seq_length": 256})
    assert total_params(shorter) == _meta_params(json.loads((HUB / f"{name}.json").read_text()))
    with pytest.raises(ValueError, match="longer than the learned position table"):
        ModelSpec(**{**preset.model.model_dump(exclude_unset=True), "seq_length": preset.model.position_rows + 1})
