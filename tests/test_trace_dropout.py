"""`--kernels cpu` against `--kernels cuda` when attention dropout is on (validation/trace_cuda.py, ``CudaKernels``).

With ``attention_dropout > 0`` torch's CPU sdpa cannot use its flash kernel and runs the math path (fp32 copies of
q, k, v and three s x s tensors), and the CPU ``at::dropout`` keeps a ``bernoulli_`` mask in the input's dtype. The
CUDA trace must keep what CUDA's kernels keep instead: FlashAttention-2 (no mask) or the memory-efficient kernel (a
mask) with their output, fp32 logsumexp and Philox RNG state, and ``native_dropout``'s 1-byte bool mask, as it does
without dropout. Each test traces one config with both kernels and pins every saved tensor that differs, by hand.

Tiny configs: h = 64, a = 4 heads of d = 16 (g = 2 key / value heads), one decoder layer, bf16, attention_dropout
0.1. Sizes below are bytes per layer with s the sequence length and b the micro-batch.
Where the figures come from (torch 2.13's sources, read, not measured on a GPU here):
* torch's math sdpa (aten/src/ATen/native/transformers/attention.cpp, ``_scaled_dot_product_attention_math``):
  bf16 q, k, v upcast to fp32, q and k each scaled by sqrt(scale), k and v repeated to the a query heads (GQA),
  ``softmax(q kT)``, ``at::dropout``, ``@ v``, the result cast back to bf16;
* FlashAttention-2 (flash_attn/flash_api.cpp ``mha_fwd``): q, k, v and the output kept, output allocated as
  [b, s, a, d] (the layout of q before transformers' transpose), softmax_lse fp32 [b, a, s], ``rng_state`` uint64
  [2] and ``_unused`` uint64 [] allocated on the GPU with or without dropout (torch/_meta_registrations.py gives
  the same shapes and dtypes);
* memory-efficient attention (``_scaled_dot_product_efficient_attention``, torch/_meta_registrations.py): output,
  fp32 logsumexp [b, a, ceil(s / 32) * 32], int64 philox seed and offset [] (8 bytes each), and the attention bias;
* ``at::dropout`` (aten/src/ATen/native/Dropout.cpp): on CUDA ``native_dropout`` for 0 < p < 1, which keeps a bool
  mask; on CPU ``input * bernoulli_(1 - p) / (1 - p)``, which keeps the noise in the input's dtype.
"""

from collections import Counter

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from validation import trace as tr  # noqa: E402
from validation import trace_cuda as tcu  # noqa: E402
from validation import trace_measure as tm  # noqa: E402
from validation.trace_config import tiny  # noqa: E402

SDPA = "scaled_dot_product_attention"


# torch's sdpa priority where cuDNN attention is not preferred (an A100, a cuDNN up to 9.15.0, or
# TORCH_CUDNN_SDPA_DEPRIORITIZED=1): flash, memory-efficient, math. The H100 default (cuDNN first) is checked against
# measured GPU figures in tests/test_cuda_dropout.py.
NO_CUDNN = tuple(k for k in tcu.SDPA_ORDER if k != "cudnn")


def _pair(config: dict, impl: str, sdpa: tuple = tcu.SDPA_ORDER) -> tuple[dict, dict]:
    """The config traced with CPU's kernels and with CUDA's (`sdpa`: the CUDA sdpa kernels tried, in order); the
    CPU trace checked against a real CPU run (what every layer saves, measured with saved_tensors_hooks), so that
    the differences pinned below start from measured CPU figures."""
    cpu, cuda = (tr.trace_hf_config(config, impl, kernels=k, moments=False, sdpa=sdpa) for k in ("cpu", "cuda"))
    for s, b in ((32, 2), (48, 3)):  # s >= the windows below, a multiple of 16
        assert tm.predicted_bytes(cpu, s, b)["layers"] == tm.measure_hf_config(config, s, b, impl)["layers"]
    return cpu, cuda


def _differences(cpu: dict, cuda: dict) -> tuple[Counter, Counter]:
    """(what only the CPU trace keeps, what only the CUDA one keeps) in the decoder layer, as
    (op, dtype, bytes) with the op's last dotted name (``linear``, ``scaled_dot_product_attention[flash]``)."""
    def terms(inv):
        (group,) = inv["layer_groups"]
        return Counter((t["op"].rsplit(".", 1)[-1], t["dtype"], t["bytes"]) for t in group["terms"])

    a, b = terms(cpu), terms(cuda)
    assert cpu["outside"] == cuda["outside"]  # embedding, final norm, head, loss: no dropout, no sdpa
    return a - b, b - a


