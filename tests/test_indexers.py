"""Issue 22: latent attention with a lightning indexer (DeepSeek-V3.2's DeepSeek Sparse Attention, GLM-5's
GlmMoeDsa, A.X-K2 with its query gate and gated norms; ModelSpec.mla_indexer, mla_query_gate, gated_norm_rank) and the
near misses beside them (A.X-K1's norm on the MoE block's output,
moe_block_norms; Flint's sinks with Qwen3-MoE's experts and an ungated shared expert; Beam's gate on the attention
output with a bias per head, attention_gate_bias; MiMo-V2-Flash's attention by layer kind, value_head_dim,
full_attention_layers, sinks_sliding_only; memplan/presets/hf_latent.py)
read from config.json: parameters exact against transformers' meta-device count and a hand
derivation, the traced activations equal to a real CPU run, and the refusals of what memplan does not model."""

from __future__ import annotations

import json

import pytest

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.memory.shapes import weight_shapes
from memplan.memory.states import total_params
from memplan.presets.hf_config import read_hf_config

transformers = pytest.importorskip("transformers")

from memplan.check import registry  # noqa: E402
from validation.registry import meta_params, tiny_config  # noqa: E402


def _read(config: dict, tmp_path) -> ModelSpec:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return read_hf_config(str(path)).model


def test_deepseek_v32_defaults_count_by_hand(tmp_path):
    """DeepseekV32Config's defaults (DeepSeek-V3.2-Exp's published sizes) as a config.json. By hand, transformers'
    DeepseekV32ForCausalLM: h = 7168, 61 layers, 128 heads, r_q = 1536, r_kv = 512, d_n = 128, d_r = 64, d_v = 128.
    Attention per layer: q_a 7168 x 1536 = 11,010,048, q_a_layernorm 1,536, q_b 1536 x 128 x 192 = 37,748,736,
    kv_a_proj_with_mqa 7168 x 576 = 4,128,768, kv_a_layernorm 512, kv_b 512 x 128 x 256 = 16,777,216, o_proj
    128 x 128 x 7168 = 117,440,512: 187,107,328; two norms 14,336. Dense MLP (3 layers) 3 x 7168 x 18432 =
    396,361,728; MoE layer (58): 256 experts 3 x 7168 x 2048 = 11,274,289,152, router 256 x 7168 = 1,835,008, shared
    expert 3 x 7168 x 2048 = 44,040,192: 11,320,164,352. Embedding and untied head 2 x 129280 x 7168 = 1,853,358,080,
    final norm 7,168. DeepSeek-V3's total: 61 x 187,121,664 + 3 x 396,361,728 + 58 x 11,320,164,352 + 1,853,358,080
    + 7,168 = 671,026,404,352 (tests/test_mla.py). The indexer per layer (DeepseekV32Indexer, 64 heads 128 wide):
    wq_b 1536 x 8192 = 12,582,912, wk 7168 x 128 = 917,504, k_norm weight and bias 256, weights_proj 7168 x 64 =
    458,752: 13,959,424, x 61 = 851,524,864. Total 671,877,929,216."""
    config = {**transformers.DeepseekV32Config().to_dict(), "architectures": ["DeepseekV32ForCausalLM"]}
    model = _read(config, tmp_path)
    assert model.mla_indexer == (64, 128) and model.moe_first_dense_layers == 3
    assert total_params(model) == 671_877_929_216


