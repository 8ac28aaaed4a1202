"""The step time of torchtitan's float8 linears (memplan/inventory/titan_float8.py cast_traffic, weight_cast_bytes;
memplan/timing/layer.py layer_forms): the converted linears' GEMMs at the GPU's FP8 peak and torchao's casts as
memory traffic, each against a hand count from torchao's code (float8_linear.py matmul_with_hp_or_float8_args,
float8_scaling_utils.py hp_tensor_to_float8_dynamic). Derived: no GPU timed these kernels."""

import pytest

from memplan import estimate
from memplan.inventory import titan_float8
from memplan.presets.catalog import load_gpu, load_model
from memplan.timing.flops import layer_matmul_flops
from memplan.timing.layer import layer_forms
from memplan.timing.traffic import layer_traffic_bytes

# llama3-8b: h 4096, q 4096, K/V 2 x 8 x 128 = 2048, f 14336
H, Q, KV, F = 4096, 4096, 2048, 14336


@pytest.mark.parametrize("compiled, per", [(False, 33), (True, 5)])
def test_cast_traffic_by_hand(compiled, per):
    # per element cast, eager: abs 2 + 2, max 2, to(float32) 2 + 4, x scale 4 + 4, clamp 4 + 4, to(float8) 4 + 1 = 33 B;
    # compiled: the amax's read 2, the cast's read 2 and 1-byte write = 5 B
    model = load_model("llama3-8b").model
    s = model.seq_length
    base = layer_traffic_bytes(model, 2, fused=compiled)
    by = titan_float8.cast_traffic(model, compiled, base)
    col_in = H + H + H  # wqkv's, w1's and w3's inputs (the norms' outputs; w1 and w3 cast theirs each)
    row_in = Q + F  # wo's and w2's inputs
    col_grad = (Q + KV) + F + F  # wqkv's, w1's and w3's output gradients
    row_grad = H + H  # wo's and w2's output gradients
    assert by.replicated_fwd - base.replicated_fwd == per * s * col_in
    assert by.tp_fwd - base.tp_fwd == per * s * row_in
    # the backward: each output gradient cast twice (dim 0, dim 1), each bf16 input again (dim 1)
    assert by.replicated_bwd - base.replicated_bwd == per * s * (2 * row_grad + col_in)
    assert by.tp_bwd - base.tp_bwd == per * s * (2 * col_grad + row_in)


def test_weight_casts_and_fp8_gemms_by_hand():
    model, gpu = load_model("llama3-8b").model, load_gpu("h100-80gb")
    weights = H * (Q + KV) + Q * H + 3 * H * F  # the five converted linears: 218,103,808 elements
    assert weights == 218_103_808
    hbm = gpu.memory_bandwidth * gpu.memory_bound_efficiency
    bf16 = layer_forms(model, gpu, 2, "torchtitan", compiled=True)
    rowwise = layer_forms(model, gpu, 2, "torchtitan", compiled=True, float8="rowwise")
    tensorwise = layer_forms(model, gpu, 2, "torchtitan", compiled=True, float8="tensorwise")
    # rowwise casts every bf16 weight in the forward and again in the backward, per micro-batch and TP rank
    assert rowwise.fwd_memory.w == pytest.approx(5 * weights / hbm) and rowwise.bwd_memory.w == pytest.approx(5 * weights / hbm)
    # tensorwise gets them in float8 from FSDP2's float8 all-gather
    assert tensorwise.fwd_memory.w == 0 and bf16.fwd_memory.w == 0
    # the weight GEMMs at the FP8 peak, the attention core at bf16's: the difference is the matmuls' alone
    saved = layer_matmul_flops(model) * (1 / gpu.peak_bf16_flops - 1 / gpu.peak_fp8_flops) / gpu.matmul_efficiency
    assert bf16.fwd_compute.t - rowwise.fwd_compute.t == pytest.approx(saved)


def test_compile_and_float8_faster_than_compile_eager_float8_slower():
    # torchtitan's guidance (and its published tables: +28 % with compile + float8 over compile, Table 1 of
    # benchmarks/llama3_h100_202412_torchtitan.md): float8 pays off compiled; eager, its casts' op-by-op passes
    # outweigh the faster GEMMs in this model
    kw = dict(impl="torchtitan", gpus=8, ac="full", seq_len=8192, micro_batch=2, global_batch=16, gpu="h100-80gb")
    time = {(c, f): estimate("llama3-8b", compile=c, float8=f, **kw).estimate.perf.step_time_s
            for c in (False, True) for f in (None, "tensorwise")}
    assert time[True, "tensorwise"] < time[True, None] < time[False, None] < time[False, "tensorwise"]


def test_tensorwise_all_gathers_the_linear_weights_at_one_byte():
    # FSDP2's float8 all-gather (tensorwise, as torchtitan <= 0.2 ran it) sends the five converted linears' weights
    # at 1 B per element instead of bf16's 2: 218,103,808 B less per layer and micro-batch pass; rowwise gathers bf16
    model = load_model("llama3-8b").model
    assert titan_float8.gathered_bytes_saved(model, "tensorwise", 2) == 218_103_808
    assert titan_float8.gathered_bytes_saved(model, "rowwise", 2) == 0 == titan_float8.gathered_bytes_saved(model, None, 2)
    # on 128 GPUs FSDP2's all-gathers are exposed with compile: tensorwise's halved linear weights shorten the step
    kw = dict(impl="torchtitan", gpus=128, ac="none", seq_len=8192, micro_batch=2, global_batch=256, gpu="h100-80gb",
              compile=True)
    dp = {f: estimate("llama3-8b", float8=f, **kw).estimate.perf.dp_comm_exposed_s for f in ("rowwise", "tensorwise")}
    assert dp["tensorwise"] < dp["rowwise"]
