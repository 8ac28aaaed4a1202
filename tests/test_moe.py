"""Mixture-of-experts models (issue 11): parameters, states, FLOPs and traced activations.

memplan models an MoE layer as a router (E x h) sending each token to k of E routed experts (each a
gated MLP f_e wide), plus shared experts (f_s wide), after the dense layers a config keeps first. The
parameter counts are checked against transformers' own models built from small configs (and derived
by hand in the comments), the active-parameter FLOPs by hand, the refusals by their messages, and the
activations of a traced MoE model against a real CPU run."""

import json
import os

import pytest

import memplan
from memplan.timing.flops import layer_matmul_flops, logits_flops, model_flops
from memplan.core.errors import MemplanError
from memplan.plan.estimate import estimate
from memplan.presets.batch import make_config
from memplan.presets.catalog import load_model
from memplan.presets.files import ModelPreset
from memplan.presets.hf_config import read_hf_config
from memplan.core.model import ModelSpec
from memplan.core.spec_base import build
from memplan.core.training import TrainingSpec
from memplan.memory.shapes import weight_shapes
from memplan.memory.states import param_groups, total_params

# --- small configs, the parameters derived by hand ---------------------------------------------------

BASE = {"hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 4096, "pad_token_id": 0,
        "bos_token_id": 0, "eos_token_id": 0, "tie_word_embeddings": False}

# Mixtral, top-2 of 4 experts, every layer MoE (h = 64, a = 4 heads of 16, g = 2, f_e = 160, v = 512, L = 2):
#   attention  q 64x64 + k, v 2 x 32x64 + o 64x64                 = 4096 + 4096 + 4096      = 12,288
#   experts    4 x (gate_up 320x64 + down 64x160)                 = 4 x (20,480 + 10,240)   = 122,880
#   router     4 x 64                                                                       = 256
#   norms      2 x 64                                                                       = 128
#   layer                                                                                   = 135,552
#   model      2 x 135,552 + embedding 512x64 + LM head 512x64 + final norm 64 = 271,104 + 65,536 + 64 = 336,704
MIXTRAL = {**BASE, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 4,
           "num_experts_per_tok": 2, "sliding_window": None}
MIXTRAL_PARAMS = 336_704

# Qwen3-MoE, top-2 of 8 experts of f_e = 48, head_dim 24 (q = 4 x 24 = 96 wide, K / V 2 x 24 = 48), q / k norms:
#   attention  q 96x64 + k, v 2 x 48x64 + o 64x96 + q_norm, k_norm 2 x 24 = 6144 + 6144 + 6144 + 48 = 18,480
#   experts    8 x (gate_up 96x64 + down 64x48)                   = 8 x (6144 + 3072)        = 73,728
#   router     8 x 64                                                                       = 512
#   norms      2 x 64                                                                       = 128
#   layer                                                                                   = 92,848
#   model      2 x 92,848 + 2 x 512x64 + 64                      = 185,696 + 65,536 + 64    = 251,296
QWEN3_MOE = {**BASE, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 8,
             "num_experts_per_tok": 2, "moe_intermediate_size": 48, "head_dim": 24}
QWEN3_MOE_PARAMS = 251_296

# The same with a dense first layer (mlp_only_layers [0], L = 3): the dense layer's MLP is gate, up
# 160x64 and down 64x160 = 30,720 instead of the experts and router (74,240):
#   3 x 92,848 - 74,240 + 30,720 + 65,536 + 64 = 300,624
QWEN3_MOE_DENSE_FIRST = {**QWEN3_MOE, "num_hidden_layers": 3, "mlp_only_layers": [0]}
QWEN3_MOE_DENSE_FIRST_PARAMS = 300_624


