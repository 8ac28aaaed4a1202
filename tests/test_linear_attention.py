"""Issue 22: the gated-DeltaNet hybrids (memplan/presets/hf_linear_attention.py, layer_pattern D / d): Qwen3-Next,
Qwen3.5 (dense, MoE, their text configs) and OLMo-hybrid.

Parameters: the registry walk (tests/test_registry.py) checks each family's tiny config against transformers' count of
the model built on the meta device; here the switches those defaults leave off against the same count, the full-size
defaults against the meta-device counts recorded below, and the refusals. Activations: the tiny Qwen3-Next (a DeltaNet
layer and a gated-attention layer, experts with a gated shared expert) traced at concrete s and b and fitted
(validation/trace_fit.py: the delta rule's Python loop over chunks of 64), compared bucket by bucket with a real CPU run
at an (s, b) the fit did not see; the fit's own check refusing bytes that are no such polynomial."""

from __future__ import annotations

import json
import os

import pytest

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.core.symbolic import Poly

pytest.importorskip("transformers")

import torch  # noqa: E402
import transformers  # noqa: E402

from memplan.check import registry  # noqa: E402
from memplan.check.validate import measured_buckets  # noqa: E402
from memplan.inventory.traced_file import TracedFile, bucket_bytes  # noqa: E402
from memplan.presets.hf_config import read_hf_config  # noqa: E402
from validation import trace_fit  # noqa: E402
from validation.registry import architectures, measure, meta_params, tiny_config, trace  # noqa: E402
from validation.trace import to_yaml  # noqa: E402
from validation.trace_poly import TraceRefused, evaluate, poly_text  # noqa: E402


@pytest.mark.parametrize("model_type, switches", [
    ("qwen3_next", dict(mlp_only_layers=[0])),  # a dense SwiGLU MLP (intermediate_size) in the DeltaNet layer
    ("qwen3_next", dict(decoder_sparse_step=2)),  # experts in every second layer only (the attention one)
    ("qwen3_next", dict(num_experts=0)),  # no experts: every layer's MLP dense
    ("qwen3_next", dict(layer_types=None, full_attention_interval=2, num_hidden_layers=4)),  # D A D A
    ("qwen3_next", dict(linear_num_value_heads=8, linear_conv_kernel_dim=3)),  # 4 value heads per key head
    ("qwen3_next", dict(shared_expert_intermediate_size=48, head_dim=32)),
    ("qwen3_5_text", dict(layer_types=["linear_attention", "linear_attention", "full_attention"],
                          num_hidden_layers=3)),
    ("qwen3_5_text", dict(linear_key_head_dim=16, linear_value_head_dim=8)),
    ("qwen3_5_moe_text", dict(num_experts=6, moe_intermediate_size=48)),
    ("olmo_hybrid", dict(linear_num_key_heads=None, linear_num_value_heads=None, linear_key_head_dim=None,
                         linear_value_head_dim=None)),  # the defaults: a heads, keys 0.75 h / a wide, values twice
    ("olmo_hybrid", dict(attention_bias=True, num_key_value_heads=2)),  # q, k, v, o biases; K / V heads
    ("olmo_hybrid", dict(layer_types=None, num_hidden_layers=5)),  # the defaults: every fourth layer attention
    # Kimi Linear as its published file writes it: the KDA's widths and layers in linear_attn_config (numbered from 1)
    ("kimi_linear", dict(layer_types=None, num_hidden_layers=3, mlp_layer_types=None, linear_attn_config=dict(
        full_attn_layers=[2], kda_layers=[1, 3], num_heads=2, head_dim=8, short_conv_kernel_size=3))),
    ("kimi_linear", dict(layer_types=None, mlp_layer_types=None, num_hidden_layers=6)),  # defaults: 5th full, 1 dense
    ("kimi_linear", dict(q_lora_rank=24, mlp_layer_types=["sparse", "sparse"])),  # Q through a latent; no dense MLP
    ("bailing_hybrid", dict(layer_types=None, mlp_layer_types=None, layer_group_size=2, num_hidden_layers=4)),
    ("bailing_hybrid", dict(mlp_layer_types=["dense"] * 3, num_experts=8)),  # no MoE layer: every MLP dense
])
def test_the_switches_count_exactly(model_type, switches):
    config = {**tiny_config(model_type), **switches}
    assert registry.memplan_params(config) == meta_params(config) != meta_params(tiny_config(model_type))