@pytest.mark.parametrize("model_type, switches", [
    ("deepseek_v32", {}),
    ("glm_moe_dsa", {}),
    ("deepseek_v32", dict(index_n_heads=8, index_head_dim=48)),  # the indexer's own widths
    ("glm_moe_dsa", dict(mlp_layer_types=["dense", "dense", "sparse"])),  # dense layers from mlp_layer_types
    ("glm_moe_dsa", dict(indexer_types=["full"] * 3, q_lora_rank=24)),
    ("axk1", {}),  # a dense layer, then an MoE layer with its post_mlp_layernorm
    ("axk1", dict(mlp_layer_types=None, first_k_dense_replace=2, num_hidden_layers=4)),  # AXK1Config's own derivation
    ("flint", {}),  # a dense layer (the walk's mlp_only_layers [0]), then an MoE layer; sinks in both
    ("flint", dict(mlp_only_layers=[0, 1], num_hidden_layers=3, layer_types=None,
                   shared_expert_intermediate_size=48, attention_bias=True)),  # q, k, v, o_proj biased (Qwen3MoeAttention)
    ("axk2", {}),  # q_gate_proj 2 r_q wide, the indexer, gated input norms; the MoE layer's post-attention norm gated
    ("axk2", dict(gated_norm_rank=8, mlp_layer_types=["dense", "dense", "sparse"], num_hidden_layers=3,
                  layer_types=None)),
    ("beam", {}),  # a dense layer, then an MoE one; gate_proj h x q and gate_bias a in each
    ("beam", dict(head_dim=32, mlp_layer_types=["dense", "dense", "sparse"], num_hidden_layers=3, layer_types=None)),
])
def test_the_indexer_families_count_exactly(model_type, switches, tmp_path):
    """memplan's count equals transformers' model on the meta device (the walk's tiny config: a dense layer, then
    two MoE layers, each with its indexer), and the tensors weight_shapes lists hold the same parameters."""
    config = {**tiny_config(model_type), **switches}
    assert registry.memplan_params(config) == meta_params(config)
    model = _read(config, tmp_path)
    values, k = model.symbols(t=1), model.moe_first_dense_layers
    for layout in ("fused", "separate"):
        shapes = weight_shapes(model, layout)
        held = sum(times * w.count * int(w.numel.evaluate(values)) for scope, times in (
            ("first", 1), ("dense_layer", k), ("layer", model.num_layers - k), ("last", 1), ("head", 1))
            for w in shapes[scope])
        assert held == total_params(model)


@pytest.mark.parametrize("switches", [
    {},  # a full-attention layer (2 K / V heads, no sinks), then a sliding one (4 K / V heads, sinks)
    dict(head_dim=32, attention_bias=True),  # Q / K heads 32 wide, V heads 16; biases on q, k, v
    dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                           "full_attention"], mlp_layer_types=["dense", "dense", "sparse", "sparse"]),
    dict(layer_types=["full_attention"] * 2),  # no sliding layer: no sinks, num_key_value_heads everywhere
    dict(layer_types=["sliding_attention"] * 2),  # no full layer: sinks and twice the K / V heads everywhere
])
def test_mimo_v2_flash_counts_exactly_by_layer_kind(switches, tmp_path):
    """The trace checks the activations (the walk); the parameters against the meta-device model, and the tensors
    weight_shapes lists against the groups where every layer's attention is alike (all full or all sliding)."""
    config = {**tiny_config("mimo_v2_flash"), **switches}
    assert registry.memplan_params(config) == meta_params(config)
    model = _read(config, tmp_path)
    if model.full_layers in (0, model.num_layers):
        values, k = model.symbols(t=1), model.moe_first_dense_layers
        for layout in ("fused", "separate"):
            held = sum(times * w.count * int(w.numel.evaluate(values)) for scope, times in (
                ("first", 1), ("dense_layer", k), ("layer", model.num_layers - k), ("last", 1), ("head", 1))
                for w in weight_shapes(model, layout)[scope])
            assert held == total_params(model)


def test_the_indexer_switches_change_the_count():
    """The indexer's widths are read, not defaulted: another head count gives another (exact) count."""
    base, wider = tiny_config("deepseek_v32"), {**tiny_config("deepseek_v32"), "index_n_heads": 8}
    assert registry.memplan_params(wider) - registry.memplan_params(base) == 3 * 4 * (32 * 32 + 64) \
        == meta_params(wider) - meta_params(base)  # 3 layers x 4 more heads x (wq_b's r_q x D + weights_proj's h)


