"""Today's dense models in the Megatron-LM inventory: flash attention, GQA, SwiGLU, RMSNorm,
no dropout, RoPE, untied embeddings; the Llama presets; --hf-config."""

import json

import pytest

from memplan.plan.estimate import estimate
from memplan.presets.batch import make_config
from memplan.presets.catalog import load_model
from memplan.presets.hf_config import read_hf_config
from memplan.core.model import ModelSpec
from memplan.memory.states import total_params
from memplan.inventory.assemble import inventory_for

S, H, A, G, F, V = 4096, 4096, 32, 8, 14336, 128256  # llama3-8b at s = 4096 (Llama 3 paper, Table 3)


def llama3_8b(**training):
    return make_config(load_model("llama3-8b"), parallel=dict(tp=1, pp=1, dp=1, sp=False, zero=0),
                       training={"micro_batch": 1, "global_batch": 1, "recompute": "none", **training},
                       model=dict(seq_length=S))


def test_llama3_8b_parameters():
    # embedding and untied head 2vh; per layer q, o h^2 each, k, v h(hg/a) each, SwiGLU 3hf, two RMSNorms
    # h each; final norm h: 2 * 128256 * 4096 + 32 * (2h^2 + 2h^2/4 + 3hf + 2h) + h
    per_layer = 2 * H * H + 2 * H * (H * G // A) + 3 * H * F + 2 * H
    assert estimate(llama3_8b()).total_params == 2 * V * H + 32 * per_layer + H == 8_030_261_248


def test_llama3_8b_layer_bytes_megatron_flash():
    # Megatron-LM with Transformer Engine, flash attention, bf16, t = 1, b = 1 (hand derivation):
    #   RMSNorm 1 and 2 inputs 2sbh each, their fp32 rstd 4sb each;
    #   QKV input 2sbh; Q 2sbh, K and V 2sbh g/a each (g/a = 1/4); attention output 2sbh (also the
    #   output projection's input); fp32 log-sum-exp 4asb;
    #   first MLP linear input 2sbh; gate and up (SwiGLU input) 2 * 2sbf; down-projection input 2sbf.
    sbh, sbf, sb = S * H, S * F, S
    expected = (2 + 2 + 2 + 2 + 2 * G / A * 2 + 2 + 2) * sbh + 6 * sbf + (4 + 4 + 4 * A) * sb
    est = estimate(llama3_8b())
    assert est.per_layer_bytes == expected == 570_982_400
    ids = [r.term.id for r in est.rows]
    names = " ".join(r.term.name for r in est.rows)
    assert "swiglu_input" in ids and "softmax_out" not in ids and "softmax_lse" in ids
    assert "gate and up" in names and "SiLU" in names and "RMSNorm" in names
    assert not any("dropout" in r.term.name for r in est.rows)


def test_flash_selective_recompute_drops_only_the_lse():
    none = estimate(llama3_8b()).per_layer_bytes
    sel = estimate(llama3_8b(recompute="selective"))
    assert none - sel.per_layer_bytes == 4 * A * S  # the fp32 log-sum-exp, 4asb
    assert any("saves almost nothing" in n for n in sel.notes)


def test_eager_attention_stores_the_scores():
    flash = estimate(llama3_8b()).per_layer_bytes
    eager = estimate(make_config(load_model("llama3-8b"), parallel=dict(tp=1, pp=1, dp=1, sp=False, zero=0),
                                 training=dict(micro_batch=1, global_batch=1, recompute="none"),
                                 model=dict(seq_length=S, attention="eager"))).per_layer_bytes
    # eager without dropout: + softmax output 2as^2b, - the log-sum-exp 4asb (all else equal)
    assert eager - flash == 2 * A * S * S - 4 * A * S


def test_gqa_shrinks_k_and_v():
    def kv_bytes(g):
        model = ModelSpec(num_layers=2, hidden_size=256, num_attention_heads=8, num_kv_heads=g, seq_length=64,
                          vocab_size=100, attention="flash", dropout=False)
        from memplan.core.specs import Config

        est = estimate(Config(model=model))
        rows = {r.term.id: r.bytes for r in est.rows}
        return rows["qk"], rows["v"]

    qk8, v8 = kv_bytes(8)
    qk2, v2 = kv_bytes(2)
    assert v8 == 2 * 64 * 256 and v2 == v8 // 4  # V: 2sbh g/a
    assert qk8 - qk2 == v8 - v2  # K shrinks like V; Q does not


@pytest.mark.parametrize("name, params_b", [("llama2-7b", 6.74), ("llama2-70b", 68.98), ("llama3-8b", 8.03),
                                             ("llama3-70b", 70.55), ("llama3.1-405b", 405.85)])
def test_llama_presets_parameter_counts(name, params_b):
    # published sizes: Llama 2 7B 6.74B and 70B 68.98B (HF model cards); Llama 3 8B 8.03B, 70B 70.55B,
    # 405B 405.85B (Llama 3 paper / HF model cards)
    assert round(estimate(make_config(load_model(name))).total_params / 1e9, 2) == params_b


def write(tmp_path, data):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return str(path)


LLAMA3_8B_HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
                "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
                "num_hidden_layers": 32, "vocab_size": 128256, "max_position_embeddings": 8192,
                "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False}


def test_hf_config_llama_equals_preset(tmp_path):
    hf = read_hf_config(write(tmp_path, LLAMA3_8B_HF)).model
    preset = load_model("llama3-8b").model
    assert hf.model_dump(exclude={"name"}) == preset.model_dump(exclude={"name"})


def test_hf_config_gpt2(tmp_path):
    gpt2 = {"architectures": ["GPT2LMHeadModel"], "n_embd": 768, "n_head": 12, "n_layer": 12,
            "n_positions": 1024, "vocab_size": 50257, "resid_pdrop": 0.1}
    m = read_hf_config(write(tmp_path, gpt2)).model
    assert (m.hidden_size, m.num_attention_heads, m.num_layers, m.f, m.dropout, m.tied_embeddings) == (
        768, 12, 12, 3072, True, True)


def test_hf_config_mixtral_is_a_mixture_of_experts(tmp_path):
    """A Mixtral config.json is the Llama layout with 8 experts of intermediate_size, top-2 (tests/test_moe.py
    checks its parameters against transformers' model); its hf-* inventory is traced."""
    m = read_hf_config(write(tmp_path, {**LLAMA3_8B_HF, "architectures": ["MixtralForCausalLM"],
                                        "model_type": "mixtral", "num_local_experts": 8})).model
    assert (m.num_experts, m.moe_top_k, m.fe, m.moe_first_dense_layers) == (8, 2, 14336, 0)
    assert m.inventory is not None


def test_hf_config_cli_terms_name_llama_tensors(run_cli, tmp_path):
    code, out, _ = run_cli("estimate", "--hf-config", write(tmp_path, LLAMA3_8B_HF), "--seq-len", "4096", "--json")
    data = json.loads(out)
    assert data["activations"]["per_layer_bytes"] == 570_982_400  # as derived above
    assert "swiglu_input" in {t["id"] for t in data["activations"]["terms"]}


@pytest.mark.parametrize("data, fragment", [
    ({"architectures": ["XLNetLMHeadModel"]}, "architecture XLNetLMHeadModel"),
    ({"architectures": ["FalconForCausalLM"]}, "missing field 'vocab_size'"),
    ({"architectures": ["Qwen2ForCausalLM"]}, "missing field"),
    # a Mixtral config is read (tests/test_moe.py) and estimated (tests/test_megatron_moe.py)
    ({**LLAMA3_8B_HF, "num_local_experts": 8},
     "memplan reads the experts of Mixtral, Qwen3Moe, DeepseekV3"),
    ({"model_type": "bert"}, "model_type 'bert'"),
    ({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}, "missing field"),
    ({**LLAMA3_8B_HF, "hidden_act": "gelu"}, "hidden_act"),
])
def test_hf_config_errors(run_cli, tmp_path, data, fragment):
    code, _, err = run_cli("estimate", "--hf-config", write(tmp_path, data))
    assert code == 2 and len(err.strip().splitlines()) == 1 and fragment in err, err


def test_hf_config_not_json(run_cli, tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    code, _, err = run_cli("estimate", "--hf-config", str(path))
    assert code == 2 and "not valid JSON" in err


def test_hf_config_says_where_s_came_from(run_cli, tmp_path):
    # Llama 3.1's config allows 131,072 positions; memplan takes 8,192 (HF_DEFAULT_SEQ) and says so
    long = {**LLAMA3_8B_HF, "max_position_embeddings": 131072}
    code, out, _ = run_cli("estimate", "--hf-config", write(tmp_path, long), "--json")
    data = json.loads(out)
    assert data["config"]["model"]["seq_length"] == 8192
    assert any("131,072 positions" in n and "--seq-len" in n for n in data["notes"])
    # the model is named by the config's path, not by its parent directory alone
    assert data["config"]["model"]["name"] == str(tmp_path / "config.json")
    # with --seq-len nothing needs saying
    code, out, _ = run_cli("estimate", "--hf-config", write(tmp_path, long), "--seq-len", "4096", "--json")
    assert not any("positions" in n for n in json.loads(out)["notes"])
    code, out, _ = run_cli("search", "--hf-config", write(tmp_path, long), "--gpus", "8", "--mem", "80GB", "--json")
    assert any("131,072 positions" in n for n in json.loads(out)["notes"])


# Mistral-Nemo 12B (mistralai/Mistral-Nemo-Base-2407 config.json): its 32 heads are 128 wide, not h/a = 160.
MISTRAL_NEMO_HF = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 5120,
                   "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "head_dim": 128, "num_hidden_layers": 40, "vocab_size": 131072,
                   "max_position_embeddings": 1024000, "hidden_act": "silu", "tie_word_embeddings": False}


def test_hf_config_head_dim_mistral_nemo(tmp_path):
    # By hand, q = a x head_dim = 4096, K/V 8 x 128 = 1024 wide:
    #   attention 5120*4096 (q) + 2*5120*1024 (k, v) + 4096*5120 (o)  =  52,428,800
    #   MLP 3*5120*14336                                             = 220,200,960
    #   2 RMSNorms 2*5120                                            =      10,240
    #   per layer 272,640,000; x 40 layers                           = 10,905,600,000
    #   embedding + untied lm_head 2*131072*5120                     =  1,342,177,280
    #   final norm                                                   =          5,120
    #   total 12,247,782,400 (the 12.2 B published for Mistral-Nemo; with h/a-wide heads it would be 12.77 B)
    model = read_hf_config(write(tmp_path, MISTRAL_NEMO_HF)).model
    assert (model.head_dim, model.q) == (128, 4096)
    assert total_params(model) == 12_247_782_400
    # Q and K saved by flash attention: 2sbq + 2sbqg/a = 2*4096 + 2*1024 = 10,240 bytes per token
    qk = next(t for t in inventory_for(model).terms if t.id == "qk")
    assert qk.bytes({**model.symbols(b=1, t=1), "s": 1}, 2, 0) == 10_240


def test_hf_config_head_dim_equal_to_h_over_a_is_the_default(tmp_path):
    stated = read_hf_config(write(tmp_path, {**LLAMA3_8B_HF, "head_dim": 128})).model
    assert stated.head_dim is None and stated.q == 4096


def test_head_dim_lets_heads_not_divide_h():
    # a = 3 heads of 32 on h = 64: allowed only with head_dim; q = 96
    assert ModelSpec(num_layers=1, hidden_size=64, num_attention_heads=3, head_dim=32, seq_length=8,
                     vocab_size=16).q == 96
    with pytest.raises(ValueError, match="head_dim"):
        ModelSpec(num_layers=1, hidden_size=64, num_attention_heads=3, seq_length=8, vocab_size=16)


def test_head_dim_shown_as_q_in_the_sizes(run_cli, tmp_path):
    code, out, _ = run_cli("estimate", "--hf-config", write(tmp_path, MISTRAL_NEMO_HF), "--json")
    data = json.loads(out)
    sizes = {t["id"]: t["symbolic"] for t in data["activations"]["terms"]}
    assert sizes["proj_input"] == "2sbq" and sizes["v"] == "2sbqg/a"


ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
                 "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM"}


