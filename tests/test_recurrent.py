"""Issue 22: the recurrent decoders (memplan/presets/hf_recurrent.py): RecurrentGemma (Griffin's RG-LRU blocks beside
local attention, layer_pattern R / A), RWKV (layer_pattern W), MiniMax-01 (lightning attention beside softmax
attention, layer_pattern L / A), xLSTM (mLSTM blocks, layer_pattern X: parameters only, its bf16 code does not
run), JetMoE (mixture of attention experts, layer_pattern O: parameters only, its routing data-dependent) and Doge
(dynamic-mask attention and residual scales: ModelSpec.dynamic_mask, traced symbolically) and HRM (two stacks run in
a loop: ModelSpec.looped_stacks, parameters only).

Parameters: the registry walk (tests/test_registry.py) checks the tiny configs against transformers' count of the
model built on the meta device; here the switches those defaults leave off against the same count, the full-size
defaults against hand derivations, and the refusals. Activations: the tiny RecurrentGemma (two recurrent layers and a
local attention one, its window 16 tokens), RWKV and MiniMax traced at concrete s and b (past the window) and fitted
(validation/trace_fit.py: the RG-LRU's and the WKV's Python loops over the tokens, the lightning attention's over blocks
of s), compared bucket by bucket with real CPU runs at an (s, b) the fit did not see."""

from __future__ import annotations

import json
import os

import pytest

from memplan.core.model import ModelSpec
from memplan.core.errors import MemplanError

pytest.importorskip("transformers")

import transformers  # noqa: E402

from memplan.check import registry  # noqa: E402
from memplan.check.validate import measured_buckets  # noqa: E402
from memplan.inventory.traced_file import TracedFile, bucket_bytes  # noqa: E402
from validation import trace_fit  # noqa: E402
from validation.registry import measure, meta_params, tiny_config, trace  # noqa: E402
from validation.trace import to_yaml  # noqa: E402
from validation.trace_poly import TraceRefused  # noqa: E402


@pytest.mark.parametrize("model_type, switches", [
    ("recurrent_gemma", dict(lru_width=128)),  # the RG-LRU's gates 4 heads of 32
    ("recurrent_gemma", dict(block_types=["recurrent", "attention"], num_hidden_layers=4)),  # R A R A
    ("recurrent_gemma", dict(block_types=["attention"])),  # attention only
    ("recurrent_gemma", dict(attention_bias=True, num_key_value_heads=1)),  # q, k, v biases beside o_proj's; 1 K / V
    ("recurrent_gemma", dict(conv1d_width=3, tie_word_embeddings=False, intermediate_size=100)),  # MLP f / 2 wide
    ("recurrent_gemma", dict(lru_width=None)),  # RecurrentGemmaConfig's default: h wide
    ("rwkv", dict(attention_hidden_size=None, intermediate_size=None)),  # RwkvConfig's defaults: h and 4 h
    ("rwkv", dict(tie_word_embeddings=True, num_hidden_layers=3)),
    ("minimax", dict(layer_types=["linear_attention", "linear_attention", "full_attention"], num_hidden_layers=3)),
    ("minimax", dict(layer_types=None, num_hidden_layers=4)),  # MiniMaxConfig's alternation: A L A L
    ("minimax", dict(head_dim=32, num_key_value_heads=1, tie_word_embeddings=True)),  # both attentions' heads 32 wide
    ("minimax", dict(num_local_experts=6, num_experts_per_tok=1, intermediate_size=96)),
    ("xlstm", dict(weight_mode="fused", num_heads=4)),  # qkv_opreact and ifgate_preact fused: the same count
    ("xlstm", dict(qk_dim_factor=0.25, v_dim_factor=0.5, ffn_proj_factor=2.0, ffn_round_up_to_multiple_of=48)),
    ("xlstm", dict(num_blocks=3, tie_word_embeddings=True)),  # num_blocks is what xLSTMModel builds
    ("jetmoe", dict(num_key_value_heads=4, kv_channels=8, num_experts_per_tok=1)),  # 4 query heads of 8
    ("jetmoe", dict(num_local_experts=6, intermediate_size=96, tie_word_embeddings=False)),
    ("doge", dict(attention_bias=True)),  # q, k, v, o and dt_proj biased
    ("doge", dict(attention_bias=True, mlp_bias=True)),  # every linear biased
    ("doge", dict(num_key_value_heads=1, head_dim=32, tie_word_embeddings=True)),
    ("hrm_text", dict(num_layers_per_stack=3, num_hidden_layers=24)),
    ("hrm_text", dict(head_dim=8, intermediate_size=96, tie_word_embeddings=True)),
    # a file without num_layers_per_stack: num_hidden_layers is the per-stack count (HrmTextConfig inflates it)
    ("hrm_text", dict(num_layers_per_stack=None, num_hidden_layers=3)),
])
def test_the_switches_count_exactly(model_type, switches):
    config = {**tiny_config(model_type), **switches}
    assert registry.memplan_params(config) == meta_params(config) != meta_params(tiny_config(model_type))


