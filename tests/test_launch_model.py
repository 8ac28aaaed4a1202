"""`--emit megatron` builds the same model: the RoPE base, the norm epsilon, Qwen2's QKV bias, sliding windows read
from published config.json files, and the GeLU-gated models (Gemma) refused with one line."""

import json
from pathlib import Path

import pytest

from memplan.core.errors import MemplanError
from memplan.core.specs import Config, ParallelSpec
from memplan.core.training import TrainingSpec
from memplan.launch.megatron import megatron_args, megatron_launch
from memplan.presets.catalog import load_model
from memplan.presets.hf_config import read_hf_config

TRACED = Path(__file__).resolve().parent.parent / "configs" / "traced"


def launch_flags(model, **parallel):
    args = megatron_args(Config(model=model, parallel=ParallelSpec(**parallel), training=TrainingSpec()))
    return {a.split()[0]: (a.split()[1] if len(a.split()) > 1 else None) for a in args}


def published(name):
    return json.loads((TRACED / name / "config.json").read_text())


def test_qwen2_bias_rope_base_and_epsilon_from_its_config_json():
    """Qwen2.5-7B's published config.json: rope_theta 1000000.0, rms_norm_eps 1e-06, and Qwen2Attention's q / k / v
    projections with bias (o_proj and the MLP without): --add-qkv-bias, not --disable-bias-linear's opposite."""
    data = published("qwen2.5-7b")
    got = launch_flags(read_hf_config(str(TRACED / "qwen2.5-7b" / "config.json")).model)
    assert got["--rotary-base"] == str(int(data["rope_theta"])) == "1000000"
    assert float(got["--norm-epsilon"]) == data["rms_norm_eps"] == 1e-6
    assert "--add-qkv-bias" in got and "--disable-bias-linear" in got


def test_llama3_rope_base_and_epsilon():
    """Llama 3 8B (meta-llama/Meta-Llama-3-8B config.json: rope_theta 500000.0, rms_norm_eps 1e-05); Llama 2 keeps
    RoPE's 10000. A model without them set (a hand-written YAML) gets no flag: Megatron-LM's defaults."""
    got = launch_flags(load_model("llama3-8b").model)
    assert got["--rotary-base"] == "500000" and float(got["--norm-epsilon"]) == 1e-5
    assert "--add-qkv-bias" not in got and "--window-size" not in got
    assert launch_flags(load_model("llama2-7b").model)["--rotary-base"] == "10000"
    assert not {"--rotary-base", "--norm-epsilon"} & set(launch_flags(load_model("gpt-22b").model))


def test_sliding_window_every_layer():
    """Phi-3-mini's published config.json: sliding_window 2047 on every layer. TE's window_size is (left, right)
    tokens beside the query, so a window of W tokens (the query included) is (W - 1, 0), as Megatron-Bridge converts
    transformers' sliding_window (src/megatron/bridge/models/exaone/exaone45/exaone45_bridge.py; and back,
    conversion/utils.py mcore_to_hf_window_size: window_size[0] + 1)."""
    assert published("phi3-mini")["sliding_window"] == 2047
    got = launch_flags(read_hf_config(str(TRACED / "phi3-mini" / "config.json")).model)
    assert got["--window-size"] == "2046,0" and "--window-attn-skip-freq" not in got


@pytest.mark.parametrize("name", ["gemma2-9b", "gemma3-1b", "qwen2.5-7b", "phi3-mini", "mixtral-8x7b"])
def test_sliding_layers_are_transformers_own(name):
    """The layers that slide, as memplan reads them (sliding_window_pattern N: every N-th layer full), against the
    layer_types transformers' own config class builds from the same config.json."""
    transformers = pytest.importorskip("transformers")
    data = published(name)
    model = read_hf_config(str(TRACED / name / "config.json")).model
    cls = transformers.AutoConfig.for_model(data["model_type"]).__class__
    hf = cls(**{k: v for k, v in data.items() if k not in ("architectures", "model_type")})
    hf = getattr(hf, "text_config", hf)
    types = getattr(hf, "layer_types", None) or (["sliding_attention"] * hf.num_hidden_layers if getattr(
        hf, "sliding_window", None) else ["full_attention"] * hf.num_hidden_layers)
    ours = ["full_attention" if model.sliding_window is None or (
        model.sliding_window_pattern and (i + 1) % model.sliding_window_pattern == 0) else "sliding_attention"
        for i in range(model.num_layers)]
    assert ours == list(types)
    if model.sliding_window is not None:
        assert model.sliding_window == hf.sliding_window


def test_window_pattern_flag():
    """Gemma 3's every-sixth-layer-full pattern as Megatron-LM's --window-attn-skip-freq 6 (one full-attention
    layer after 5 sliding ones, arguments.py --window-attn-skip-freq's help), on a SiLU-gated model."""
    model = read_hf_config(str(TRACED / "gemma3-1b" / "config.json")).model
    assert (model.sliding_window, model.sliding_window_pattern) == (512, 6)  # its config.json's sliding_window 512
    got = launch_flags(model.model_copy(update=dict(gate_activation="silu", sandwich_norms=False)))
    assert got["--window-size"] == "511,0" and got["--window-attn-skip-freq"] == "6"


