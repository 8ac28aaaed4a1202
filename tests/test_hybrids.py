"""Issue 22: the state-space hybrids with Mamba-2 mixers and LFM2's short-convolution hybrid
(memplan/presets/hf_hybrids.py, ModelSpec.layer_pattern).

Parameters: the registry walk (tests/test_registry.py) checks each family's tiny config (its config class's defaults,
shrunk) against transformers' count of the model built on the meta device; here the switches those defaults leave
off (biases, the gated norm, a Granite 4 hybrid without experts, the Hub files' pattern string) against the same
count, and the refusals. Activations: the tiny Bamba (a mixer layer and an attention layer) traced with s a multiple
of the scan's chunk and compared, bucket by bucket, with what a real CPU run saves (s = 32, b = 2: two chunks of 16);
that trace given to `memplan estimate --inventory` answers, with the note on CUDA's kernels; the same for the tiny
LFM2 (a short-convolution layer and an attention layer)."""

from __future__ import annotations

import json
import math

import pytest

from memplan.core.datafile import load_json_text
from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec

pytest.importorskip("transformers")

import torch  # noqa: E402
import transformers  # noqa: E402

from memplan.check import registry  # noqa: E402
from memplan.check.validate import measured_buckets  # noqa: E402
from memplan.inventory.traced_file import TracedFile, bucket_bytes  # noqa: E402
from memplan.launch.megatron import launch_refusal  # noqa: E402
from memplan.memory.states import counter, layer_params  # noqa: E402
from memplan.presets.hf_config import read_hf_config  # noqa: E402
from validation.registry import meta_params, measure, tiny_config, trace  # noqa: E402
from validation.trace import to_yaml  # noqa: E402
from validation.trace_config import hf_config  # noqa: E402


@pytest.mark.parametrize("model_type, switches", [
    ("bamba", dict(mamba_proj_bias=True, mamba_conv_bias=False)),  # in_proj / out_proj biases, no conv bias
    ("bamba", dict(attention_bias=True, mlp_bias=True)),
    ("falcon_h1", dict(mamba_rms_norm=True, projectors_bias=True)),  # the gated norm; out_proj's own bias
    ("nemotron_h", dict(use_bias=True)),  # Nemotron-H's mixer biases are use_bias, not mamba_proj_bias
    ("nemotron_h", dict(mamba_n_groups=4, mamba_d_conv=3, mamba_conv_bias=False)),  # the Hub files' older names win
    ("granitemoehybrid", dict(num_local_experts=0)),  # no experts: the shared MLP is the layer's MLP
    ("mamba2", dict(use_bias=True, use_conv_bias=False)),
    ("lfm2", dict(conv_bias=True)),  # biases on the short convolution's in_proj, conv1d and out_proj
    ("lfm2", dict(block_auto_adjust_ff_dim=False)),  # the MLP intermediate_size wide (not 2/3 of it, rounded up)
    ("lfm2", dict(block_multiple_of=16)),  # 2/3 of intermediate_size rounded up to 16, not 256
    ("lfm2", dict(block_ffn_dim_multiplier=1.5, block_multiple_of=32)),
    ("lfm2", dict(conv_L_cache=5, tie_word_embeddings=False)),
    ("lfm2_moe", dict(num_dense_layers=0)),  # experts in every layer
    ("lfm2_moe", dict(num_dense_layers=2, conv_bias=True)),  # dense MLPs (intermediate_size) in a conv and an attention
    ("lfm2_moe", dict(moe_intermediate_size=48, num_experts=6)),
    ("lfm3", dict(use_attention_gate=False)),  # no per-head sigmoid gate (g_proj h x a)
    ("lfm3", dict(use_sandwich_norm=False)),  # no norm after each block
    ("lfm3", dict(conv_bias=True, attention_bias=True)),
    ("lfm3", dict(layer_types=None, num_hidden_layers=6)),  # the defaults' pattern: C C A C A C (conv, full, sliding)
])
def test_the_switches_count_exactly(model_type, switches):
    config = {**tiny_config(model_type), **switches}
    assert registry.memplan_params(config) == meta_params(config) != meta_params(tiny_config(model_type))


