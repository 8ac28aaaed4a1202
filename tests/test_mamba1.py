"""Issue 22: the models with Mamba-1 mixers, Mamba, Falcon-Mamba, Jamba and Zamba (memplan/presets/hf_mamba1.py,
ModelSpec.layer_pattern 1 / J / j / Z, ssm_dt_rank; their activations from mamba-ssm's CUDA kernels stood in while
tracing, validation/trace_mamba1.py).

Parameters: the registry walk (tests/test_registry.py) checks each family's tiny config against transformers' count
of the model built on the meta device; here the switches those defaults leave off and the config classes' full-size
defaults (the published Mamba-130M, Falcon-Mamba-7B, Jamba-v0.1 and Zamba-7B shapes) against the same count.
Activations: a tiny Zamba (its shared block used twice) traced with the stand-ins of causal_conv1d_fn and
selective_scan_fn, its mixers' saves against a hand derivation from mamba-ssm's source; the stand-ins (and Mamba's
mamba_inner_fn) called on small real tensors, their saves against the same source; the trace given to `memplan
estimate`, and the refusals (--device cpu, --impl megatron)."""

from __future__ import annotations

import json

import pytest

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.core.symbolic import Poly

pytest.importorskip("transformers")

import torch  # noqa: E402
import transformers  # noqa: E402

from memplan.check import registry  # noqa: E402
from memplan.memory.states import counter, layer_params  # noqa: E402
from memplan.presets.hf_config import read_hf_config  # noqa: E402
from validation import hf as _hf  # noqa: E402
from validation import trace_mamba1  # noqa: E402
from validation.registry import architectures, meta_params, tiny_config  # noqa: E402
from validation.trace import to_yaml, trace_hf_config  # noqa: E402
from validation.trace_config import hf_config  # noqa: E402


@pytest.mark.parametrize("model_type, switches", [
    ("mamba", dict(use_bias=True, use_conv_bias=False)),  # in_proj / out_proj biases, no conv bias
    ("mamba", dict(time_step_rank=7, intermediate_size=96, state_size=8, conv_kernel=3)),
    ("mamba", dict(intermediate_size=None, expand=3)),  # None: no intermediate_size, expand x h wide
    ("mamba", dict(tie_word_embeddings=False)),
    ("falcon_mamba", dict(use_bias=True, time_step_rank="auto")),  # its dt / B / C norms: buffers, no parameters
    ("jamba", dict(num_experts=1)),  # no experts: a gated MLP in every layer (pattern A / J)
    ("jamba", dict(num_hidden_layers=8, attn_layer_period=4, attn_layer_offset=1, expert_layer_period=3,
                   expert_layer_offset=2)),  # attention, experts and dense MLPs interleaved: J j A ...
    ("jamba", dict(mamba_proj_bias=True, mamba_conv_bias=False, mamba_dt_rank=5, mamba_expand=3)),
    ("zamba", dict(attention_head_dim=16, num_key_value_heads=4, layers_block_type=None, num_hidden_layers=10,
                   attn_layer_period=3, attn_layer_offset=1, mamba_proj_bias=True)),  # ZambaConfig's layout 11Z1Z..
    ("zamba", dict(n_mamba_heads=4, mamba_conv_bias=False, tie_word_embeddings=False)),
])
def test_the_switches_count_exactly(model_type, switches):
    config = {k: v for k, v in {**tiny_config(model_type), **switches}.items() if v is not None or k not in switches}
    assert registry.memplan_params(config) == meta_params(config) != meta_params(tiny_config(model_type))


def _defaults(model_type: str, **fields) -> dict:
    config = json.loads(json.dumps(_hf._transformers().CONFIG_MAPPING[model_type](**fields).to_dict(), default=str))
    return {**config, "architectures": [architectures()[model_type]], "model_type": model_type}