def _meta_count(config: dict) -> int:
    """Parameters of transformers' own model for a config.json, built on the meta device (no memory,
    no weights): each tensor once, so tied embeddings count once."""
    import os

    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    import transformers

    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.slow
def test_shipped_transformers_presets_count_what_transformers_builds():
    """Every preset shipped as a config.json (configs/traced/) has exactly the parameters transformers
    builds from it: Qwen2's Q/K/V biases, Qwen3's per-head q/k norms, Gemma 2's four norms per layer,
    Gemma's tied embeddings, Mixtral's and Qwen3-MoE's experts and routers included."""
    pytest.importorskip("transformers")
    from memplan.presets.catalog import model_names
    from memplan.presets.files import configs_dir

    from memplan.memory.states import total_params

    shipped = sorted(p.parent.name for p in (configs_dir() / "traced").glob("*/config.json"))
    assert set(shipped) <= set(model_names()) and len(shipped) >= 7
    for name in shipped:
        config = json.loads((configs_dir() / "traced" / name / "config.json").read_text())
        assert total_params(load_model(name).model) == _meta_count(config), name


@pytest.mark.slow
def test_every_traced_family_counts_what_transformers_builds(tmp_path):
    """The small configs of every family the tracer is checked on (validation/trace_config.py FAMILIES), read
    as --hf-config reads a config.json: the same parameter count as transformers' model (Gemma 3: q/k
    norms and four norms per layer; DeepSeek-V3: latent attention, dense first layer, shared expert)."""
    pytest.importorskip("transformers")
    from validation.trace_config import FAMILIES

    from memplan.memory.states import total_params

    for name, (config, _) in FAMILIES.items():
        config = {**config, "architectures": [ARCHITECTURES[config["model_type"]]]}
        assert total_params(read_hf_config(write(tmp_path, config)).model) == _meta_count(config), name