# DeepSeek-V3: a dense first layer, then MoE layers of top-2 of 8 experts (f_e = 32) + one shared expert (f_s = 32),
# multi-head latent attention (a = 4, r_q = 32, r_kv = 16, d_r = 8, d_n = 16, d_v = 16), L = 3:
#   attention  q_a_proj 32x64 + q_a_layernorm 32 + q_b_proj 4(16 + 8)x32 + kv_a_proj_with_mqa (16 + 8)x64
#              + kv_a_layernorm 16 + kv_b_proj 4(16 + 16)x16 + o_proj 64x(4 x 16)
#              = 2048 + 32 + 3072 + 1536 + 16 + 2048 + 4096                           = 12,848
#   dense MLP  3 x 64 x 160                                                            = 30,720
#   MoE MLP    8 x (gate_up 64x64 + down 64x32) + router 8x64 + shared 3 x 64 x 32
#              = 49,152 + 512 + 6144                                                   = 55,808
#   layers     dense 12,848 + 30,720 + 128 = 43,696; MoE 12,848 + 55,808 + 128 = 68,784
#   model      43,696 + 2 x 68,784 + 2 x 512x64 + 64                                   = 246,864
DEEPSEEK_V3 = {**BASE, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
               "num_key_value_heads": 4, "num_hidden_layers": 3, "first_k_dense_replace": 1,
               "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
               "n_group": 2, "topk_group": 1, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
               "qk_nope_head_dim": 16, "v_head_dim": 16, "rope_scaling": None}
DEEPSEEK_V3_PARAMS = 246_864
# without the query latent (q_lora_rank null): q_proj 4(16 + 8)x64 = 6144 replaces 2048 + 32 + 3072 = 5152, in
# each of the 3 layers: 246,864 + 3 x 992 = 249,840
DEEPSEEK_V3_NO_Q_LORA = {**DEEPSEEK_V3, "q_lora_rank": None}
DEEPSEEK_V3_NO_Q_LORA_PARAMS = 249_840

# Qwen3 (dense) has the same q / k norms (qk_norm): its attention as above, MLP gate, up 160x64, down 64x160:
#   layer 18,480 + 30,720 + 128 = 49,328; model 2 x 49,328 + 65,536 + 64 = 164,256
QWEN3 = {**BASE, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 24}
QWEN3_PARAMS = 164_256


def _spec(config: dict, tmp_path) -> ModelSpec:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return read_hf_config(str(path)).model


def _hf_model(config: dict):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    return transformers.AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("config, params", [(MIXTRAL, MIXTRAL_PARAMS), (QWEN3_MOE, QWEN3_MOE_PARAMS),
                                            (QWEN3_MOE_DENSE_FIRST, QWEN3_MOE_DENSE_FIRST_PARAMS),
                                            (QWEN3, QWEN3_PARAMS), (DEEPSEEK_V3, DEEPSEEK_V3_PARAMS),
                                            (DEEPSEEK_V3_NO_Q_LORA, DEEPSEEK_V3_NO_Q_LORA_PARAMS)])
def test_parameter_count_is_the_hand_derivation(config, params, tmp_path):
    assert total_params(_spec(config, tmp_path)) == params


@pytest.mark.parametrize("config, params", [(MIXTRAL, MIXTRAL_PARAMS), (QWEN3_MOE, QWEN3_MOE_PARAMS),
                                            (QWEN3_MOE_DENSE_FIRST, QWEN3_MOE_DENSE_FIRST_PARAMS),
                                            (QWEN3, QWEN3_PARAMS), (DEEPSEEK_V3, DEEPSEEK_V3_PARAMS),
                                            (DEEPSEEK_V3_NO_Q_LORA, DEEPSEEK_V3_NO_Q_LORA_PARAMS)])
def test_parameter_count_is_the_transformers_model(config, params, tmp_path):
    model = _hf_model(config)
    assert sum(p.numel() for p in model.parameters()) == params == total_params(_spec(config, tmp_path))


def _expanded(model: ModelSpec, layout: str = "separate") -> list[tuple[int, ...]]:
    """memplan's tensors in loop order: first, the dense layers, the MoE layers, last, head, as shapes."""
    shapes = weight_shapes(model, layout)
    v = model.symbols(t=1)
    k = model.moe_first_dense_layers
    seq = (list(shapes["first"]) + list(shapes["dense_layer"]) * k + list(shapes["layer"]) * (model.num_layers - k)
           + list(shapes["last"]) + (list(shapes["head"]) if not model.tied_embeddings else []))
    out = []
    for w in seq:
        dims = (w.rows.evaluate(v),) if w.cols is None else (w.rows.evaluate(v), w.cols.evaluate(v))
        out += [dims if w.batch is None else (w.batch.evaluate(v),) + dims] * w.count
    return out


