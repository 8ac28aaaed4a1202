"""Issue 22: multimodal configs read as their text model (memplan/presets/hf_multimodal.py): Llama 3.2 Vision's text
model with its cross-attention layers, Phi-4-multimodal's Phi-3 decoder, Moshi's temporal transformer, MOSS-Transcribe-
Diarize's Qwen3 text_config. Hub-shaped files (tests/hub_multimodal/, README there) counted by hand and against the
model transformers builds on the meta device; a text-only step's trace against a real CPU run (the tiny configs of the
registry walk); GIT refused with what its real code does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.core.errors import MemplanError
from memplan.memory.shapes import stage_tensors
from memplan.memory.states import total_params
from memplan.presets.hf_config import read_hf_config

HUB = Path(__file__).parent / "hub_multimodal"

# By hand (transformers 5.23's modules; d = h / a unless head_dim says otherwise; a Llama-layout layer is
# q h x a d, k and v h x g d each, o a d x h, the gated MLP 3 h f, two RMSNorms 2 h):
HAND = {
    # Llama 3.2 11B Vision's text model (MllamaForCausalLM): h 4096, a 32, g 8, d 128, f 14336, v 128256, L 40 of which
    # 8 cross-attention layers. A layer: 2 x 4096^2 + 2 x 4096 x 1024 + 3 x 4096 x 14336 + 2 x 4096 = 218,112,000;
    # x 40 = 8,724,480,000; a cross-attention layer holds the same plus q_norm and k_norm (d each) and two gates:
    # 8 x 258 = 2,064; embed_tokens (v + 8) x h = 128,264 x 4096 = 525,369,344; lm_head v x h = 525,336,576 (never
    # tied); the final norm 4096. Total 9,775,192,080.
    "llama-3.2-11b-vision": 9_775_192_080,
    # Phi-4-multimodal's decoder (Phi4MultimodalForCausalLM, the vision and audio embedders left out): h 3072, a 24,
    # g 8, d 128, f 8192, v 200064, L 32, tied. A layer: qkv_proj 3072 x (3072 + 2 x 1024) = 15,728,640, o_proj
    # 9,437,184, gate_up_proj + down_proj 3 x 3072 x 8192 = 75,497,472, norms 6,144: 100,669,440; x 32 =
    # 3,221,422,080; the embedding 200,064 x 3072 = 614,596,608 (the head tied); the final norm 3072. 3,836,021,760.
    "phi-4-multimodal": 3_836_021_760,
    # Moshi's temporal transformer (MoshiForCausalLM): h 4096, a = g = 32, d 128, ffn_dim 22528 (fc1 h -> ffn_dim,
    # fc2 ffn_dim / 2 -> h), v 32000, L 32, untied. A layer: 4 x 4096^2 = 67,108,864, fc1 4096 x 22528 = 92,274,688,
    # fc2 11264 x 4096 = 46,137,344, norms 8,192: 205,529,088; x 32 = 6,576,930,816; embed_tokens (v + 1) x h =
    # 131,076,096; lm_head 131,072,000; the final norm 4096. Total 6,839,083,008.
    "moshiko": 6_839_083_008,
    # MOSS-Transcribe-Diarize's text model (its text_config a Qwen3: h 1024, a 16, g 8, d 128, f 3072, v 151936,
    # L 28), tied by the file's top-level tie_word_embeddings. A layer: q 1024 x 2048, k and v 1024 x 1024 each, o
    # 2048 x 1024: 6,291,456; q_norm, k_norm 256; the MLP 3 x 1024 x 3072 = 9,437,184; norms 2,048: 15,730,944; x 28 =
    # 440,466,432; the embedding 151,936 x 1024 = 155,582,464 (the head tied); the final norm 1024. 596,049,920.
    "moss-transcribe-diarize": 596_049_920,
}


@pytest.mark.parametrize("name", sorted(HAND))
def test_the_text_models_count_is_the_hand_derivation(name):
    assert total_params(read_hf_config(str(HUB / f"{name}.json")).model) == HAND[name]


@pytest.mark.parametrize("name", sorted(HAND))
def test_the_text_models_count_is_transformers_meta_model(name):
    """What AutoModelForCausalLM builds on the meta device (Mllama: MllamaForCausalLM, the text model alone; the
    others: the vision / audio parts left out, validation/registry.py LEFT_OUT)."""
    pytest.importorskip("transformers")
    from validation.registry import meta_params

    config = json.loads((HUB / f"{name}.json").read_text())
    if config["model_type"] == "mllama":  # the Hub file's MllamaForConditionalGeneration: its causal LM's class
        config["architectures"] = ["MllamaForCausalLM"]
    assert meta_params(config) == HAND[name]


def test_mllama_says_what_is_left_out_and_what_a_text_only_step_skips():
    preset = read_hf_config(str(HUB / "llama-3.2-11b-vision.json"))
    model = preset.model
    assert (model.num_layers, model.cross_attention_layers, model.vocab_extra_rows) == (40, 8, 8)
    assert not model.tied_embeddings
    assert any("vision tower" in n and "left out" in n for n in preset.notes)
    assert any("cross-attention layers" in n and "skips them" in n for n in preset.notes)
    with pytest.raises(MemplanError, match="cross_attention_layers"):  # Adafactor's, Muon's shapes: not modelled
        stage_tensors(model, model.symbols(t=1), model.num_layers, 1, 1, 1)


def test_a_conditional_generation_class_ties_by_its_top_level_key(tmp_path):
    """MossTranscribeDiarizeForConditionalGeneration ties lm_head by its own config's tie_word_embeddings (true in the
    file), whatever text_config says (false): one v x h table; the top-level false gives the head its own."""
    data = json.loads((HUB / "moss-transcribe-diarize.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**data, "tie_word_embeddings": False}))
    assert total_params(read_hf_config(str(path)).model) == HAND["moss-transcribe-diarize"] + 151_936 * 1024


def test_every_layer_cross_attention_is_refused_in_one_line(tmp_path):
    data = json.loads((HUB / "llama-3.2-11b-vision.json").read_text())
    data["text_config"] = {**data["text_config"], "num_hidden_layers": 2, "cross_attention_layers": [0, 1]}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(MemplanError, match="no self-attention layer") as err:
        read_hf_config(str(path))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("model_type", ["mllama", "phi4_multimodal"])
def test_a_text_only_step_traced_equals_a_real_cpu_run(model_type):
    """The walk's tiny configs (Mllama's second layer a cross-attention one): memplan's count is transformers', and the
    trace as memplan reads it equals a real CPU run's saved bytes at s = 32, b = 2; Mllama's cross-attention layer
    saves nothing (a text-only step skips it)."""
    pytest.importorskip("transformers")
    from memplan.check import registry
    from validation.registry import trace

    row, config = registry.params_row(model_type, "")
    registry.trace_row(row, config)
    assert row.memplan_params == row.meta_params and row.traced and row.measured, row.trace_error
    if model_type == "mllama":
        groups = {tuple(g["layers"]): g["terms"] for g in trace(config)["layer_groups"]}
        assert groups[(1,)] == [] and groups[(0,)]


def test_git_is_refused_because_a_text_only_step_cannot_run(tmp_path):
    """GitForCausalLM's loss drops its first image_patch_tokens (197) logits: the real model, run on text alone with
    labels, fails (measured here), so memplan refuses the file in one line."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"architectures": ["GitForCausalLM"], "model_type": "git", "vocab_size": 30522}))
    with pytest.raises(MemplanError, match="image_patch_tokens") as err:
        read_hf_config(str(path))
    assert "\n" not in str(err.value)
    torch = pytest.importorskip("torch")
    from validation.registry import tiny_config
    from validation.trace_config import build_model

    model = build_model(tiny_config("git"), impl="hf-eager", dtype="float32")
    ids = torch.zeros(2, 32, dtype=torch.long)
    with pytest.raises(ValueError, match="batch_size"):
        model(input_ids=ids, labels=ids)