# the CPU math path with dropout, for d = 16 (no mask: flash's counterpart; a sliding-window mask: efficient's)
CPU_MATH = Counter({
    # q * sqrt(scale) and (k repeated to a = 4 heads)T * sqrt(scale), fp32, saved by the q kT matmul:
    # 4 bytes * b * a * s * d = 4 * 4 * 16 s b each
    (f"{SDPA}[math]", "float32", "256 s b"): 3,  # + v repeated to 4 heads, fp32, saved by attn @ v: the same size
    # softmax's output (saved by softmax), dropout's fp32 bernoulli noise (saved by the mask's multiply) and the
    # dropped weights (saved by attn @ v): fp32 [b, a, s, s] = 4 * 4 s^2 b each
    (f"{SDPA}[math]", "float32", "16 s^2 b"): 3,
    # o_proj's input: the math output [b, a, s, d] cast to bf16, transposed to [b, s, a d] by a contiguous copy:
    # 2 * 64 s b (on CUDA the kernel's output is already [b, s, a, d]: o_proj saves that storage, counted as sdpa's)
    ("linear", "bfloat16", "128 s b"): 1,
})


def test_sdpa_with_dropout_is_flash_attention_on_cuda():
    """No mask (is_causal): CPU's math path against FlashAttention-2, which supports dropout."""
    cpu, cuda = _pair(tiny("llama", num_hidden_layers=1, attention_dropout=0.1), "hf-sdpa", NO_CUDNN)
    cpu_only, cuda_only = _differences(cpu, cuda)
    assert cpu_only == CPU_MATH
    assert cuda_only == Counter({
        (f"{SDPA}[flash]", "bfloat16", "128 s b"): 2,  # q [b, a, s, d] and the output [b, s, a, d]: 2 * 4 * 16 s b
        # k and v unrepeated (no mask: transformers passes enable_gqa): [b, g, s, d] = 2 * 2 * 16 s b each
        (f"{SDPA}[flash]", "bfloat16", "64 s b"): 2,
        (f"{SDPA}[flash]", "float32", "16 s b"): 1,  # softmax_lse [b, a, s]: 4 * 4 s b
        (f"{SDPA}[flash]", "uint64", "16"): 1,  # rng_state [2]: the Philox seed and offset the backward replays
        (f"{SDPA}[flash]", "uint64", "8"): 1,  # _unused []
    })
    assert cpu["conditions"] == cuda["conditions"] == ["s >= 2", "b >= 2"]


def test_sdpa_with_a_mask_and_dropout_is_efficient_attention_on_cuda():
    """Mistral's sliding window (s >= 16: an explicit mask): no FlashAttention; the memory-efficient kernel keeps
    the mask as an additive bias, its logsumexp padded along s to a multiple of 32 (exact when s % 32 == 0)."""
    cpu, cuda = _pair(tiny("mistral", num_hidden_layers=1, sliding_window=16, attention_dropout=0.1), "hf-sdpa",
                      NO_CUDNN)
    cpu_only, cuda_only = _differences(cpu, cuda)
    assert cpu_only == CPU_MATH  # the CPU math path adds the mask in place: nothing more saved
    assert cuda_only == Counter({
        # q, k, v (k and v repeated to 4 heads by transformers: a mask, so no enable_gqa) and the output:
        # [b, 4, s, 16] bf16 = 2 * 4 * 16 s b each
        (f"{SDPA}[efficient]", "bfloat16", "128 s b"): 4,
        # the bool [b, 1, s, s] window mask as a bf16 additive bias (broadcast over heads, not copied): 2 s^2 b
        (f"{SDPA}[efficient]", "bfloat16", "2 s^2 b"): 1,
        (f"{SDPA}[efficient]", "float32", "16 s b"): 1,  # logsumexp [b, a, 32 ceil(s / 32)]: 4 * 4 s b
        (f"{SDPA}[efficient]", "int64", "8"): 2,  # philox seed and offset, [] each
    })
    assert cpu["conditions"] == ["s >= 16", "b >= 2"]
    assert cuda["conditions"] == ["s >= 16", "b >= 2", "s % 32 == 0"]