@pytest.mark.parametrize("config", [QWEN3_MOE, QWEN3_MOE_DENSE_FIRST, MIXTRAL, DEEPSEEK_V3, DEEPSEEK_V3_NO_Q_LORA])
def test_weight_shapes_are_the_transformers_tensors(config, tmp_path):
    """Every parameter tensor by shape (the experts as transformers' 3-D gate_up_proj / down_proj; DeepSeek-V3's
    latent attention projections and norms), in the order the model registers them (Qwen3-MoE, DeepSeek-V3);
    Mixtral registers its router before its experts, so for it the same tensors in another order."""
    real = [tuple(p.shape) for p in _hf_model(config).parameters()]
    got = _expanded(_spec(config, tmp_path))
    if config is MIXTRAL:
        assert sorted(got) == sorted(real)
    else:
        assert got == real


@pytest.mark.parametrize("layout", ["fused", "separate"])
@pytest.mark.parametrize("kw", [dict(), dict(moe_shared_ffn_hidden_size=96, moe_first_dense_layers=1),
                                dict(mlp="gelu", moe_shared_ffn_hidden_size=32, qk_norm=True)])
def test_weight_shapes_add_up_to_the_parameter_groups(kw, layout):
    model = ModelSpec(**{**MOE_SPEC, **kw})
    v = model.symbols(t=1)
    k = model.moe_first_dense_layers
    shapes = weight_shapes(model, layout)
    got: dict[str, int] = {}
    for scope, times in (("first", 1), ("dense_layer", k), ("layer", model.num_layers - k), ("last", 1),
                         ("head", 1)):
        for w in shapes[scope]:
            got[w.group] = got.get(w.group, 0) + times * w.count * w.numel.evaluate(v)
    layers = {"layer": model.num_layers, "moe": model.num_layers - k, "dense": k, "first": 1, "last": 1}
    want: dict[str, int] = {}
    for g in param_groups(model):
        want[g.name] = want.get(g.name, 0) + layers[g.scope] * g.count.evaluate(v)
    want["output layer (LM head)"] = model.vocab_size * model.hidden_size
    assert got == want
    assert sum(want.values()) == total_params(model)


# --- ModelSpec: the MoE fields and their checks -----------------------------------------------------

MOE_SPEC = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_kv_heads=2, seq_length=32, vocab_size=512,
                ffn_hidden_size=160, norm="rmsnorm", mlp="swiglu", bias=False, tied_embeddings=False,
                position_embedding="rope", attention="flash", num_experts=8, moe_top_k=2, moe_ffn_hidden_size=48)


@pytest.mark.parametrize("change, message", [
    (dict(moe_top_k=9), "moe_top_k=9 exceeds num_experts=8"),
    (dict(moe_top_k=None), "num_experts=8 needs moe_top_k"),
    (dict(num_experts=None), "moe_top_k is a mixture-of-experts field: it needs num_experts"),
    (dict(num_experts=None, moe_top_k=None), "moe_ffn_hidden_size is a mixture-of-experts field"),
    (dict(moe_first_dense_layers=4), "moe_first_dense_layers=4 leaves no MoE layer among the num_layers=4"),
    (dict(bias=True), "bias: memplan models mixture-of-experts layers without biases"),
    (dict(moe_top_k=0), "moe_top_k: Input should be greater than 0"),
])
def test_bad_moe_fields_are_refused_naming_the_field(change, message):
    with pytest.raises(MemplanError, match=message) as err:
        build(ModelSpec, {**MOE_SPEC, **change})
    assert "\n" not in str(err.value)


def test_dense_layers_must_lie_on_the_first_stage():
    model = ModelSpec(**{**MOE_SPEC, "moe_first_dense_layers": 3})
    with pytest.raises(MemplanError, match="moe_first_dense_layers=3 exceed the 2 layers of the first model chunk"):
        make_config(ModelPreset(model), parallel=dict(pp=2))


# --- refusals -------------------------------------------------------------------------------------

def test_torch_impl_refuses_moe():
    # (--impl megatron / megatron-local model MoE layers: tests/test_megatron_moe.py, tests/test_validate_mcore_moe.py)
    config = make_config(load_model("mixtral-8x7b"))
    with pytest.raises(MemplanError, match=r"no reference torch layer \(--impl torch\) MoE inventory"):
        estimate(config, impl="torch")


def test_hf_impl_without_a_traced_inventory_is_refused():
    config = make_config(ModelPreset(ModelSpec(**MOE_SPEC)))
    with pytest.raises(MemplanError, match="come from a traced inventory"):
        estimate(config, impl="hf-sdpa")