# transformers' own count of each config class's full-size defaults, the model built on the meta device (transformers
# 5.23: `AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type]())` under `torch.device("meta")`, each parameter
# once; the command: the report of helper i22d): Qwen3-Next-80B-A3B (published: 80 B), Qwen3.5-9B's text model
# (9 B), Qwen3.5-35B-A3B's (35 B), Olmo-Hybrid-7B (7 B)
# Kimi-Linear-48B-A3B (published: 48 B), Ling 3.0's BailingHybridConfig defaults (the report of helper i22k)
FULL_SIZE = {"kimi_linear": 49_133_074_464, "bailing_hybrid": 124_414_191_072,
             "qwen3_next": 79_674_391_296, "qwen3_5_text": 8_953_803_264, "qwen3_5_moe_text": 34_660_610_688,
             "olmo_hybrid": 7_430_870_688, "qwen3_5": 8_953_803_264, "qwen3_5_moe": 34_660_610_688}


@pytest.mark.parametrize("model_type", sorted(FULL_SIZE))
def test_the_full_size_defaults_count_as_the_meta_device_model(model_type):
    data = json.loads(json.dumps(transformers.CONFIG_MAPPING[model_type]().to_dict(), default=str))
    data.update(architectures=[architectures()[model_type]], model_type=model_type)
    assert registry.memplan_params(data) == FULL_SIZE[model_type]