def test_sdpa_math_on_cuda_keeps_a_bool_dropout_mask():
    """A mask and d = 20 (not a multiple of 8: neither cuDNN, nor flash, which takes no mask, nor the
    memory-efficient kernel): CUDA runs the math path too, the same fp32 tensors as CPU, except that its ``at::dropout`` is
    ``native_dropout``."""
    cpu, cuda = _pair(tiny("mistral", num_hidden_layers=1, sliding_window=16, head_dim=20, attention_dropout=0.1),
                      "hf-sdpa")
    cpu_only, cuda_only = _differences(cpu, cuda)
    assert cpu_only == Counter({(f"{SDPA}[math]", "float32", "16 s^2 b"): 1})  # fp32 noise [b, a, s, s]: 4 * 4
    assert cuda_only == Counter({(f"{SDPA}[math]", "bool", "4 s^2 b"): 1})  # bool mask [b, a, s, s]: 1 * 4


def test_eager_attention_dropout_keeps_a_one_byte_mask_on_cuda():
    """Eager attention drops its bf16 softmax weights with ``F.dropout``: the one difference is the mask."""
    cpu, cuda = _pair(tiny("llama", num_hidden_layers=1, attention_dropout=0.1), "hf-eager")
    cpu_only, cuda_only = _differences(cpu, cuda)
    assert cpu_only == Counter({("dropout", "bfloat16", "8 s^2 b"): 1})  # bernoulli noise [b, a, s, s]: 2 * 4
    assert cuda_only == Counter({("dropout", "bool", "4 s^2 b"): 1})  # native_dropout's mask: 1 * 4


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("config,impl", [
    (tiny("llama", num_hidden_layers=1, attention_dropout=0.1), "hf-sdpa"),
    (tiny("mistral", num_hidden_layers=1, sliding_window=16, attention_dropout=0.1), "hf-sdpa"),
    (tiny("mistral", num_hidden_layers=1, sliding_window=16, head_dim=20, attention_dropout=0.1), "hf-sdpa"),
    (tiny("llama", num_hidden_layers=1, attention_dropout=0.1), "hf-eager"),
])
def test_cuda_trace_with_dropout_equals_a_real_gpu_run(config, impl):
    """On a GPU: the emulated CUDA trace with dropout against the real kernels' saved storages, per layer (up to
    64 bytes: the RNG state, which a real run may keep on the host or, with cuDNN attention, shape otherwise)."""
    cuda = tr.trace_hf_config(config, impl, kernels="cuda", moments=False)
    for s, b in ((32, 2), (64, 3)):
        measured = tm.measure_hf_config(config, s, b, impl, device="cuda")
        predicted = tm.predicted_bytes(cuda, s, b)
        assert predicted["outside"] == measured["outside"]
        for p, m in zip(predicted["layers"], measured["layers"]):
            assert abs(p - m) <= 64, (s, b, p, m)



class _Loaded(Exception):
    pass


@pytest.mark.parametrize("files,device,kernels", [
    ((), "cuda", "cuda"),  # nothing traced yet: trace CUDA's kernels on first use (it used to trace CPU's)
    (("hf-sdpa-cpu.yaml",), "cuda", "cpu"),  # a CPU kernels' trace already there and no CUDA one: that (reported)
    (("hf-sdpa-cpu.yaml", "hf-sdpa-cuda.yaml"), "cuda", "cuda"),
    ((), "cpu", "cpu"),
])
def test_a_cuda_estimate_traces_cuda_kernels_on_first_use(files, device, kernels, tmp_path, monkeypatch):
    """Which kernels' trace an estimate reads (or traces on first use) for a config.json with no shipped trace:
    CUDA's for --device cuda, so that attention dropout does not bring CPU's s x s tensors into a GPU estimate."""
    from memplan.inventory import traced
    from memplan.presets.catalog import load_model

    def load(directory, impl, kernels_):
        raise _Loaded(kernels_)

    for name in files:
        (tmp_path / name).write_text("")
    monkeypatch.setattr(traced, "load", load)
    model = load_model("qwen3-8b").model.model_copy(update={"inventory": str(tmp_path)})
    with pytest.raises(_Loaded) as loaded:
        traced.traced_inventory(model, "hf-sdpa", device)
    assert loaded.value.args == (kernels,)