@pytest.mark.parametrize("model_type, fields, meta", [
    # transformers' count of the model built on the meta device (validation/registry.py meta_params on these configs,
    # transformers 5.23): Mamba-130M (24 layers of the defaults' 768), the defaults' 32 layers, Falcon-Mamba-7B's
    # shapes (4096 wide, 64 layers, 65,024 tokens, untied), Jamba-v0.1 (the defaults: the published "52 B")
    ("mamba", dict(num_hidden_layers=24), 129_135_360),
    ("mamba", {}, 159_308_544),
    ("falcon_mamba", dict(hidden_size=4096, num_hidden_layers=64, vocab_size=65024, tie_word_embeddings=False),
     7_272_665_088),
    ("jamba", {}, 51_570_323_328),
    ("zamba", {}, 7_232_490_496),  # Zamba-7B: 76 layers 3712 wide, the shared block used 13 times
])
def test_full_size_defaults_count_exactly(model_type, fields, meta):
    assert registry.memplan_params(_defaults(model_type, **fields)) == meta


@pytest.mark.parametrize("model_type, switches, says", [
    ("jamba", dict(attn_layer_offset=8), "attn_layer_offset"),
    ("jamba", dict(expert_layer_offset=-1), "expert_layer_offset"),
    ("mamba", dict(expand=0), "expand"),
    ("mamba", dict(time_step_rank="many"), "time_step_rank"),
    ("zamba", dict(attention_hidden_size=96), "attention_hidden_size"),  # not 2 h: the block's norm and q / k / v
    ("zamba", dict(n_mamba_heads=3), "not divisible by n_mamba_heads"),
])
def test_what_does_not_fit_is_refused_in_one_line(model_type, switches, says):
    with pytest.raises(MemplanError, match=says) as err:
        registry.memplan_params({**tiny_config(model_type), **switches})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("fields, says", [
    (dict(layer_pattern="1A1"), "Mamba-1"),  # no ssm_dt_rank
    (dict(layer_pattern="AAA", ssm_heads=1, ssm_dt_rank=4), "Mamba-1"),  # a dt rank without a mixer
    (dict(layer_pattern="1S1", ssm_heads=1, ssm_dt_rank=4), "Mamba-2 mixers"),
    (dict(layer_pattern="JjA", ssm_heads=1, ssm_dt_rank=4), "need num_experts"),
])
def test_the_spec_refuses_a_pattern_that_does_not_fit(fields, says):
    base = dict(num_layers=3, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=512, bias=False)
    with pytest.raises(ValueError, match=says):
        ModelSpec(**base, **fields)