def test_layers_without_their_own_indexer_are_refused_in_one_line():
    """GLM-5's "shared" layers reuse an earlier layer's top-k and build no indexer: not modelled, said in one line."""
    for switches in (dict(indexer_types=["full", "shared", "full"]), dict(indexer_types=None, index_topk_pattern="FSF"),
                     dict(indexer_types=None, index_topk_freq=2)):
        with pytest.raises(MemplanError, match="indexer in every layer") as err:
            registry.memplan_params({**tiny_config("glm_moe_dsa"), **switches})
        assert "\n" not in str(err.value) and "model YAML" in str(err.value)


def test_a_pattern_of_moe_layers_other_than_dense_first_is_refused_in_one_line():
    with pytest.raises(MemplanError, match="mlp_layer_types") as err:  # AXK1Config: every second layer MoE
        registry.memplan_params({**tiny_config("axk1"), "mlp_layer_types": None, "moe_layer_freq": 2,
                                 "num_hidden_layers": 4})
    assert "\n" not in str(err.value) and "model YAML" in str(err.value)
    with pytest.raises(MemplanError, match="first_k_dense_replace: expected a count of layers"):  # was: all dense
        registry.memplan_params({**tiny_config("axk1"), "mlp_layer_types": None, "first_k_dense_replace": "2"})
    with pytest.raises(MemplanError, match="mlp_only_layers") as err:  # Flint: a dense layer after an MoE one
        registry.memplan_params({**tiny_config("flint"), "mlp_only_layers": [1]})
    assert "\n" not in str(err.value) and "model YAML" in str(err.value)


def test_a_gate_bias_needs_the_gate_and_the_attention_fields_agree():
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=512)
    with pytest.raises(ValueError, match="needs attention_output_gate"):
        ModelSpec(**base, attention_gate_bias=True)
    with pytest.raises(ValueError, match="needs attention_sinks"):
        ModelSpec(**base, sinks_sliding_only=True)
    with pytest.raises(ValueError, match="exceeds num_layers"):
        ModelSpec(**base, full_attention_layers=3)
    with pytest.raises(ValueError, match="latent attention's is v_head_dim"):
        ModelSpec(**base, bias=False, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                  value_head_dim=8)
    gated = ModelSpec(**base, attention_output_gate="full", attention_gate_bias=True)
    assert total_params(gated) - total_params(ModelSpec(**base, attention_output_gate="full")) == 2 * 4  # a per layer


def test_the_gated_norms_and_the_query_gate_count_by_hand():
    """A.X-K2's additions to DeepSeek-V3.2's layer, per the modelling code: q_gate_proj 2 r_q x a (d_n + d_r + d_v) in
    place of q_b_proj r_q x a (d_n + d_r); a gated norm's fc1 h x r and fc2 r x h (no biases), one per layer and a
    second in each MoE layer. 2 layers (one dense), h = 64, a = 4, r_q = 32, d_n 16, d_r 8, d_v 16, r = 16:
    q_gate_proj - q_b_proj = 2 x (64 x 160 - 32 x 96) = 14,336; the gates 3 x 2 x 64 x 16 = 6,144."""
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=512, bias=False,
                kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_experts=4,
                moe_top_k=2, moe_first_dense_layers=1)
    plain = total_params(ModelSpec(**base))
    assert total_params(ModelSpec(**base, mla_query_gate=True)) - plain == 14_336
    assert total_params(ModelSpec(**base, gated_norm_rank=16)) - plain == 6_144
    with pytest.raises(ValueError, match="needs q_lora_rank"):
        ModelSpec(**{**base, "q_lora_rank": None}, mla_query_gate=True)