def test_a_multimodal_qwen3_5_file_is_read_as_its_text_model(tmp_path):
    """Qwen3.5's published files name Qwen3_5MoeForConditionalGeneration (not in memplan's table) with a text_config
    (qwen3_5_moe_text) beside a vision_config: the text model is read, the vision tower left out, a note says."""
    data = json.loads(json.dumps(transformers.CONFIG_MAPPING["qwen3_5_moe"]().to_dict(), default=str))
    data["architectures"] = ["Qwen3_5MoeForConditionalGeneration"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    preset = read_hf_config(str(tmp_path / "config.json"))
    assert registry.total_params(preset.model) == FULL_SIZE["qwen3_5_moe_text"]
    assert any("text model only" in n and "vision" in n for n in preset.notes)


@pytest.mark.parametrize("model_type, switches, says", [
    ("qwen3_next", dict(attention_bias=True), "attention_bias"),  # the gate's half of q_proj's bias: not counted
    ("qwen3_next", dict(layer_types=["linear_attention", "mamba"]), "layer_types"),
    ("qwen3_5_text", dict(linear_num_value_heads=3), "not divisible"),
    ("qwen3_next", dict(mlp_only_layers="0"), "mlp_only_layers"),
    ("kimi_linear", dict(layer_types=None, linear_attn_config=dict(full_attn_layers=[2], kda_layers=[2])),
     "linear_attn_config"),  # layer 1 in neither list
    ("kimi_linear", dict(attention_bias=True), "attention_bias"),
    ("bailing_hybrid", dict(mlp_layer_types=["dense", "moe", "dense"]), "mlp_layer_types"),
])
def test_layouts_memplan_does_not_count_are_refused(model_type, switches, says):
    with pytest.raises(MemplanError, match=says) as err:
        registry.memplan_params({**tiny_config(model_type), **switches})
    assert "\n" not in str(err.value)


def test_a_pattern_cannot_mix_mamba_mixers_and_deltanets():
    """The two mixers share the ssm_* widths: a model YAML with both is refused, as is d without experts."""
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=128, vocab_size=512, ssm_heads=4,
                bias=False)
    with pytest.raises(ValueError, match="one kind per model"):
        ModelSpec(**base, layer_pattern="SD")
    with pytest.raises(ValueError, match="num_experts"):
        ModelSpec(**base, layer_pattern="dA")
    assert ModelSpec(**base, layer_pattern="DA").layer_blocks["delta"] == 1
    with pytest.raises(ValueError, match="one kind per model"):
        ModelSpec(**base, layer_pattern="KD")
    with pytest.raises(ValueError, match="latent attention"):  # latent attention beside KDA only
        ModelSpec(**base, layer_pattern="DA", kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
    assert ModelSpec(**base, layer_pattern="KA", kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
                     v_head_dim=16).layer_blocks["delta"] == 1


def test_a_published_ling_file_takes_the_kda_widths_from_the_attention_heads():
    """Ling 3.0's published config.json has no linear_* keys (BailingHybridConfig derives them: linear_num_heads =
    num_attention_heads, linear_head_dim = head_dim, linear_conv_kernel_dim = short_conv_kernel_size)."""
    config = tiny_config("bailing_hybrid")
    for key in ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"):
        del config[key]
    config.update(head_dim=16, short_conv_kernel_size=3)
    assert registry.memplan_params(config) == meta_params(config) != meta_params(tiny_config("bailing_hybrid"))


@pytest.fixture(scope="module")
def qwen3_next():
    config = tiny_config("qwen3_next")
    return config, trace(config)


def test_the_fitted_trace_equals_a_real_cpu_run_where_it_was_not_fitted(qwen3_next, run_cli, tmp_path):
    """Fitted at s = 128, 192, 256 and b = 2, 3 (checked at s = 320, b = 4), the trace's polynomials equal, bucket by
    bucket, what a real CPU run of transformers' torch path saves at s = 384, b = 2 (six chunks of the delta rule);
    its conditions say that it was fitted, and the estimate with it notes the torch path and the kernels left out."""
    config, data = qwen3_next
    assert config["layer_types"] == ["linear_attention", "full_attention"]
    assert "s % 64 == 0" in data["conditions"] and any(c.startswith("fitted:") for c in data["conditions"])
    traced = TracedFile.model_validate(data)
    assert bucket_bytes(traced, 384, 2) == measured_buckets(measure(config, 384, 2))
    assert registry.measured_s(traced, 32) == 128  # the walk checks at two chunks, not at s = 32
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "trace.yaml").write_text(to_yaml(data))
    code, out, err = run_cli("estimate", "--hf-config", str(tmp_path / "config.json"), "--seq-len", "256", "--impl",
                             "hf-sdpa", "--inventory", str(tmp_path / "trace.yaml"))
    assert code == 0, err
    assert "gated DeltaNet" in out and "chunk_gated_delta_rule" in out and "fitted" in out
    assert "s = 256 is outside" not in out and "not a multiple" not in out
    code, out, err = run_cli("estimate", "--hf-config", str(tmp_path / "config.json"), "--seq-len", "64", "--impl",
                             "hf-sdpa", "--inventory", str(tmp_path / "trace.yaml"))
    assert code == 0 and "s = 64 is outside the trace (s >= 128: the least s its saves were fitted from)" in out


