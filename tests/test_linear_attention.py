"""Issue 22: the gated-DeltaNet hybrids (memplan/presets/hf_linear_attention.py, layer_pattern D / d): Qwen3-Next,
Qwen3.5 (dense, MoE, their text configs) and OLMo-hybrid.

Parameters: the registry walk (tests/test_registry.py) checks each family's tiny config against transformers' count of
the model built on the meta device; here the switches those defaults leave off against the same count, the full-size
defaults against the meta-device counts recorded below, and the refusals."""

from __future__ import annotations

import pytest

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec

pytest.importorskip("transformers")

from memplan.check import registry  # noqa: E402
from validation.registry import meta_params, tiny_config  # noqa: E402


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
])
def test_the_switches_count_exactly(model_type, switches):
    config = {**tiny_config(model_type), **switches}
    assert registry.memplan_params(config) == meta_params(config) != meta_params(tiny_config(model_type))


# transformers' own count of each config class's full-size defaults, the model built on the meta device (transformers
# 5.23: `AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type]())` under `torch.device("meta")`, each parameter
# once; the command: the report of helper i22d): Qwen3-Next-80B-A3B (published: 80 B), Qwen3.5-9B's text model
# (9 B), Qwen3.5-35B-A3B's (35 B), Olmo-Hybrid-7B (7 B)
FULL_SIZE = {"qwen3_next": 79_674_391_296, "qwen3_5_text": 8_953_803_264, "qwen3_5_moe_text": 34_660_610_688,
             "olmo_hybrid": 7_430_870_688, "qwen3_5": 8_953_803_264, "qwen3_5_moe": 34_660_610_688}


@pytest.mark.parametrize("model_type", sorted(FULL_SIZE))
def test_the_full_size_defaults_count_as_the_meta_device_model(model_type):
    import json

    import transformers

    from validation.registry import architectures
    data = json.loads(json.dumps(transformers.CONFIG_MAPPING[model_type]().to_dict(), default=str))
    data.update(architectures=[architectures()[model_type]], model_type=model_type)
    assert registry.memplan_params(data) == FULL_SIZE[model_type]


@pytest.mark.parametrize("model_type, switches, says", [
    ("qwen3_next", dict(attention_bias=True), "attention_bias"),  # the gate's half of q_proj's bias: not counted
    ("qwen3_next", dict(layer_types=["linear_attention", "mamba"]), "layer_types"),
    ("qwen3_5_text", dict(linear_num_value_heads=3), "not divisible"),
    ("qwen3_next", dict(mlp_only_layers="0"), "mlp_only_layers"),
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