def test_the_full_size_defaults_count_by_hand():
    """RecurrentGemmaConfig's defaults (recurrentgemma-2b's widths, K / V heads a): L = 26 layers, block_types
    (recurrent, recurrent, attention) repeated: 18 recurrent, 8 attention; h = W = 2560, a = g = 10, d = h / a = 256,
    conv 4, f = 7680 / 2 = 3840, v = 256000, tied.
      recurrent block: linear_x, linear_y 2 (h W + W) = 13,112,320; conv_1d W 4 + W = 12,800; the RG-LRU's gates
        2 a (W / a)^2 + 2 W = 1,315,840 and recurrent_param W = 2,560; linear_out W h + h = 6,556,160: 20,999,680
      attention block: q, k, v 3 h a d = 19,660,800, o_proj a d h + h = 6,556,160: 26,216,960
      each layer: MLP 3 h f + 2 f + h = 29,501,440, two norms 2 h = 5,120
      18 x 20,999,680 + 8 x 26,216,960 + 26 x 29,506,560 = 1,354,900,480; embedding v h = 655,360,000; final norm 2,560
      total 2,010,263,040 (transformers' count of the model on the meta device is the same)."""
    data = json.loads(json.dumps(transformers.RecurrentGemmaConfig().to_dict(), default=str))
    data.update(architectures=["RecurrentGemmaForCausalLM"], model_type="recurrent_gemma")
    assert registry.memplan_params(data) == 2_010_263_040


def test_rwkv_full_size_defaults_count_by_hand():
    """RwkvConfig's defaults (RWKV-4 7B's widths): L = 32, h = A = 4096, f = 4 h = 16384, v = 50277, untied.
      each block: time mixing key, value, receptance, output 4 h A = 67,108,864, time_decay and time_first 2 A =
        8,192, three time_mix vectors 3 h; channel mixing key and value 2 h f = 134,217,728, receptance h^2 =
        16,777,216, two time_mix vectors 2 h; two LayerNorms 4 h: 218,148,864 in all
      32 x 218,148,864 = 6,980,763,648; embedding and head 2 v h = 411,869,184; pre_ln and ln_out 4 h = 16,384
      total 7,392,649,216 (transformers' count of the model on the meta device is the same)."""
    data = json.loads(json.dumps(transformers.RwkvConfig().to_dict(), default=str))
    data.update(architectures=["RwkvForCausalLM"], model_type="rwkv")
    assert registry.memplan_params(data) == 7_392_649_216


def test_minimax_full_size_defaults_count_by_hand():
    """MiniMaxConfig's defaults: L = 32 alternating full (layer 0, 2, ...) and lightning attention, h = 4096, a = 32
    heads of d = h / a = 128 (q = 4096), g = 8 K / V heads, 8 experts f = 14336 wide, v = 32000, untied.
      full attention: q, o 2 h q + k, v 2 h g d = 41,943,040; lightning attention: qkv_proj, output_gate, out_proj
        5 h q + its norm q = 83,890,176
      each layer: experts 8 x 3 h f = 1,409,286,144, router 8 h = 32,768, two norms 2 h = 8,192
      16 x 41,943,040 + 16 x 83,890,176 + 32 x 1,409,327,104 = 47,111,798,784; embedding and head 2 v h = 262,144,000;
      final norm 4,096; total 47,373,946,880 (transformers' count of the model on the meta device is the same)."""
    data = json.loads(json.dumps(transformers.MiniMaxConfig().to_dict(), default=str))
    data.update(architectures=["MiniMaxForCausalLM"], model_type="minimax")
    assert registry.memplan_params(data) == 47_373_946_880