def _synthetic(nbytes):
    """A concrete_saves stand-in: one storage of ``nbytes(s, b)`` bytes and a loop's worth (s / 64) of 256-byte
    ones (their ids differ in the call counter k only: one group)."""
    def saves(model, mode, forward, make_inputs, s, b, *rest):
        one = dict(module="model.layers.0.linear_attn", op="torch.matmul", j=0, dtype=torch.float32,
                   savers={"model.layers.0.linear_attn": 0})
        return [dict(one, k=0, j=1, nbytes=nbytes(s, b))] + [dict(one, k=1 + i, nbytes=256) for i in range(s // 64)]
    return saves


def test_the_fit_recovers_a_polynomial_and_refuses_what_the_held_out_point_contradicts(monkeypatch):
    monkeypatch.setattr(trace_fit, "concrete_saves", _synthetic(lambda s, b: 12 * s * s * b + 40 * s * b + 8))
    run = trace_fit.fitted_run(None, None, None, None, 64)
    assert [str(st["nbytes"]) for st in run["storages"]] == ["12*b*s**2 + 40*b*s + 8", "4*s"]
    assert evaluate("4 s", 640, 2) == 2560  # ten chunks of 256 bytes
    monkeypatch.setattr(trace_fit, "concrete_saves", _synthetic(lambda s, b: s ** 3))
    with pytest.raises(TraceRefused, match="held-out s = 320, b = 4"):
        trace_fit.fitted_run(None, None, None, None, 64)


def test_a_fitted_negative_constant_is_written_and_read_back(monkeypatch):
    """Kimi Delta Attention's loop over the chunks saves a matmul in all but one chunk (704 s b - 4096 b bytes in the
    tiny Kimi Linear's trace): the fit writes the negative constant, and memplan's Poly and validation's evaluate read
    it back."""
    monkeypatch.setattr(trace_fit, "concrete_saves", _synthetic(lambda s, b: 704 * s * b - 4096 * b))
    run = trace_fit.fitted_run(None, None, None, None, 64)
    text = poly_text(run["storages"][0]["nbytes"])
    assert text == "704 s b + -4096 b"
    assert Poly.parse_sum(text).evaluate(dict(s=384, b=3)) == evaluate(text, 384, 3) == 704 * 384 * 3 - 4096 * 3


# opt-in (~3 s of CPU each; the suite's time is near its limit):
#   MEMPLAN_FIT_SLOW=1 PYTHONPATH=. pytest tests/test_linear_attention.py -k real_cpu_runs
SLOW = pytest.mark.skipif(not os.environ.get("MEMPLAN_FIT_SLOW"), reason="set MEMPLAN_FIT_SLOW=1 to run")


@SLOW
@pytest.mark.parametrize("model_type", ["qwen3_5", "olmo_hybrid"])
def test_the_other_deltanet_hybrids_fitted_equal_real_cpu_runs(model_type):
    """Qwen3.5's multimodal config (its text_config traced) and OLMo-hybrid (post-norm attention beside pre-norm
    DeltaNets), fitted, equal real CPU runs at an (s, b) the fit never saw."""
    config = tiny_config(model_type)
    traced = TracedFile.model_validate(trace(config))
    assert bucket_bytes(traced, 384, 3) == measured_buckets(measure(config, 384, 3))


@SLOW
@pytest.mark.parametrize("model_type", ["kimi_linear", "bailing_hybrid"])
def test_the_kda_hybrids_fitted_equal_real_cpu_runs(model_type):
    """Kimi Linear and Bailing-hybrid (chunk_kimi_delta_attention's loop over chunks of 64, latent attention beside
    it), fitted at s = 128, 192, 256, equal real CPU runs at an (s, b) the fit never saw (10 to 40 s of CPU each)."""
    config = tiny_config(model_type)
    traced = TracedFile.model_validate(trace(config))
    assert any(c.startswith("fitted:") for c in traced.conditions)
    assert bucket_bytes(traced, 384, 3) == measured_buckets(measure(config, 384, 3))


@SLOW
@pytest.mark.parametrize("model_type", ["gpt_neo", "openai-gpt", "mpt"])
def test_a_buffer_sliced_to_s_is_fitted_and_equals_real_cpu_runs(model_type):
    """GPT-Neo's and GPT-1's causal-mask buffers and MPT's ALiBi bias, sliced to s, pin a symbolic s: their saves are
    fitted at s = 32, 48, 64 (checked at 80 and 83), and equal what real CPU runs save at s and b the fit never saw,
    past GPT-Neo's 256-token local window too."""
    config = tiny_config(model_type)
    traced = TracedFile.model_validate(trace(config))
    assert any(c.startswith("fitted:") for c in traced.conditions)
    assert not any("%" in c for c in traced.conditions)  # any s, not a multiple of the fit's step
    for s, b in ((100, 3), (300, 2)):
        assert bucket_bytes(traced, s, b) == measured_buckets(measure(config, s, b))