def test_the_indexer_needs_latent_attention_with_a_query_latent():
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=512, bias=False)
    mla = dict(kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    with pytest.raises(ValueError, match="needs kv_lora_rank"):
        ModelSpec(**base, mla_indexer=(4, 32))
    with pytest.raises(ValueError, match="q_lora_rank"):
        ModelSpec(**base, **mla, mla_indexer=(4, 32))
    with pytest.raises(ValueError, match="qk_rope_head_dim=8"):
        ModelSpec(**base, **mla, q_lora_rank=32, mla_indexer=(4, 4))
    assert ModelSpec(**base, **mla, q_lora_rank=32, mla_indexer=(4, 32)).mla_indexer == (4, 32)


@pytest.mark.parametrize("model_type, args, says", [
    ("deepseek_v32", ["--impl", "megatron"], "--impl megatron: the lightning indexer"),
    ("glm_moe_dsa", ["--impl", "megatron-local"], "--impl megatron-local: the lightning indexer"),
    ("deepseek_v32", ["--emit", "megatron"], "experimental DSA"),
    ("axk1", ["--emit", "megatron"], "norms in the MoE block"),
    ("flint", ["--emit", "megatron"], "attention sinks"),
    ("beam", ["--emit", "megatron"], "a gate on the attention output"),
    ("axk2", ["--impl", "megatron"], "--impl megatron: the lightning indexer"),
    ("mimo_v2_flash", ["--impl", "megatron"], "V heads narrower than the Q / K heads (value_head_dim)"),
    ("mimo_v2_flash", ["--emit", "megatron"], "V heads narrower than the Q / K heads"),
])
def test_megatron_refuses_what_it_does_not_build_in_one_line(run_cli, tmp_path, model_type, args, says):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_config(model_type)))
    code, out, err = run_cli("estimate", "--hf-config", str(path), *args)
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_the_trace_equals_a_real_cpu_run_on_both_sides_of_the_top_k(run_cli, tmp_path):
    """The indexer's top-k (index_topk 16 in the tiny config) guards the trace (s >= 16: k = min(16, s)); it runs under
    torch.no_grad, so what autograd saves (the attention's s x s mask with the unselected keys masked) does not depend
    on the side: the trace, read by memplan, equals a real CPU run's saved bytes at s = 32 (16 of 32 keys kept) and at
    s = 8 (every key kept), bucket by bucket; an estimate at s = 8 says which guard it is outside of (not a fit)."""
    from memplan.check.validate import measured_buckets
    from memplan.inventory.traced_file import TracedFile, bucket_bytes
    from validation.registry import measure, trace
    from validation.trace import to_yaml

    config = tiny_config("deepseek_v32")
    data = trace(config)
    traced = TracedFile.model_validate(data)
    assert traced.conditions == ["s >= 16", "b >= 2"]
    for s in (32, 8):
        assert bucket_bytes(traced, s, 2) == measured_buckets(measure(config, s, 2)), s
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "trace.yaml").write_text(to_yaml(data))
    code, out, err = run_cli("estimate", "--hf-config", str(tmp_path / "config.json"), "--seq-len", "8", "--impl",
                             "hf-sdpa", "--inventory", str(tmp_path / "trace.yaml"))
    assert code == 0, err
    assert "s = 8 is outside the trace (s >= 16: the side of a guard on s the trace took" in " ".join(out.split())


def test_axk1_says_megatron_approximates_its_moe_block_norm(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_config("axk1")))
    preset = read_hf_config(str(path))
    assert preset.model.moe_block_norms == 1
    assert any("post_mlp_layernorm" in n and "approximates" in n for n in preset.notes)


def test_mimo_v2_flash_with_narrower_v_heads_traces_equal_to_a_real_cpu_run():
    """The walk's tiny MiMo has V heads as wide as Q / K's; with head_dim 32 beside v_head_dim 16 its trace (eager:
    transformers gives it no sdpa path), read by memplan, still equals a real CPU run's saved bytes at s = 32, b = 2."""
    config = {**tiny_config("mimo_v2_flash"), "head_dim": 32}
    row = registry.trace_row(registry.Row("mimo_v2_flash", "MiMoV2FlashForCausalLM"), config)
    assert row.traced and row.measured, row.trace_error