def test_xlstm_full_size_defaults_count_by_hand():
    """xLSTMConfig's defaults (xLSTM-7B's widths): 32 mLSTM blocks, h = 4096, 8 heads, q / k int(0.5 h) = 2048 wide,
    v and the output gate int(1.0 h) = 4096, the MLP 2.667 h = 10924.03 rounded up to a multiple of 64: 10944;
    v = 50304, untied.
      each block: q, k, v, ogate, out_proj h (2 x 2048 + 3 x 4096) = 67,108,864; input and forget gates 2 x 8 (h + 1)
        = 65,552; multi-head norm 4096; MLP 3 h 10944 = 134,479,872; two norms 2 h: 201,666,576 in all
      32 x 201,666,576 = 6,453,330,432; embedding and head 2 v h = 412,090,368; out_norm 4,096
      total 6,865,424,896 (transformers' count of the model on the meta device is the same)."""
    data = json.loads(json.dumps(transformers.xLSTMConfig().to_dict(), default=str))
    data.update(architectures=["xLSTMForCausalLM"], model_type="xlstm")
    assert registry.memplan_params(data) == 6_865_424_896


def test_xlstm_activations_are_refused_in_one_line(run_cli, tmp_path):
    """transformers' torch mLSTM kernel fails for a bf16 model (what the trace builds) once s reaches a chunk (64 tokens;
    shorter sequences run token by token); a real CPU run shows it, and memplan refuses --impl hf-* with that reason
    before tracing."""
    config = tiny_config("xlstm")
    with pytest.raises(RuntimeError, match="same dtype"):
        measure(config, 64, 2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, out, err = run_cli("estimate", "--hf-config", str(tmp_path / "config.json"), "--impl", "hf-eager")
    assert code == 2 and "mlstm_chunkwise_native_autograd" in err and len(err.strip().splitlines()) == 1


def test_jetmoe_full_size_defaults_count_by_hand():
    """JetMoeConfig's defaults (JetMoE-8B's widths): L = 12, h = 2048, 16 K / V heads of kv_channels 128 (g d = 2048),
    8 experts, top 2, f = 5632, v = 32000, tied.
      attention: each expert's query and output projections 8 x 2 h g d = 67,108,864, router 8 h = 16,384, kv_proj
        2 h g d = 8,388,608, output bias h = 2,048: 75,515,904
      MLP: experts 8 x 3 h f = 276,824,064, router 8 h = 16,384, output bias h = 2,048: 276,842,496; two norms 2 h
      each layer 352,362,496; 12 layers 4,228,349,952; embedding v h = 65,536,000; final norm 2,048
      total 4,293,888,000 (transformers' count of the model on the meta device is the same)."""
    data = json.loads(json.dumps(transformers.JetMoeConfig().to_dict(), default=str))
    data.update(architectures=["JetMoeForCausalLM"], model_type="jetmoe")
    assert registry.memplan_params(data) == 4_293_888_000


def test_jetmoe_trace_is_refused_as_its_exclusion_says():
    """JetMoE's routing splits the tokens by counts read from tensor values: the trace refuses it (EXCLUDED, kind
    trace)."""
    assert registry.EXCLUDED["jetmoe"][0] == "trace"
    with pytest.raises(TraceRefused, match="depends on data"):
        trace(tiny_config("jetmoe"))


def test_doge_full_size_defaults_count_by_hand():
    """DogeConfig's defaults: L = 32, h = 1024, a = g = 8 heads of d = 128, f = 2048, v = 32768, untied.
      each layer: q, k, v, o 4 h^2 = 4,194,304; q / k norms 2 d = 256; A g = 8; dt_proj g d x g = 8,192; residual
        scales 2 h = 2,048; MLP 3 h f = 6,291,456; two norms 2 h = 2,048: 10,498,312
      32 x 10,498,312 = 335,945,984; embedding and head 2 v h = 67,108,864; final norm 1,024
      total 403,055,872 (transformers' count of the model on the meta device is the same)."""
    data = json.loads(json.dumps(transformers.DogeConfig().to_dict(), default=str))
    data.update(architectures=["DogeForCausalLM"], model_type="doge")
    assert registry.memplan_params(data) == 403_055_872


def test_doge_traced_equals_a_real_cpu_run_and_megatron_is_refused(run_cli, tmp_path):
    """Doge's dynamic mask (its top keep_window_size keys kept past s = 16 in the tiny config) is traced with symbolic
    s and b: equal to a real CPU run at s = 40, b = 3; --impl megatron refuses it in one line."""
    config = tiny_config("doge")
    data = trace(config)
    assert bucket_bytes(TracedFile.model_validate(data), 40, 3) == measured_buckets(measure(config, 40, 3))
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, out, err = run_cli("estimate", "--hf-config", str(tmp_path / "config.json"), "--impl", "megatron")
    assert code == 2 and "dynamic-mask attention" in err and len(err.strip().splitlines()) == 1


def test_hrm_full_size_defaults_count_by_hand_and_are_refused_in_one_line(run_cli, tmp_path):
    """HrmTextConfig's defaults: two stacks of 16 layers, h = 1536, 12 heads of 128 (q = 1536), f = 4096, v = 151808,
    untied, weightless RMSNorms.
      each layer: q, k, v, o 4 h q = 9,437,184; the attention's gate h q = 2,359,296; MLP 3 h f = 18,874,368:
        30,670,848
      32 x 30,670,848 = 981,467,136; embedding and head 2 v h = 466,354,176; z_L_init h = 1,536
      total 1,447,822,848 (transformers' count of the model on the meta device is the same).
    Its loop over the stacks is modelled by no inventory: estimate refuses it in one line."""
    data = json.loads(json.dumps(transformers.HrmTextConfig().to_dict(), default=str))
    data.update(architectures=["HrmTextForCausalLM"], model_type="hrm_text")
    assert registry.memplan_params(data) == 1_447_822_848
    (tmp_path / "config.json").write_text(json.dumps(tiny_config("hrm_text")))
    for impl in ("hf-sdpa", "megatron"):
        code, out, err = run_cli("estimate", "--hf-config", str(tmp_path / "config.json"), "--impl", impl)
        assert code == 2 and "run in a loop" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("model_type, switches, says", [
    ("recurrent_gemma", dict(block_types=["recurrent", "mlp"]), "block_types"),
    ("recurrent_gemma", dict(lru_width=90), "not divisible"),
    ("recurrent_gemma", dict(hidden_activation="relu"), "gelu"),
    ("minimax", dict(layer_types=["linear_attention", "sliding_attention"]), "layer_types"),
    ("minimax", dict(hidden_act="gelu"), "silu"),
    ("xlstm", dict(use_bias=True), "use_bias"),
    ("xlstm", dict(embedding_dim=32), "embedding_dim"),
    ("xlstm", dict(num_heads=3), "multiples of num_heads"),
    ("doge", dict(is_moe=True), "is_moe"),
    ("doge", dict(mlp_bias=True), "mlp_bias"),
    ("jetmoe", dict(activation_function="gelu"), "silu"),
    ("hrm_text", dict(mlp_bias=True), "mlp_bias"),
    ("hrm_text", dict(attention_bias=True), "attention_bias"),
])
def test_layouts_memplan_does_not_count_are_refused(model_type, switches, says):
    with pytest.raises(MemplanError, match=says) as err:
        registry.memplan_params({**tiny_config(model_type), **switches})
    assert "\n" not in str(err.value)


def test_a_pattern_cannot_mix_rglru_blocks_with_other_mixers():
    """The RG-LRU's widths are the ssm_* fields: beside a Mamba-2 mixer or a DeltaNet (which read them otherwise) it
    is refused, as is R without ssm_heads."""
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=128, vocab_size=512, bias=False)
    with pytest.raises(ValueError, match="ssm_heads"):
        ModelSpec(**base, layer_pattern="RA")
    for other in "SD":
        with pytest.raises(ValueError, match="one kind per model"):
            ModelSpec(**base, layer_pattern="R" + other, ssm_heads=4)
    assert ModelSpec(**base, layer_pattern="RA", ssm_heads=4, ssm_head_dim=16).layer_blocks["rglru"] == 1