def test_cli_refuses_torch_for_moe_in_one_line():
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "memplan.cli", "estimate", "--model", "mixtral-8x7b", "--impl", "torch"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip() == ("memplan: error: no reference torch layer (--impl torch) MoE inventory: use --impl "
                                "megatron, megatron-local, hf-sdpa or hf-eager")


@pytest.mark.parametrize("change, message", [
    (dict(decoder_sparse_step=2), "decoder_sparse_step = 2: memplan models an MoE layer in every layer"),
    (dict(mlp_only_layers=[1]), r"mlp_only_layers = \[1\]: memplan models dense layers first only"),
])
def test_qwen3_moe_layer_patterns_other_than_dense_first_are_refused(change, message, tmp_path):
    with pytest.raises(MemplanError, match=message):
        _spec({**QWEN3_MOE, **change}, tmp_path)


def test_other_moe_architectures_are_refused(tmp_path):
    config = {**QWEN3_MOE, "architectures": ["LongcatFlashForCausalLM"], "model_type": "longcat_flash"}
    with pytest.raises(MemplanError, match="LongcatFlashForCausalLM with num_experts = 8: memplan reads the experts "
                       "of Mixtral, Qwen3Moe, DeepseekV3"):
        _spec(config, tmp_path)
    config = {**BASE, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_local_experts": 8}
    with pytest.raises(MemplanError, match="LlamaForCausalLM with num_local_experts = 8"):
        _spec(config, tmp_path)


# --- FLOPs: the active parameters ---------------------------------------------------------------------

def test_model_flops_count_the_active_experts():
    """Per token and layer, forward: attention projections 2h(q + 2qg/a) + 2qh, the k routed experts and
    the shared ones 3 x 2h(k f_e + f_s) (SwiGLU), the router 2hE; dense layers 3 x 2hf. Megatron-LM's
    num_floating_point_operations multiplies the routed experts' term by moe_router_topk the same way."""
    model = ModelSpec(**{**MOE_SPEC, "moe_shared_ffn_hidden_size": 96, "moe_first_dense_layers": 1})
    s, h, v, L = 32, 64, 512, 4
    q, kv = 64, 32  # a x head_dim, g x head_dim
    attention = 2 * s * h * (q + 2 * kv) + 2 * s * q * h
    moe_mlp = 3 * 2 * s * h * (2 * 48 + 96) + 2 * s * h * 8  # top-2 of f_e = 48, shared 96, router E = 8
    dense_mlp = 3 * 2 * s * h * 160
    core = 4 * s * s * q  # QK^T and attention over V (the full square, K22 appendix A)
    forward = L * (attention + core) + 3 * moe_mlp + dense_mlp + 2 * s * h * v
    assert model_flops(model, 5) == pytest.approx(3 * forward * 5, rel=1e-12)
    # not all experts: 8 x 48 = 384 wide per token would be 2.4x the routed work
    everything = ModelSpec(**{**MOE_SPEC, "moe_shared_ffn_hidden_size": 96, "moe_first_dense_layers": 1,
                              "moe_top_k": 8})
    assert model_flops(everything, 5) > model_flops(model, 5)


def test_mixtral_active_parameters_are_about_13b():
    """Mixtral 8x7B: 46.7 B parameters, about 12.9 B active per token (its model card's figure): the
    model FLOPs per token of the weight matmuls are 6 x that (3 x the forward's 2 per parameter)."""
    model = load_model("mixtral-8x7b").model
    s = model.seq_length
    per_token_matmuls = (model.num_layers * layer_matmul_flops(model) + logits_flops(model)) / s
    active = per_token_matmuls / 2  # forward: 2 FLOPs per parameter
    embedding = model.vocab_size * model.hidden_size  # a lookup, no FLOPs
    norms = (2 * model.num_layers + 1) * model.hidden_size
    assert active + embedding + norms == pytest.approx(12_879_925_248, rel=1e-12)


# --- the presets -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, params", [("mixtral-8x7b", 46_702_792_704), ("qwen3-30b-a3b", 30_532_122_624)])
def test_presets_have_their_published_sizes(name, params):
    """Mixtral 8x7B: 46.7 B (Mistral AI); Qwen3-30B-A3B: 30.5 B (Qwen)."""
    preset = load_model(name)
    assert preset.model.is_moe and preset.model.inventory is not None
    assert total_params(preset.model) == params


def test_mixtral_estimate_keeps_two_routed_copies_of_each_token():
    """transformers' grouped_mm experts send all k s b token copies through the experts: the experts'
    input is 2 s b h (top-2) bf16 values per layer in the shipped trace."""
    est = estimate(make_config(load_model("mixtral-8x7b"), training=dict(micro_batch=2),
                               model=dict(seq_length=4096)), impl="hf-sdpa")
    assert est.total_params == 46_702_792_704
    rows = {r.term.id: r for r in est.rows}
    s, b, h = 4096, 2, 4096
    assert rows["mlp.experts._grouped_mm.1"].bytes == 2 * (2 * s * b * h)
    # AdamW with bf16-mixed: 2 + 4 + 4 + 8 = 18 bytes per parameter, no sharding
    assert est.peak.states.total == 18 * est.total_params


def test_zero_shards_moe_states_over_data_parallel_ranks():
    """No expert parallelism yet: ZeRO splits an MoE model's states over d like a dense model's."""
    base = make_config(load_model("qwen3-30b-a3b"), parallel=dict(dp=8, zero=1), training=dict(global_batch=8))
    est = estimate(base, impl="hf-sdpa")
    n = est.total_params
    assert est.peak.states.optimizer == -(-n * 12 // 8)
    assert est.peak.states.weights == 2 * n


def test_adafactor_factors_each_expert_matrix(tmp_path):
    """torch's Adafactor keeps row_var and col_var over the last two dimensions of a 3-D expert tensor:
    E (r + c) values for E x r x c."""
    from memplan.memory import optimizers

    model = ModelSpec(**MOE_SPEC)
    training = TrainingSpec(optimizer="adafactor", precision="bf16-true")
    shapes = weight_shapes(model, "separate")
    gate_up = [w for w in shapes["layer"] if w.batch is not None][0]
    tensor = gate_up.on_gpu(model.symbols(t=1), True)
    assert (tensor.batch, tensor.rows, tensor.cols) == (8, 96, 64)
    assert optimizers.state_bytes(training, [(tensor, 1)]) == 2 * 8 * (96 + 64)


# --- activations: a traced MoE model against a real CPU run --------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("config", [MIXTRAL, {**QWEN3_MOE_DENSE_FIRST, "num_hidden_layers": 2},
                                    {**DEEPSEEK_V3, "num_hidden_layers": 2}],
                         ids=["mixtral", "qwen3-moe-dense-first", "deepseek-v3"])