@pytest.mark.parametrize("name", ["gemma-7b", "gemma2-9b", "gemma3-1b"])
def test_gelu_gated_models_are_refused(name):
    """Gemma's MLP is gelu_pytorch_tanh-gated; Megatron-LM's --swiglu is SiLU-gated: no launch, one clear line."""
    model = read_hf_config(str(TRACED / name / "config.json")).model
    assert model.gate_activation == "gelu"
    with pytest.raises(MemplanError, match="GeLU-gated"):
        megatron_launch(Config(model=model, parallel=ParallelSpec(), training=TrainingSpec()))
    assert "--swiglu" in launch_flags(model.model_copy(update=dict(gate_activation="silu")))


def test_gelu_gated_refused_before_the_search(run_cli):
    code, out, err = run_cli("search", "--hf-config", str(TRACED / "gemma-7b" / "config.json"), "--gpus", "8",
                             "--mem", "80GB", "--emit", "megatron")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "GeLU-gated" in err


def test_sandwich_norms_get_a_note():
    model = load_model("llama3-8b").model.model_copy(update=dict(sandwich_norms=True))
    launch = megatron_launch(Config(model=model, parallel=ParallelSpec(), training=TrainingSpec()))
    assert any("sandwich_norms" in n for n in launch.notes)


def test_fractional_rope_base_is_a_note():
    """--rotary-base is type=int in arguments.py: a base of 10000.5 cannot be given; a note says so."""
    model = load_model("llama3-8b").model.model_copy(update=dict(rope_theta=10000.5))
    launch = megatron_launch(Config(model=model, parallel=ParallelSpec(), training=TrainingSpec()))
    assert not any(a.startswith("--rotary-base") for a in launch.args)
    assert any("10000.5" in n and "--rotary-base" in n for n in launch.notes)


def test_pattern_needs_a_window():
    with pytest.raises(ValueError, match="sliding_window_pattern needs sliding_window"):
        load_model("llama3-8b").model.model_validate({**load_model("llama3-8b").model.model_dump(),
                                                      "sliding_window_pattern": 2})


def test_irregular_sliding_layers_are_a_note(tmp_path):
    """Qwen2 with use_sliding_window: transformers makes the layers from max_window_layers on slide (Qwen2Config's
    layer_types), which is not every n-th layer full: no window in the model, and a note says so."""
    data = {**published("qwen2.5-7b"), "use_sliding_window": True, "max_window_layers": 2, "sliding_window": 4096}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    preset = read_hf_config(str(path))
    assert preset.model.sliding_window is None and any("sliding window" in n for n in preset.notes)
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen2Config(**{k: v for k, v in data.items() if k not in ("architectures", "model_type")})
    assert hf.layer_types[:3] == ["full_attention", "full_attention", "sliding_attention"]


HUB = Path(__file__).resolve().parent / "hub"
# what each family's layer is in transformers (modeling_<family>.py), against Megatron-LM's GPTModel layer (sequential
# pre-norm, every linear biased or none, per-head Q / K norms): the part no argument builds, or None
HUB_LAYOUTS = {
    "command-r-v01": "in parallel", "command-r-plus": "in parallel",  # CohereDecoderLayer: attn + mlp on one norm
    "falcon-7b": "in parallel", "falcon-40b": "in parallel",  # FalconDecoderLayer parallel_attn
    "pythia-1b": "in parallel",  # GPTNeoXLayer use_parallel_residual
    "olmo2-7b": "post-norms",  # Olmo2DecoderLayer: post_attention_layernorm on the attention's output
    "gpt-oss-20b": "attention sinks",  # GptOssAttention.sinks
    "phi-3.5-moe": "a bias on the output head",  # PhimoeForCausalLM lm_head_bias
    "gemma3-4b": "GeLU-gated",  # gelu_pytorch_tanh
    "openai-gpt": "no final norm",  # OpenAIGPTModel: no LayerNorm after the last Block
    "opt-125m": "position rows beyond", "biogpt": "position rows beyond",  # learned positions offset by 2
    "deepseek-v2": None, "deepseek-v2-lite": None, "starcoder2-3b": None, "granite-3.1-8b": None,
}


@pytest.mark.parametrize("name", sorted(HUB_LAYOUTS))
def test_other_layouts_get_no_launch(name):
    model = read_hf_config(str(HUB / f"{name}.json")).model
    expected = HUB_LAYOUTS[name]
    if expected is None:
        assert megatron_launch(Config(model=model, parallel=ParallelSpec(), training=TrainingSpec())).args
    else:
        with pytest.raises(MemplanError, match=expected):
            megatron_launch(Config(model=model, parallel=ParallelSpec(), training=TrainingSpec()))


def test_squared_relu_gated_models_are_refused():
    """BitNet's MLP is gated by a squared ReLU (relu2); Megatron-LM's --swiglu is SiLU-gated: no launch, one line."""
    model = load_model("llama3-8b").model.model_copy(update=dict(gate_activation="relu2"))
    with pytest.raises(MemplanError, match="squared ReLU") as err:
        megatron_launch(Config(model=model, parallel=ParallelSpec(), training=TrainingSpec()))
    assert "\n" not in str(err.value)
