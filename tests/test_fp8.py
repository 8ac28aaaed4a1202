"""FP8 with Transformer Engine as Megatron-LM runs it (memplan/inventory/fp8.py): DERIVED from TE's code, not measured, so
every expected value here is a hand derivation from TE's saved-tensor list and states, written in the comments."""

import pytest

from memplan.inventory import fp8 as fp8_module
from memplan.plan.estimate import estimate
from memplan.memory.term_bytes import PlanValues
from memplan.timing.flops import layer_matmul_flops
from memplan.timing.layer import layer_forms
from memplan.presets.catalog import load_gpu
from memplan.core.model import ModelSpec
from memplan.core.specs import Config, ParallelSpec
from memplan.core.training import TrainingSpec
from memplan.inventory.assemble import inventory_for

# A Llama-layout model (RMSNorm, SwiGLU, GQA, flash attention, no bias, no dropout): q = h = 256, g/a = 1/4, f = 512.
LLAMA = ModelSpec(name="small-llama", num_layers=4, hidden_size=256, num_attention_heads=8, num_kv_heads=2,
                  ffn_hidden_size=512, seq_length=256, vocab_size=1024, norm="rmsnorm", mlp="swiglu",
                  position_embedding="rope", tied_embeddings=False, dropout=False, bias=False, attention="flash")
s, b, h, f, L = 256, 1, 256, 512, 4


def layer_bytes(model=LLAMA, fp8=None, device="cpu"):
    """One layer's saved bytes (no recompute, t = 1, no SP)."""
    inv = inventory_for(model, "megatron", device, fp8=fp8)
    values = model.symbols(b=b, t=1)
    return sum(t.bytes(values, 2, 0) for t in inv.terms if t.scope == "layer"), inv


def test_saved_inputs_of_the_four_gemms_are_fp8():
    # TE saves each GEMM input's FP8 copy (linear.py _linear_forward_impl: update_usage(rowwise_usage=False,
    # columnwise_usage=True); layernorm_linear.py: ln_out.update_usage(rowwise_usage=False)) instead of bf16:
    #   qkv_input 2sbh -> sbh, fc1_input 2sbh -> sbh, fc2_input 2sbf -> sbf: -(sbh + sbh + sbf)
    # the flash kernel keeps its bf16 output; linear_proj saves an FP8 copy of it: + sbq (q = h)
    # one fp32 scale_inv per FP8 tensor (delayed / tensorwise): + 4 x 4 bytes
    bf16, _ = layer_bytes()
    delayed, inv = layer_bytes(fp8="delayed")
    expected = -(s * b * h + s * b * h + s * b * f) + s * b * h + 4 * 4
    assert delayed - bf16 == expected == -(256 * 256 + 256 * 512) + 16
    assert layer_bytes(fp8="tensorwise")[0] == delayed  # the same layout, only the scaling differs
    # blockwise: fp32 scales of 1 x 128 blocks instead of the scalar: 4 bytes per 128 elements of each FP8 tensor
    blockwise, _ = layer_bytes(fp8="blockwise")
    fp8_elements = s * b * h * 3 + s * b * f  # qkv, proj copy, fc1 (h wide), fc2 (f wide)
    assert blockwise - delayed == fp8_elements * 4 // 128 - 16
    # eager (unfused) attention: only linear_proj saves its input, so proj_input itself becomes FP8 (-sbq, no copy)
    eager = LLAMA.model_copy(update={"attention": "eager"})
    assert layer_bytes(eager, "delayed")[0] - layer_bytes(eager)[0] == -(s * b * h * 3 + s * b * f) + 16
    assert {t.id: t.dtype for t in inv.terms}["fc2_input"] == "fp8"


def test_removing_the_fp8_copy_of_the_attention_output_fails(monkeypatch):
    """The FP8 copy linear_proj saves beside the flash kernel's bf16 output is one term: without it the layer is
    sbq lighter, and the hand derivation above no longer holds."""
    bf16, _ = layer_bytes()
    original = fp8_module.fp8_terms
    monkeypatch.setattr(fp8_module, "fp8_terms", lambda *a: [t for t in original(*a) if t.id != "proj_input_fp8"])
    delayed, _ = layer_bytes(fp8="delayed")
    assert delayed - bf16 != -(256 * 256 + 256 * 512) + 16


def test_scale_inv_is_one_allocator_block_on_cuda():
    # on CUDA each 4-byte scale_inv is its own 512-byte block (PyTorch's caching allocator)
    inv = inventory_for(LLAMA, "megatron", "cuda", fp8="delayed")
    from memplan.memory.term_bytes import TermBytes

    sizes = TermBytes(LLAMA, PlanValues(1, 1, 1, 1, 0, 0, 1, b, 0, L, 1), 2, inv.granularity)
    scales = [t for t in inv.terms if t.id.endswith("_scale_inv")]
    assert len(scales) == 4 and all(sizes(t) == 512 for t in scales)


def config(**training):
    return Config(model=LLAMA, parallel=ParallelSpec(), training=TrainingSpec(**training))


def linear_params():
    # QKV h (q + 2qg/a) + projection q h + fc1 2hf + fc2 h f, per layer (t = 1)
    q, g_a = 256, 2 / 8
    return int(h * (q + 2 * q * g_a) + q * h + 2 * h * f + h * f)