def test_the_hub_files_pattern_string_counts_exactly():
    """Nemotron-H's published config.json names its layers by hybrid_override_pattern (M mixer, * attention, - MLP, E
    experts; transformers' NemotronHConfig turns it into layers_block_type); Granite 4's by the legacy names."""
    config = {k: v for k, v in tiny_config("nemotron_h").items() if k != "layers_block_type"}
    config.update(hybrid_override_pattern="M-M*-E", num_hidden_layers=6)
    assert registry.memplan_params(config) == meta_params(config) != meta_params(tiny_config("nemotron_h"))
    # Granite 4's published files name the layer types mamba / attention (transformers' legacy spellings)
    config = {**tiny_config("granitemoehybrid"), "layer_types": ["attention", "mamba"]}
    assert registry.memplan_params(config) == meta_params(config)


def test_lfm2s_hub_file_keys_count_exactly():
    """LFM2's published config.json files name the layers by full_attn_idxs (no layer_types: the others are short
    convolutions), the MLP's width block_ff_dim and the tying tie_embedding, which Lfm2Config takes over
    intermediate_size and tie_word_embeddings."""
    config = {k: v for k, v in tiny_config("lfm2").items() if k != "layer_types"}
    config.update(num_hidden_layers=4, full_attn_idxs=[1, 3], block_ff_dim=96, intermediate_size=64,
                  tie_embedding=False, tie_word_embeddings=True)
    assert registry.memplan_params(config) == meta_params(config) != meta_params(tiny_config("lfm2"))


@pytest.mark.parametrize("model_type, switches, says", [
    ("falcon_h1", dict(mamba_d_ssm=96), "mamba_d_ssm"),  # a mixer width other than heads x head width
    ("nemotron_h", dict(moe_latent_size=16), "moe_latent_size"),
    ("nemotron_h", dict(mlp_bias=True), "mlp_bias"),  # the shared expert's biases
    ("nemotron_h", dict(layers_block_type=["linear_attention", "conv"]), "layers_block_type"),
    ("bamba", dict(attn_layer_indices=[7]), "attn_layer_indices"),
    ("lfm2", dict(layer_types=["conv", "linear_attention"]), "layer_types"),
    ("lfm2", dict(layer_types=None, full_attn_idxs=[2]), "full_attn_idxs"),
    ("lfm2", dict(block_ffn_dim_multiplier=None), "block_ffn_dim_multiplier"),  # Lfm2Config refuses it too
    ("lfm2_moe", dict(layer_types=None), "layer_types"),  # Lfm2MoeConfig fills none: transformers cannot build it
    ("lfm2_moe", dict(num_dense_layers=4), "num_dense_layers"),
])
def test_what_is_not_modelled_is_refused_in_one_line(model_type, switches, says):
    with pytest.raises(MemplanError, match=says) as err:
        registry.memplan_params({**tiny_config(model_type), **switches})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("fields, says", [
    (dict(layer_pattern="SA"), "layer_pattern has 2 characters"),
    (dict(layer_pattern="SAS"), "need ssm_heads"),
    (dict(layer_pattern="AAE"), "need num_experts"),
    (dict(ssm_heads=8), "needs layer_pattern"),
    (dict(layer_pattern="SAS", ssm_heads=8, ssm_groups=3), "not divisible"),
    (dict(layer_pattern="SAX", ssm_heads=8), "layer_pattern"),
    (dict(layer_pattern="caC"), "need num_experts"),
])
def test_the_spec_refuses_a_pattern_that_does_not_fit(fields, says):
    base = dict(num_layers=3, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=512, bias=False)
    with pytest.raises(ValueError, match=says):
        ModelSpec(**base, **fields)


def test_a_config_json_may_hold_infinity_other_data_may_not():
    """transformers writes Mamba-2's time_step_limit as [0.0, Infinity]: a config.json's reader takes it; NaN and the
    other files' Infinity stay refused."""
    assert load_json_text('{"time_step_limit": [0.0, Infinity]}', "c", infinity=True)["time_step_limit"][1] == math.inf
    for text, infinity in (('{"x": NaN}', True), ('{"x": Infinity}', False)):
        with pytest.raises(MemplanError, match="is not JSON"):
            load_json_text(text, "c", infinity=infinity)


@pytest.fixture(scope="module")
def bamba():
    config = tiny_config("bamba")
    return config, trace(config)


def test_the_traced_mixer_equals_a_real_cpu_run(bamba):
    """The trace's sizes are exact polynomials in s and b for s a multiple of the chunk (16): its condition says so,
    and at s = 32, b = 2 they equal the saved bytes of a real CPU run of transformers' torch path."""
    config, data = bamba
    assert config["mamba_chunk_size"] == 16 and "s % 16 == 0" in data["conditions"]
    assert bucket_bytes(TracedFile.model_validate(data), 32, 2) == measured_buckets(measure(config, 32, 2))