def test_a_model_yaml_gives_tuple_fields_as_lists(tmp_path):
    """YAML has no tuples: extra_tensors, embedding_widths, ... come as lists and are taken (strict mode takes only
    tuples), and a spec's own model_dump written to YAML loads back equal (the torchtitan tests write their tiny models
    this way; extra_tensors' default () was dumped as [] and refused)."""
    import yaml

    text = ("model:\n  name: lists\n  num_layers: 2\n  hidden_size: 64\n  num_attention_heads: 4\n  seq_length: 32\n"
            "  vocab_size: 256\n  tied_embeddings: false\n  embedding_widths: [32, 48]\n"
            "  extra_tensors: [{name: adapters, scope: layer, rows: 8, cols: 64, count: 2}]\n")
    (tmp_path / "lists.yaml").write_text(text)
    spec = load_model(str(tmp_path / "lists.yaml")).model
    assert spec.embedding_widths == (32, 48) and spec.extra_tensors[0].numel == 8 * 64 * 2
    dumped = tmp_path / "dumped.yaml"
    dumped.write_text(yaml.safe_dump({"model": spec.model_dump(exclude={"inventory"}, mode="json")}))
    assert load_model(str(dumped)).model == spec


@pytest.mark.parametrize("data, fragment", [
    # the recurrent / encoder readers do arithmetic on these fields: a null one is named, not a TypeError
    ({"architectures": ["RwkvForCausalLM"], "hidden_size": None, "num_hidden_layers": 2, "vocab_size": 100},
     "RwkvForCausalLM needs a value where the file has null: hidden_size"),
    ({"architectures": ["BigBirdForCausalLM"], "attention_type": "original_full", "hidden_size": None,
      "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100},
     "BigBirdForCausalLM needs a value where the file has null: hidden_size"),
    # a layer pattern L characters long is built from the count: refused before it is (ModelSpec's limit, 16,384)
    ({"architectures": ["RwkvForCausalLM"], "hidden_size": 64, "num_hidden_layers": 10**12, "vocab_size": 100},
     "num_hidden_layers: at most 16,384 layers"),
    ({"architectures": ["RecurrentGemmaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 10**9,
      "num_attention_heads": 4, "vocab_size": 100}, "num_hidden_layers: at most 16,384 layers"),
])
def test_hf_config_nulls_and_huge_layer_counts_refused(run_cli, tmp_path, data, fragment):
    code, _, err = run_cli("estimate", "--hf-config", write(tmp_path, data))
    assert code == 2 and len(err.strip().splitlines()) == 1 and fragment in err, err