def test_weight_caches_and_scaling_state():
    # TE caches each linear's FP8 weight, row- and column-wise (linear.py: weight_quantizer.set_usage(rowwise=True,
    # columnwise=...), kept in _fp8_workspaces["weight"]): 2 bytes per linear weight, L layers.
    # delayed scaling, per TE module (one GEMM): scale 3 + history len x 3 (forward), scale 2 + history len x 2
    # (backward), fp32 (quantization.py DelayedScalingRecipeState): 4 x (12 + 12 len + 8 + 8 len) per layer.
    base = estimate(config(), device="cpu").peak.weights
    for n in (1, 1024):
        got = estimate(config(fp8="delayed", fp8_amax_history_len=n), device="cpu").peak.weights - base
        assert got == L * (2 * linear_params() + 4 * (12 + 12 * n + 8 + 8 * n))
    assert estimate(config(fp8="tensorwise"), device="cpu").peak.weights - base == L * 2 * linear_params()
    # --fp8-param-gather: the weights are FP8 with their transpose (1 + 1 bytes) instead of bf16 (2) + cache (2)
    gathered = estimate(config(fp8="tensorwise", fp8_param_gather=True), device="cpu").peak.weights
    assert gathered == base


def test_removing_the_weight_cache_fails(monkeypatch):
    base = estimate(config(), device="cpu").peak.weights
    monkeypatch.setattr(fp8_module, "WORKSPACE_BYTES", 0)
    assert estimate(config(fp8="tensorwise"), device="cpu").peak.weights - base != L * 2 * linear_params()


def test_fc2_output_gradient_copies_at_the_mlp_backward():
    # fc2's output gradient quantized in both usages (linear.py _linear_backward: set_usage(rowwise=True,
    # columnwise=True)): 2 x sbh bytes more at the MLP backward moment; the layer's saved bytes there drop by the
    # same FP8 savings as above (everything but ln2's and fc1's tensors... freed as before)
    inv = inventory_for(LLAMA, "megatron", "cpu", fp8="delayed")
    moment = next(m for m in inv.moments if m.id == "mlp_backward")
    added = [t for t in moment.transients if t.dtype == "fp8"]
    values = LLAMA.symbols(b=b, t=1)
    assert sum(t.bytes(values, 2, 0) for t in added) == s * b * h and sum(t.storages for t in added) == 2
    attention = next(m for m in inv.moments if m.id == "attention_backward")
    assert {"proj_input_fp8", "fc1_input_scale_inv", "fc2_input_scale_inv"} <= set(attention.freed)


def test_fp8_gemms_run_at_the_fp8_peak():
    # the layer's weight GEMMs: FLOPs / (peak_fp8 x efficiency); the attention core stays at the bf16 peak
    gpu = load_gpu("h100-80gb")
    bf16 = layer_forms(LLAMA, gpu, 2, "megatron", False).fwd_compute
    fp8 = layer_forms(LLAMA, gpu, 2, "megatron", True).fwd_compute
    gemms = layer_matmul_flops(LLAMA) / gpu.matmul_efficiency
    assert bf16.t - fp8.t == pytest.approx(gemms / 989e12 - gemms / 1979e12, rel=1e-9)
    # and the casts: (A + 2) bytes per element of the four GEMM inputs (forward) and output gradients (backward)
    by = layer_forms(LLAMA, gpu, 2, "megatron", True).fwd_memory
    by0 = layer_forms(LLAMA, gpu, 2, "megatron", False).fwd_memory
    hbm = gpu.memory_bandwidth * gpu.memory_bound_efficiency
    assert (by.r - by0.r) * hbm == pytest.approx(4 * s * 2 * h) and (by.t - by0.t) * hbm == pytest.approx(4 * s * (h + f))


def test_search_equals_estimate_with_fp8_and_loss_chunks():
    from memplan.plan.estimate import device_bytes
    from memplan.plan.search import search

    training = TrainingSpec(fp8="delayed", fp8_param_gather=True, loss_chunks=4, global_batch=16)
    gpu = load_gpu("h100-80gb")
    result = search(LLAMA, training, 8, 16, 10**10, gpu=gpu, top=3)
    assert result.top and all(result.row(i)["zero"] <= 1 for i in result.top)  # FP8: no Megatron-FSDP
    for i in result.top:
        assert result.row(i)["memory"]["device_bytes"] == device_bytes(result.config(i), gpu=gpu)


@pytest.mark.parametrize("extra, fragment", [
    (["--fp8", "delayed", "--impl", "hf-sdpa"], "modelled for --impl megatron"),
    (["--fp8", "tensorwise", "--impl", "torch"], "modelled for --impl megatron"),
    (["--fp8", "mxfp8"], "Blackwell"),
    (["--fp8", "delayed", "--gpu", "a100-80gb"], "no FP8 tensor cores"),
    (["--fp8", "delayed", "--zero", "2", "--dp", "2"], "Megatron-FSDP"),
    (["--fp8-param-gather"], "need --fp8 RECIPE"),
])
def test_refused_with_one_line(run_cli, extra, fragment):
    code, _, err = run_cli("estimate", "--model", "llama3-8b", *extra)
    assert code == 2 and fragment in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_estimate_says_derived(run_cli):
    code, out, _ = run_cli("estimate", "--model", "llama3-8b", "--gpu", "h100-80gb", "--fp8", "delayed")
    assert code == 0 and "DERIVED from Transformer Engine's code" in " ".join(out.split())
    assert "FP8 delayed" in out  # the plan line
    code, out, _ = run_cli("impls")
    assert "--fp8" in out and "NOT MEASURED" in out


def test_fp8_lowers_the_peak_only_with_fp8_weights():
    """Derived consequence, stated in the README: FP8 halves the GEMM inputs saved, but TE's cached FP8 weights
    cost 2 bytes per linear weight; with --fp8-param-gather the weights cost no more than bf16 and the peak drops."""
    base = estimate(config(), device="cpu").step.peak_bytes
    cached = estimate(config(fp8="delayed"), device="cpu").step.peak_bytes
    gathered = estimate(config(fp8="delayed", fp8_param_gather=True), device="cpu").step.peak_bytes
    assert gathered < base and cached > gathered