def test_the_fit_starts_past_the_attention_window():
    """The local attention builds its sliding-window mask (saved by sdpa, s^2 b) only once s is past the window: the
    fit's points are past it, in steps of 4, any s; a window wider than 16 (RecurrentGemma-2b's 2048) is traced at 16
    and the fit holds from the file's window on; RWKV has no window."""
    assert trace_fit.fit_step(tiny_config("recurrent_gemma")) == (4, False, 16, trace_fit.fit_step(
        tiny_config("recurrent_gemma")).why, None, 0)
    full = trace_fit.fit_step(transformers.RecurrentGemmaConfig().to_dict() | {"model_type": "recurrent_gemma"})
    assert (full.step, full.start, full.overrides, full.least) == (4, 16, {"attention_window_size": 16}, 2049)
    assert "traced with attention_window_size 16, not 2048" in full.why
    assert trace_fit.fit_step(tiny_config("rwkv"))[:3] == (4, False, 0)


@pytest.fixture(scope="module")
def traced():
    config = tiny_config("recurrent_gemma")
    return config, trace(config)


def test_the_fitted_trace_equals_a_real_cpu_run_where_it_was_not_fitted(traced, run_cli, tmp_path):
    """Fitted at s = 24, 28, 32 and b = 2, 3 (checked at s = 36, b = 4 and s = 39, b = 3), the trace's polynomials
    equal, bucket by bucket, what a real CPU run of transformers' torch path saves at s = 130, b = 3; the estimate
    with it notes the RG-LRU's torch path, and an s below the fitted points; --impl megatron refuses in one line."""
    config, data = traced
    assert config["block_types"] == ["recurrent", "recurrent", "attention"] and config["num_hidden_layers"] == 3
    assert any(c.startswith("fitted:") and "a token at a time" in c for c in data["conditions"])
    file = TracedFile.model_validate(data)
    assert bucket_bytes(file, 130, 3) == measured_buckets(measure(config, 130, 3))
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "trace.yaml").write_text(to_yaml(data))
    args = ("estimate", "--hf-config", str(tmp_path / "config.json"), "--impl", "hf-sdpa", "--inventory",
            str(tmp_path / "trace.yaml"), "--seq-len")
    code, out, err = run_cli(*args, "256")
    assert code == 0, err
    assert "RG-LRU" in out and "_rnn_scan" in out and "s = 256 is outside" not in out
    code, out, err = run_cli(*args, "20")
    assert code == 0 and "s = 20 is outside the trace (s >= 24: the least s its saves were fitted from)" in out
    code, out, err = run_cli("estimate", "--hf-config", str(tmp_path / "config.json"), "--impl", "megatron")
    assert code == 2 and "RG-LRU" in err and len(err.strip().splitlines()) == 1