def test_traced_moe_estimate_equals_a_real_run(config, tmp_path):
    """estimate's retained activations for a traced MoE model are what the real model saves on CPU
    (transformers' grouped_mm experts; every saved storage once). With a dense first layer the model
    has two layer groups, each weighted by its share of the layers (1/2 here: whole bytes at even s b;
    memplan/inventory/traced.py floors each term's mean bytes per layer otherwise)."""
    pytest.importorskip("transformers")
    import yaml

    from memplan.inventory.traced_file import file_name
    from validation.trace import trace_hf_config
    from validation.trace_measure import measure_hf_config

    (tmp_path / "config.json").write_text(json.dumps(config))
    data = trace_hf_config(config, impl="hf-sdpa", kernels="cpu", moments=False)
    (tmp_path / file_name("hf-sdpa", "cpu")).write_text(yaml.safe_dump(data, sort_keys=False))
    model = read_hf_config(str(tmp_path / "config.json")).model.model_copy(update={"inventory": str(tmp_path)})
    for s, b in ((32, 2), (48, 3)):
        config_ = make_config(ModelPreset(model), training=dict(micro_batch=b), model=dict(seq_length=s))
        est = estimate(config_, impl="hf-sdpa", device="cpu")
        assert est.stages[0].activations == measure_hf_config(config, s, b, impl="hf-sdpa")["total"], (s, b)
    assert est.total_params == total_params(model)