# a Zamba with its shared block used twice (layers 1 and 3): attention_hidden_size 2 h, heads 2 h / a wide
ZAMBA = dict(layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid"], num_hidden_layers=4)


@pytest.fixture(scope="module")
def zamba():
    config = {**tiny_config("zamba"), **ZAMBA}
    return config, trace_hf_config(config, impl="hf-sdpa", kernels="cuda", moments=False)


def test_zambas_shared_block_counts_once():
    config = {**tiny_config("zamba"), **ZAMBA}
    assert config["attention_hidden_size"] == 2 * config["hidden_size"]
    assert registry.memplan_params(config) == meta_params(config) == 471_040


@pytest.mark.parametrize("model_type, switches", [("zamba", ZAMBA), ("jamba", {}), ("mamba", {})])
def test_the_largest_layer_is_the_largest_of_the_real_model(model_type, switches, tmp_path):
    """ZeRO-3 gathers one layer at a time: layer_params of a hybrid is its largest layer (Zamba's: a layer that uses
    the shared block, whose tied weights transformers' hybrid layer holds; Jamba's: an experts' layer), equal to the
    largest decoder layer transformers builds on the meta device."""
    config = {**tiny_config(model_type), **switches}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = read_hf_config(str(tmp_path / "config.json")).model
    with torch.device("meta"):
        built = transformers.AutoModelForCausalLM.from_config(hf_config(config))
    layers = built.model.layers if hasattr(built, "model") else built.backbone.layers
    largest = max(sum(p.numel() for p in layer.parameters()) for layer in layers)
    assert layer_params(model, counter(model.symbols(t=1))) == largest


def test_the_mixer_saves_what_the_kernels_save(zamba):
    """The tiny Zamba's mixer (h 64, I = 2 h = 128 in 2 heads of P 64, N 16; bf16 activations, fp32 A / D / delta_bias)
    on CUDA: ZambaMambaMixer copies the convolution's input contiguous ([b, I, s]), which causal-conv1d's
    CausalConv1dFn keeps (256 s b bytes); per head it calls mamba-ssm's selective_scan_fn with u, delta, A (views of
    [b, I, s], [b, I, s] and [I, N] storages: kept once for both heads, 256 s b + 256 s b + 8,192), B and C (views of
    x_proj's output, contiguous: no copy, kept by the matmul that made them), D (its own fp32 copy, 256 each),
    z (the gate's head, copied contiguous: 128 s b each), delta_bias (one fp32 [I] storage: 512), the scan's states
    [b, P, s / 2048, 2 N] fp32 (4 s b each) and out [b, P, s] (128 s b each): in all 256 + 256 + 256 + 2 x (128 + 4
    + 128) = 1,288 s b + 8,192 + 2 x 256 + 512 = 9,216 bytes per mixer, valid for s a multiple of 2048. A Zamba layer
    with the shared block holds its saves once per use, beside its own mixer's."""
    config, data = zamba
    assert "s % 2048 == 0" in data["conditions"] and [g["layers"] for g in data["layer_groups"]] == [[0, 2], [1, 3]]
    for group, prefix in zip(data["layer_groups"], ("mamba.", "mamba_decoder.mamba.")):
        terms = [t for t in group["terms"] if t["id"].startswith((prefix + "causal_conv1d_fn.",
                                                                   prefix + "selective_scan_fn"))]
        assert sum((Poly.parse(t["bytes"]) for t in terms), Poly.parse("0")) == Poly.parse_sum("1288 s b + 9216")
    assert any(t["id"].startswith("shared_transf.self_attn.") for t in data["layer_groups"][1]["terms"])


def test_mamba_inner_fn_saves_what_its_source_saves():
    """mamba-ssm's MambaInnerFn.forward (checkpoint_lvl 1, which recomputes the convolution and delta in the
    backward), called as MambaMixer calls it, keeps xz made contiguous ([b, 2 I, s]: transformers passes in_proj's
    output transposed), the convolution's weight and bias, x_dbl [b s, R + 2 N], the projection weights, A, B and C
    ([b, 1, N, s] contiguous), D, delta_bias, the scan's states [b, I, s / 2048, 2 N] in A's dtype and out [b, I, s];
    it returns out_proj's output, and its backward gradients of its inputs' shapes."""
    b, s, h, i, n, r = 2, 4096, 4, 8, 4, 2
    act, fp32 = torch.bfloat16, torch.float32
    hidden = torch.randn(b, s, h, dtype=act, requires_grad=True)
    in_w, out_w = torch.randn(2 * i, h, dtype=act), torch.randn(h, i, dtype=act)
    conv_w, conv_b = torch.randn(i, 1, 4, dtype=act), torch.randn(i, dtype=act)
    x_w, dt_w = torch.randn(r + 2 * n, i, dtype=act), torch.randn(i, r, dtype=act)
    A = (-torch.rand(i, n)).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        xz = torch.nn.functional.linear(hidden, in_w).transpose(1, 2)
        del saved[:]
        y = trace_mamba1.mamba_inner_fn(xz, conv_w, conv_b, x_w, dt_w, out_w, None, A, None, None, torch.rand(i),
                                        delta_bias=torch.rand(i), delta_softplus=True)
    assert y.shape == (b, s, h)
    assert [(tuple(t.shape), t.dtype) for t in saved] == [
        ((b, 2 * i, s), act), ((i, 4), act), ((i,), act), ((b * s, r + 2 * n), act), ((r + 2 * n, i), act),
        ((i, r), act), ((h, i), act), ((i, n), fp32), ((b, 1, n, s), act), ((b, 1, n, s), act), ((i,), fp32),
        ((i,), fp32), ((b, i, s // 2048, 2 * n), fp32), ((b, i, s), act)]
    assert saved[0].is_contiguous() and saved[0].untyped_storage().data_ptr() != xz.untyped_storage().data_ptr()
    y.float().sum().backward()
    assert hidden.grad.shape == hidden.shape and A.grad.shape == A.shape


def test_jambas_kernels_save_what_their_source_saves():
    """causal-conv1d's CausalConv1dFn keeps its input as given when one of its last two strides is 1 (transformers
    passes a channel-last view of in_proj's output: no copy); mamba-ssm's SelectiveScanFn with z keeps u, delta, B, C
    and z made contiguous (u, B, C and z transposed views: copies), A, D, delta_bias, its states [b, I, s / 2048, 2 N]
    in A's dtype and out [b, I, s]; their backwards give gradients of their inputs' shapes."""
    b, s, i, n = 2, 4096, 8, 4
    xz = torch.randn(b, s, 2 * i, dtype=torch.bfloat16, requires_grad=True)
    x, z = xz.transpose(1, 2).chunk(2, dim=1)
    weight, bias = torch.randn(i, 4, requires_grad=True), torch.randn(i, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        conv = trace_mamba1.causal_conv1d_fn(x, weight, bias, activation="silu")
        assert saved[0].untyped_storage().data_ptr() == xz.untyped_storage().data_ptr()
        del saved[:]
        delta = torch.randn(b, i, s, dtype=torch.bfloat16, requires_grad=True)
        B, C = (torch.randn(b, s, n, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        A, D = (-torch.rand(i, n)).requires_grad_(), torch.rand(i, requires_grad=True)
        out = trace_mamba1.selective_scan_fn(conv.transpose(1, 2).contiguous().transpose(1, 2), delta, A,
                                             B.transpose(1, 2), C.transpose(1, 2), D, z, torch.rand(i),
                                             delta_softplus=True)
    shapes = [(tuple(t.shape), t.dtype, t.is_contiguous()) for t in saved]
    act, fp32 = torch.bfloat16, torch.float32
    assert shapes == [((b, i, s), act, True), ((b, i, s), act, True), ((i, n), fp32, True),
                      ((b, 1, n, s), act, True), ((b, 1, n, s), act, True), ((i,), fp32, True), ((b, i, s), act, True),
                      ((i,), fp32, True), ((b, i, s // 2048, 2 * n), fp32, True), ((b, i, s), act, True)]
    out.float().sum().backward()
    assert xz.grad.shape == xz.shape and B.grad.shape == B.shape and A.grad.shape == A.shape


def test_estimate_answers_with_the_trace(zamba, run_cli, tmp_path):
    """The stand-ins' trace given to `memplan estimate` answers, with the note that says the mixers are mamba-ssm's
    kernels derived from their source; --device cpu and --impl megatron are refused in one line."""
    config, data = zamba
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "trace.yaml").write_text(to_yaml(data))
    args = ["estimate", "--hf-config", str(tmp_path / "config.json"), "--seq-len", "4096", "--impl", "hf-sdpa",
            "--inventory", str(tmp_path / "trace.yaml")]
    code, out, err = run_cli(*args)
    assert code == 0, err
    assert "Mamba-1 mixers" in out and "derived from their source" in out and "not a multiple" not in out
    code, out, err = run_cli(*args[:4], "3000", *args[5:])  # the scan's states: ceil(s / 2048) chunks, no padding
    assert code == 0 and "keeps its states for 2 chunks of 2048 tokens" in out and "pads" not in out
    for extra, says in ((["--device", "cpu"], "Mamba-1 mixers with --device cpu"),):
        code, out, err = run_cli(*args, *extra)
        assert code == 2 and out == "" and says in err and len(err.strip().splitlines()) == 1
    code, out, err = run_cli(*args[:5])  # --impl megatron: no mixer in its inventories
    assert code == 2 and "use --impl hf-sdpa or hf-eager" in err and len(err.strip().splitlines()) == 1


def test_a_cpu_kernels_trace_is_refused():
    with pytest.raises(ValueError, match="loops over s"):
        trace_hf_config(tiny_config("falcon_mamba"), impl="hf-eager", kernels="cpu")