def test_rwkv_fitted_equals_a_real_cpu_run_where_it_was_not_fitted(run_cli, tmp_path):
    """RWKV fitted at s = 8, 12, 16 (rwkv_linear_attention_cpu's loop over the tokens) equals a real CPU run at s = 50,
    b = 3; --impl hf-sdpa is refused (no attention: eager only)."""
    config = tiny_config("rwkv")
    data = trace(config)
    assert data["conditions"][0] == "s >= 8"
    assert bucket_bytes(TracedFile.model_validate(data), 50, 3) == measured_buckets(measure(config, 50, 3))
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, out, err = run_cli("estimate", "--hf-config", str(tmp_path / "config.json"), "--impl", "hf-sdpa")
    assert code == 2 and "RWKV (no attention layers: eager only)" in err


def test_minimax_fitted_equals_a_real_cpu_run_where_it_was_not_fitted():
    """MiniMax's lightning attention loops over blocks of s (the tiny config's 16 tokens): fitted at s = 32, 48, 64, s a
    multiple of the block; equal to a real CPU run at s = 112, b = 3 (seven blocks)."""
    config = tiny_config("minimax")
    assert config["layer_types"] == ["full_attention", "linear_attention"] and config["block_size"] == 16
    data = trace(config)
    assert "s % 16 == 0" in data["conditions"]
    assert bucket_bytes(TracedFile.model_validate(data), 112, 3) == measured_buckets(measure(config, 112, 3))


# opt-in (~10 s of CPU):  MEMPLAN_FIT_SLOW=1 PYTHONPATH=. pytest tests/test_recurrent.py -k wider
@pytest.mark.skipif(not os.environ.get("MEMPLAN_FIT_SLOW"), reason="set MEMPLAN_FIT_SLOW=1 to run")
def test_a_wider_window_traced_at_16_tokens_equals_a_real_cpu_run():
    """A 64-token window traced at 16 tokens (fit_step: past the window the saves do not depend on its width), the
    RG-LRU 128 wide, one K / V head, R A R A: equal to a real CPU run of the 64-token model at s = 150, b = 2."""
    config = {**tiny_config("recurrent_gemma"), "attention_window_size": 64, "lru_width": 128,
              "num_key_value_heads": 1, "block_types": ["recurrent", "attention"], "num_hidden_layers": 4}
    file = TracedFile.model_validate(trace(config))
    assert file.conditions[0] == "s >= 65"
    assert bucket_bytes(file, 150, 2) == measured_buckets(measure(config, 150, 2))