@pytest.mark.parametrize("optimizer", ["adamw", "adafactor"])
def test_search_equals_estimate_for_moe(optimizer):
    """The planner's vectorised memory of an MoE model equals estimate's walk, plan for plan (the experts'
    3-D tensors in the optimizer's per-tensor states included)."""
    from memplan.plan.search import search
    from memplan.presets.batch import search_inputs
    from memplan.presets.catalog import load_gpu

    a100 = load_gpu("a100-80gb")
    model, training, gb = search_inputs(load_model("qwen3-30b-a3b"), 16, seq_length=2048,
                                        training=dict(optimizer=optimizer))
    result = search(model, training, 16, gb, 10**15, gpu=a100, top=1, impl="hf-sdpa")
    assert result.candidates > 10
    for i in range(0, result.candidates, max(1, result.candidates // 12)):
        est = estimate(result.config(i), gpu=a100, impl="hf-sdpa")
        assert int(result.evaluated.peak_bytes[i]) == int(est.step.peak_bytes), i
        assert int(result.evaluated.device_bytes[i]) == int(est.flat_total), i


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_dense_first_layers_peak_at_the_critical_moments(recompute, tmp_path):
    """With dense layers first, the backward's gradients grow at another rate once it reaches them: the
    step peak at the critical moments (what the planner evaluates) equals the walk over every layer."""
    pytest.importorskip("transformers")
    import yaml

    from memplan.plan.estimate import step_peaks
    from memplan.inventory.traced_file import file_name
    from validation.trace import trace_hf_config

    config = {**QWEN3_MOE, "num_hidden_layers": 8, "mlp_only_layers": [0, 1, 2]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    data = trace_hf_config(config, impl="hf-sdpa", kernels="cpu", moments=False)
    assert [g["layers"] for g in data["layer_groups"]] == [[0, 1, 2], [3, 4, 5, 6, 7]]
    (tmp_path / file_name("hf-sdpa", "cpu")).write_text(yaml.safe_dump(data, sort_keys=False))
    model = read_hf_config(str(tmp_path / "config.json")).model.model_copy(update={"inventory": str(tmp_path)})
    assert model.moe_first_dense_layers == 3
    for optimizer in ("adamw", "sgd"):
        cfg = make_config(ModelPreset(model), training=dict(micro_batch=2, recompute=recompute, optimizer=optimizer),
                          model=dict(seq_length=64))
        est = estimate(cfg, impl="hf-sdpa", device="cpu")
        critical = step_peaks(cfg, est.inventory)[0]
        assert critical.peak_bytes == est.step.peak_bytes
        assert est.total_params == total_params(model) == sum(p.numel() for p in _hf_model(config).parameters())


# --- DeepSeek-V3: multi-head latent attention ---------------------------------------------------------

def test_deepseek_v3_published_size(tmp_path):
    """DeepSeek-V3's published config.json (values as published by deepseek-ai): 671 B parameters, 37 B active
    (DeepSeek-V3 technical report), without the multi-token-prediction module transformers does not build."""
    from memplan.memory.states import active_params

    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
              "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
              "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
              "num_experts_per_tok": 8, "first_k_dense_replace": 3, "kv_lora_rank": 512, "q_lora_rank": 1536,
              "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 129280,
              "tie_word_embeddings": False, "max_position_embeddings": 163840, "hidden_act": "silu",
              "num_nextn_predict_layers": 1}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    preset = read_hf_config(str(path))
    assert total_params(preset.model) == 671_026_404_352
    assert active_params(preset.model) == 37_552_282_624
    assert any("multi-token-prediction" in n for n in preset.notes)


def test_latent_attention_flops_by_hand(tmp_path):
    """Per token, forward: the latent projections 2 x their weights (states.mla_qkv_count), the output
    projection 2 a d_v h; the attention core 2 s a (d_n + d_r) for QK^T and 2 s a d_v over V, per token."""
    model = _spec(DEEPSEEK_V3, tmp_path)
    s, h, a, v, L = model.seq_length, 64, 4, 512, 3
    projections = 32 * 64 + 4 * 24 * 32 + 24 * 64 + 4 * 32 * 16 + 64 * 64  # q_a, q_b, kv_a, kv_b, o (no norms)
    moe_mlp = 3 * h * (2 * 32 + 32) + h * 8  # top-2 experts and the shared one (f_e = f_s = 32), the router
    dense_mlp = 3 * h * 160
    core = 2 * s * a * (16 + 8) + 2 * s * a * 16
    forward_per_token = L * (2 * projections + core) + 2 * (2 * moe_mlp + dense_mlp) + 2 * h * v
    assert model_flops(model, 1) == pytest.approx(3 * forward_per_token * s, rel=1e-12)


@pytest.mark.parametrize("change, message", [
    (dict(qk_nope_head_dim=None), "kv_lora_rank=16 \\(multi-head latent attention\\) needs qk_nope_head_dim"),
    (dict(kv_lora_rank=None), "q_lora_rank is a multi-head latent attention field: it needs kv_lora_rank"),
])
def test_bad_latent_attention_fields_are_refused(change, message):
    spec = {**MOE_SPEC, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
            "v_head_dim": 16}
    with pytest.raises(MemplanError, match=message):
        build(ModelSpec, {**spec, **change})


def test_latent_attention_refused_for_the_reference_layer(tmp_path):
    # --impl megatron / megatron-local model it (memplan/inventory/mla.py, tests/test_mla.py); the K22 reference layer not
    model = _spec(DEEPSEEK_V3, tmp_path)
    dense = model.model_copy(update=dict(num_experts=None, moe_top_k=None, moe_ffn_hidden_size=None,
                                         moe_shared_ffn_hidden_size=0, moe_first_dense_layers=0))
    with pytest.raises(MemplanError, match="no reference torch layer \\(--impl torch\\) inventory for multi-head"):
        estimate(make_config(ModelPreset(dense)), impl="torch")
    assert estimate(make_config(ModelPreset(dense)), impl="megatron").total_params == total_params(dense)


@pytest.mark.parametrize("name, total, active, published", [
    # Mixtral 8x22B (Mistral AI, "Cheaper, Better, Faster, Stronger", 2024-04-17: 141 B parameters, 39 B active; HF
    # mistralai/Mixtral-8x22B-v0.1 config.json): h 6144, L 56, 48 heads of 128, 8 K/V heads, 8 experts of f 16384,
    # top 2, v 32000 untied. Per layer: attention 6144 x (6144 + 2 x 1024) + 6144 x 6144 = 88,080,384; experts
    # 8 x 3 x 6144 x 16384 = 2,415,919,104; router 8 x 6144 = 49,152; norms 2 x 6144: 2,504,060,928. x 56 =
    # 140,227,411,968, + embedding and LM head 2 x 32000 x 6144 = 393,216,000, + final norm 6144 = 140,620,634,112.
    # Active: minus 56 x 6 x 3 x 6144 x 16384 = 101,468,602,368 -> 39,152,031,744.
    ("mixtral-8x22b", 140_620_634_112, 39_152_031_744, (141, 39)),
    # Qwen3-235B-A22B (Qwen3 technical report, arXiv 2505.09388, Table 2: 235 B total, 22 B activated; HF
    # Qwen/Qwen3-235B-A22B config.json): h 4096, L 94, 64 heads of 128, 4 K/V heads, 128 experts of 1536, top 8,
    # q / k norms, v 151936 untied. Per layer: attention 4096 x (8192 + 2 x 512) + 8192 x 4096 = 71,303,168;
    # q / k norms 2 x 128; experts 128 x 3 x 4096 x 1536 = 2,415,919,104; router 128 x 4096 = 524,288; norms
    # 2 x 4096: 2,487,755,008. x 94 = 233,848,970,752, + 2 x 151936 x 4096 = 1,244,659,712, + 4096 =
    # 235,093,634,560. Active: minus 94 x 120 x 3 x 4096 x 1536 = 212,902,871,040 -> 22,190,763,520.
    ("qwen3-235b-a22b", 235_093_634_560, 22_190_763_520, (235, 22)),
])
def test_large_moe_presets_have_their_published_sizes(name, total, active, published):
    from memplan.memory.states import active_params

    model = load_model(name).model
    assert model.is_moe and model.inventory is not None  # traced inventories shipped (--impl hf-*)
    assert (total_params(model), active_params(model)) == (total, active)
    assert (round(total / 1e9), round(active / 1e9)) == published


@pytest.mark.parametrize("gpus, edp_words", [(8, "their states not sharded (one expert-data-parallel rank)"),
                                             (16, "their states sharded over the 2 expert-data-parallel ranks")])
def test_the_expert_note_counts_the_expert_data_parallel_ranks(gpus, edp_words):
    # Megatron-LM's expert-data-parallel size is t cp d / (ep etp): mixtral-8x7b with t = 1, ep = 8 on 8 GPUs (d = 8)
    # gives 8 / 8 = 1 (nothing to shard over), on 16 GPUs 16 / 8 = 2
    notes = " ".join(memplan.estimate("mixtral-8x7b", gpus=gpus, tp=1, ep=8, global_batch=gpus).notes)
    assert f"ep = 8, etp = 1: 1 experts per GPU, {edp_words}" in " ".join(notes.split())