def test_estimate_answers_with_the_trace(bamba, run_cli, tmp_path):
    config, data = bamba
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "trace.yaml").write_text(to_yaml(data))
    args = ["estimate", "--hf-config", str(tmp_path / "config.json"), "--seq-len", "64"]
    code, out, err = run_cli(*args, "--impl", "hf-sdpa", "--inventory", str(tmp_path / "trace.yaml"))
    assert code == 0, err
    assert "state-space hybrid" in out and "mamba-ssm" in out and "not a multiple" not in out
    code, out, err = run_cli(*args[:-1], "72", "--impl", "hf-sdpa", "--inventory", str(tmp_path / "trace.yaml"))
    assert code == 0 and "s = 72 is not a multiple of 16" in out
    # explain's "one layer": the average of the real model's decoder layers (transformers' own, on the meta device)
    code, out, err = run_cli("explain", *args[1:], "--impl", "hf-sdpa", "--inventory", str(tmp_path / "trace.yaml"))
    with torch.device("meta"):
        layers = transformers.AutoModelForCausalLM.from_config(hf_config(config)).model.layers
    average = sum(p.numel() for p in layers.parameters()) / len(layers)
    line = next(x for x in out.splitlines() if x.startswith("parameters of one layer"))
    assert code == 0 and "average of the hybrid's layers" in line and line.endswith(f"= {average:,.0f} parameters  "
                                                                                  "[memplan/memory/states.py "
                                                                                  "param_groups (Megatron-LM's layout)]")
    code, out, err = run_cli(*args)  # --impl megatron: no mixer in its inventories
    assert code == 2 and out == "" and "use --impl hf-sdpa or hf-eager" in err and len(err.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def lfm2():
    config = tiny_config("lfm2")
    return config, trace(config)


def test_the_traced_short_convolution_equals_a_real_cpu_run(lfm2, run_cli, tmp_path):
    """LFM2's layers traced one kind at a time (a short-convolution layer, an attention layer) equal, bucket by bucket,
    what a real CPU run of transformers' torch path saves (s = 32, b = 2); the trace given to `memplan estimate`
    answers with the note on CUDA's causal-conv1d kernel (and none on Mamba-2's scan)."""
    config, data = lfm2
    assert config["layer_types"] == ["conv", "full_attention"]
    assert bucket_bytes(TracedFile.model_validate(data), 32, 2) == measured_buckets(measure(config, 32, 2))
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "trace.yaml").write_text(to_yaml(data))
    code, out, err = run_cli("estimate", "--hf-config", str(tmp_path / "config.json"), "--seq-len", "48", "--impl",
                             "hf-sdpa", "--inventory", str(tmp_path / "trace.yaml"))
    assert code == 0, err
    assert "short-convolution layers" in out and "causal-conv1d" in out and "mamba-ssm" not in out


@pytest.mark.parametrize("model_type", ["nemotron_h", "bamba", "lfm2", "lfm2_moe", "qwen3_next", "olmo_hybrid",
                                        "kimi_linear", "bailing_hybrid"])
def test_the_largest_layer_is_the_largest_of_the_real_model(model_type, tmp_path):
    """ZeRO-3 gathers one layer at a time: layer_params of a hybrid is its largest layer, block by block (Nemotron-H:
    the experts' layer; Bamba: the mixer's; LFM2: the short convolution's; LFM2-MoE: an experts' layer; the gated
    DeltaNet and KDA hybrids: their "delta" blocks'), equal to the largest decoder layer transformers builds on the meta
    device."""
    config = tiny_config(model_type)
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = read_hf_config(str(tmp_path / "config.json")).model
    with torch.device("meta"):
        built = transformers.AutoModelForCausalLM.from_config(hf_config(config))
    largest = max(sum(p.numel() for p in layer.parameters()) for layer in built.model.layers)
    assert layer_params(model, counter(model.symbols(t=1))) == largest


def test_no_megatron_launch_is_emitted_for_a_hybrid(tmp_path):
    """memplan emits Megatron-LM's GPTModel arguments; a hybrid (Megatron-LM's MambaModel) gets none, and says why."""
    (tmp_path / "config.json").write_text(json.dumps(tiny_config("bamba")))
    refusal = launch_refusal(read_hf_config(str(tmp_path / "config.json")).model)
    assert refusal and "state-space mixer blocks" in refusal and "\n" not in refusal
