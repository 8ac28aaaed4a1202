"""Step time, FLOPs and MFU of a training plan: a roofline-style model calibrated on K22 Tables 4
and 5 (A100) and on a K22 layer measured on an H100.

Every function takes the plan as `PlanValues` whose fields are Python scalars or equally shaped
numpy arrays (one element per candidate plan); nothing loops over candidates. Arrays are
times are computed in float32 for both (TIME_DTYPE), so that one plan evaluated alone and the
same plan inside an array of millions give the same numbers, bit for bit.

The model (one GPU of the bottleneck pipeline stage)
----------------------------------------------------
One layer, one micro-batch of b sequences, on each GPU of a tensor-parallel group of t:

- matmuls: QKV 2bsh(h + 2hg/a), output projection 2bsh^2, MLP 2 x 2bshf (SwiGLU: 3 x 2bshf), split
  by t, at `matmul_efficiency` x peak, plus `matmul_overhead_s` per GEMM kernel (4 per layer
  forward in Megatron-LM, gemms_per_layer; 8 in the backward): large GEMMs run near
  matmul_efficiency, small ones lose a fixed time (the last partial wave of tiles, prologue and
  epilogue). The attention core's batched matmuls QK^T and attention over V, 4bs^2h/t (K22
  appendix A), run at the lower attention efficiency; a causal flash kernel executes half of
  those FLOPs (CAUSAL_FLASH_FRACTION) at the GEMM efficiency (assumed: not measured).
  Backward = 2 x forward.
- memory-bound kernels: bytes moved / (HBM bandwidth x memory-bound efficiency). Replicated
  regions (2 layer norms, 2 bias-dropout-residual adds), per token and hidden unit with A = 2:
  forward 2*2A + 2*3A + 2 masks = 22 bytes, backward 2*3A + 2*(2A + 1) + 2*3A = 34 bytes, split
  by t only under sequence parallelism (K22 Table 4's 3% SP gain). Split by t: softmax 2A / 3A
  and attention dropout 2A+1 / 2A+1 bytes per score element (as^2b), GeLU 2A / 3A (SwiGLU
  3A / 5A) per MLP element (sbf), forward / backward. Those are Megatron-LM's fused kernels; an
  implementation that runs PyTorch's eager ops (torch, hf-*) moves more: see layer_traffic_bytes.
- tensor-parallel collectives of V = A*sbh bytes over rings of t GPUs: all-gather or
  reduce-scatter (t-1)/t x V / bw ("ag"), all-reduce twice that, bw = NVLink (t <= gpus_per_node)
  or network x NCCL_BUS_EFFICIENCY. Forward: 2 all-reduces, or with SP 2 all-gathers + 2
  reduce-scatters (the same 4 ag), all exposed. Backward: Megatron-LM runs each column-parallel
  linear's input-gradient all-reduce (with SP: its reduce-scatter and the re-all-gather of the
  sequence-split input, K22 section 4.2.2) next to the weight-gradient GEMM: 4 ag exposed by
  TP_ASYNC_EXPOSED_FRACTION; with SP the all-gathers that are the backward of each row-parallel
  output's reduce-scatter, 2 ag, are on the critical path.
- recompute, per recomputed layer, in the backward: selective re-runs the attention core (its
  matmuls, softmax and dropout; with a flash kernel, megatron-core's checkpointed core attention
  re-runs the kernel's forward, which re-creates only its log-sum-exp); full re-runs the whole
  forward, its communication included (K22 section 5: one more forward, about 33% more FLOPs).

A micro-batch on the bottleneck stage (the last one: it has the LM head, and also the embedding
when p = 1) costs L/p layers' forward + backward, m x recomputed_layers layers' recompute, the LM
head (logits 2bshv/t, fp32 cross-entropy) and, when p = 1, the embedding. A step is

    M micro-batches on the bottleneck stage
    + (p - 1)/m slots of a stage's micro-batch  1F1B / interleaved bubble (Narayanan et al. 2021)
    + pipeline point-to-point (1/t of the tensor per GPU: SP or Megatron-LM's scatter/gather)
    + exposed data-parallel communication + exposed ZeRO-3 gathers
    + the optimizer update (memory-bound)

and MFU = model_flops / (step x t p d x peak_bf16_flops) (K22 appendix A).

Calibration: A100 80GB, K22 Table 4 (22B layer: a=64, h=6144, s=2048, b=4, t=8, A = 2)
-------------------------------------------------------------------------------------
Per GPU: weight matmuls 24bsh^2/t = 9.277e11 FLOP, attention matmuls 4bs^2h/t = 5.154e10 FLOP,
sbh = 5.033e7, score elements as^2b/t = 1.342e8; one ag = (7/8) x 2sbh / (300 GB/s x 0.8) =
0.367 ms (data sheet NVLink rate x NCCL_BUS_EFFICIENCY). Peak 312 TFLOP/s, HBM 2039 GB/s.
Four unknowns, each solved from one published figure, in this order:

1. memory-bound efficiency, from SP's forward gain 7.7 - 7.2 = 0.5 ms, which is the 22sbh
   replicated bytes shrinking by 1 - 1/t: 22 x 5.033e7 x 7/8 / (2039e9 x 0.5e-3) = 0.950 -> 0.95
   (the 0.1 ms print rounding allows 0.79..1.19).
2. attention matmul efficiency, from selective recompute's backward cost 13.2 - 11.9 = 1.3 ms,
   minus its softmax + dropout bytes 9 x 1.342e8 / (2039e9 x 0.95) = 0.624 ms:
   5.154e10 / (0.676e-3 x 312e12) = 0.244 -> 0.24 (head-dim-96 batched matmuls; the efficiency
   also absorbs the transposes of Megatron-LM's unfused attention).
3. the forward GEMM time, from the baseline forward 7.7 ms = GEMMs + 0.688 (attention matmuls at
   0.24) + 1.247 (2.416e9 memory-bound bytes: 22sbh + 9as^2b/t + 4sbf/t) + 1.468 (4 ag):
   4.30 ms for the layer's 4 GEMMs (77-309 GFLOP each), 0.69 of peak.
4. TP_ASYNC_EXPOSED_FRACTION, from the baseline backward 11.9 ms = 2 x 4.309 (GEMMs)
   + 2 x 0.688 + 1.724 (3.339e9 bytes: 34sbh + 11as^2b/t + 6sbf/t) + x 4 ag:
   x = 0.181 / 1.468 = 0.12.

With these constants the model gives, forward / backward ms (K22 Table 4 in brackets):
baseline 7.71 / 11.90 (7.7 / 11.9), SP 7.21 / 11.86 (7.2 / 11.8), full recompute 7.71 / 19.61
(7.7 / 19.5), selective 7.71 / 13.21 (7.7 / 13.2), selective + SP 7.21 / 13.17 (7.2 / 13.1);
overheads SP -2.75% (-3%), full +39.3% (39%), selective +6.7% (7%), selective + SP +3.9% (4%).
Full recompute costs exactly one more forward here, 7.7 / 19.6 = 39.3%; Table 4's own
recompute is 19.5 - 11.9 = 7.6 ms, 0.1 ms (print rounding) under its 7.7 ms forward.

Calibration: A100 80GB, GEMM size, K22 Table 5 (GPT 22B, 175B, 530B, 1T end to end)
-----------------------------------------------------------------------------------
One GEMM efficiency cannot fit Table 5: 0.69 (step 3) leaves 530B 4% and 1T 10% too slow, the
larger models' GEMMs (215-1342 GFLOP) running faster than the 22B's. A GEMM is therefore charged
FLOPs / (peak x matmul_efficiency) + matmul_overhead_s. Step 3 ties the pair (4 x overhead +
9.277e11 / (312e12 x efficiency) = 4.30 ms); the overhead 0.12 ms, efficiency 0.776, is the
least-squares fit to Table 5's four "present work" (SP + selective) rows. The four full-recompute
rows are then predictions: 22B -2.6%, 175B -0.1%, 530B +0.5%, 1T +1.5% (tests/test_paper_golden.py,
docs/step_time.md). The same law, fitted independently to the H100 measurements below, gives
0.72 and 87 us: on both GPUs the overhead is worth 40-60 GFLOP, about one wave of GEMM tiles.

Calibration: H100 80GB, a K22 layer in eager PyTorch (h=6144, a=64, s=2048, t=1)
---------------------------------------------------------------------------------
Measured forward + backward ms, no / selective / full recompute: b = 1: 15.2, 17.6, 20.7;
b = 4: 58.0, 66.6, 78.9. With the eager op-by-op bytes (layer_traffic_bytes(fused=False)) the
model is linear in 1/matmul_efficiency, matmul_overhead_s, 1/attention_matmul_efficiency and
1/memory_bound_efficiency; least squares over the six numbers: 0.718, 87 us, 0.144, 0.882, all
six within 0.5% (tests/test_perf.py). Megatron-LM's fused kernels on an H100 and the H200 are not
measured: their step times carry calibrated = False (calibration()).

Mixture of experts: a layer's FLOPs are its active parameters' (the k routed experts, the shared ones and
the router: layer_matmul_flops), its elementwise bytes those of the k f_e + f_s wide MLP a token goes
through; the experts' grouped GEMMs are charged as dense GEMMs at matmul_efficiency (routing, token
permutation and load imbalance are not modelled, nor measured).

Not modelled: context / expert parallelism, per-iteration costs outside the layers beyond the
head and the optimizer (K22's 22B iteration is about 50 ms longer than its 48 layers and head,
which leaves the 22B rows of Table 5 4.6% and 2.6% fast), and Megatron's TP communication overlap
(--tp-comm-overlap), which would hide part of the forward collectives.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.core.specs import GpuSpec
from memplan.core.training import Recompute, TrainingSpec
from memplan.inventory.fp8 import cast_traffic
from memplan.memory.offload import layer_copy_bytes, offloads, stepped_bytes
from memplan.memory.states import counter, mla_qkv_count, stage_params
from memplan.memory.term_bytes import PlanValues


def _host_bandwidth(gpu: GpuSpec, training: TrainingSpec) -> float:
    """The GPU preset's host <-> GPU bytes/s, which offload's copies need (1.0, unused, without offload)."""
    if not offloads(training):
        return 1.0
    if gpu.host_bandwidth is None:
        raise MemplanError(f"GPU {gpu.name} has no host_bandwidth (bytes/s between host memory and the GPU): offload's "
                           "copies cannot be timed; add it to the GPU's YAML, e.g. host_bandwidth: 25GB/s")
    return gpu.host_bandwidth

# --- calibrated constants (see the module docstring) -------------------------------------------
# Effective bus bandwidth of NCCL collectives and point-to-point sends as a fraction of the link
# rate: "450GB/s is the line rate. With the protocol overhead (~20%) NCCL can get an effective
# NVLink bandwidth of 370GB/s" (S. Jeaugey, NVIDIA/nccl-tests issue 212); 8 x A100 all_reduce
# busbw 232.5 of 300 GB/s and two DGX nodes 86 of 100 GB/s (NVIDIA/nccl-tests issue 175).
NCCL_BUS_EFFICIENCY = 0.80
# Exposed fraction of the backward TP collectives that Megatron-LM runs asynchronously next to an
# independent GEMM (the input-gradient all-reduce; with SP its reduce-scatter and the re-all-gather
# of the saved input), from K22 Table 4's baseline backward (module docstring, step 4).
TP_ASYNC_EXPOSED_FRACTION = 0.12

# Implementations (memplan impls) whose elementwise work runs in fused kernels (Megatron-LM: fused
# scale-mask-softmax, bias-GeLU / SwiGLU, bias-dropout-add, apex / TE norms); every other one runs
# PyTorch's eager ops, one kernel (one pass over memory) per op (layer_traffic_bytes(fused=False)).
FUSED_IMPLS = ("megatron",)
# A causal flash kernel skips the score blocks above the diagonal: it executes about half of the
# full-square 4bs^2h attention FLOPs (FlashAttention-2, Dao 2023, section 3.1.1 "causal masking").
# Model FLOPs (MFU) still count the full square, as K22 Eq. 7 does.
CAUSAL_FLASH_FRACTION = 0.5

# --- bytes moved per element by the memory-bound kernels (A = activation bytes) ----------------
MASK_BYTES = 1  # K22 section 4.1: dropout masks are 1 byte
FP32_BYTES = 4  # fp32 logits (cross-entropy) and fp32 main gradients (embedding accumulation)
# Vocabulary-parallel cross-entropy (Megatron-LM _VocabParallelCrossEntropy, one PyTorch op per
# pass), per logit: forward casts to fp32 (read A, write 4), then max (read 4), subtract the max
# (read 4, write 4), exp (read 4, write 4), sum (read 4) and divide (read 4, write 4): 9 fp32
# accesses; backward scales the saved softmax by the incoming gradient (read 4, write 4) and casts
# it back (read 4, write A): 3.
CROSS_ENTROPY_FWD_FP32_ACCESSES = 9
CROSS_ENTROPY_BWD_FP32_ACCESSES = 3

# Times are computed in float32, for scalars and arrays alike (so that a plan's numbers in the
# vectorised search equal its numbers in `estimate` exactly): at 5 million plans a float64
# temporary is 40 MB and costs about twice a float32 one; the relative error, about 1e-6, is far
# below the model's. FLOP counts (model_flops, hardware_flops) stay in float64. Scalar results
# are returned as Python floats.
TIME_DTYPE = np.float32


# --- scalar / array helpers -----------------------------------------------------------------
def _f(x: Any) -> Any:
    """A plan value as a TIME_DTYPE scalar or array."""
    return x.astype(TIME_DTYPE) if isinstance(x, np.ndarray) else TIME_DTYPE(x)


def _f64(x: Any) -> Any:
    """A plan value as a float64 scalar or array (FLOP counts overflow int64 at 1T parameters)."""
    return x.astype(np.float64) if isinstance(x, np.ndarray) else float(x)


def _as_python(values: dict[str, Any]) -> dict[str, Any]:
    """Numpy scalars as Python floats (exact), arrays and None unchanged."""
    return {k: float(v) if isinstance(v, np.generic) else v for k, v in values.items()}


def _is_array(*xs: Any) -> bool:
    return any(isinstance(x, np.ndarray) for x in xs)


def _maximum(x: Any, y: Any) -> Any:
    return np.maximum(x, y) if _is_array(x, y) else max(x, y)


def _minimum(x: Any, y: Any) -> Any:
    return np.minimum(x, y) if _is_array(x, y) else min(x, y)


def _select(mask: Any, a: Any, b: Any) -> Any:
    """a where mask, else b, each value exactly as it is (scalars or arrays)."""
    return np.where(mask, a, b) if _is_array(mask, a, b) else (a if mask else b)


def memory_bound_efficiency(gpu: GpuSpec) -> float:
    return gpu.memory_bound_efficiency


def attention_matmul_efficiency(gpu: GpuSpec, model: ModelSpec) -> float:
    """Unfused attention matmuls run at the calibrated (low) efficiency; a flash kernel fuses them
    and is assumed (not measured: `calibration` says so) to reach the GEMM efficiency
    (FlashAttention-2 reports 50-73% of A100 peak forward, Dao 2023)."""
    return gpu.matmul_efficiency if model.attention == "flash" else gpu.attention_matmul_efficiency


def attention_time_flops(model: ModelSpec) -> float:
    """The attention-core FLOPs one sequence's forward executes: the full square 4s^2h for the
    unfused kernels (the causal mask is applied after QK^T), about half of it for a causal flash
    kernel (CAUSAL_FLASH_FRACTION)."""
    full = layer_attention_flops(model)
    return full * CAUSAL_FLASH_FRACTION if model.attention == "flash" else full


def gemms_per_layer(model: ModelSpec, impl: str = "megatron") -> int:
    """Weight-GEMM kernels in one layer's forward (the backward runs two per forward GEMM, dgrad and
    wgrad): Megatron-LM and the reference torch layer fuse Q, K, V into one GEMM (and SwiGLU's gate
    and up into linear_fc1): QKV, projection, fc1, fc2. transformers' Llama layer runs q, k, v, o,
    gate, up and down separately (GPT-2's c_attn is fused)."""
    if impl in ("megatron", "torch") or model.mlp != "swiglu":
        return 4
    if model.is_moe:  # q, k, v, o; the router and the experts' two grouped GEMMs; the shared experts' three
        return 7 + 3 * (model.moe_shared_ffn_hidden_size > 0)
    return 7


@dataclass(frozen=True)
class Calibration:
    """Whether the efficiencies a step time uses were measured for this GPU, implementation and
    attention kernel; `uncertainty` is the relative spread of calibrated step times against
    published measurements (None when uncalibrated: no measurement bounds the error)."""

    calibrated: bool
    uncertainty: Any  # float or None
    note: str  # empty when calibrated, else what was not measured


def calibration(model: ModelSpec, gpu: GpuSpec, impl: str = "megatron", fp8: Any = None) -> Calibration:
    """The calibration status of a step time (the GPU preset's `calibration` and `calibrated_impls`; FP8
    GEMMs were measured on no GPU: memplan/fp8.py)."""
    if fp8 is not None:
        return Calibration(False, None, "uncalibrated: FP8 GEMMs assumed at the bf16 GEMM efficiency of the FP8 peak")
    if not gpu.calibration:
        return Calibration(False, None, f"uncalibrated: no measurement on {gpu.name}, its efficiencies are assumed")
    if impl not in gpu.calibrated_impls:
        measured = ", ".join(gpu.calibrated_impls)
        return Calibration(False, None, f"uncalibrated: {impl} kernels not measured on {gpu.name} (measured: {measured})")
    if model.attention == "flash":
        return Calibration(False, None, "uncalibrated: flash attention kernel assumed at the GEMM efficiency")
    return Calibration(True, gpu.step_time_uncertainty, "")


# --- FLOPs (K22 appendix A, generalised) ------------------------------------------------------
def active_ffn_width(model: ModelSpec) -> float:
    """The MLP width one token goes through, averaged over the layers: f in a dense layer; k f_e + f_s in a
    mixture-of-experts layer (its k routed experts and the shared ones, not the E - k others)."""
    if not model.is_moe:
        return float(model.f)
    moe = model.moe_top_k * model.fe + model.moe_shared_ffn_hidden_size
    return (model.moe_layers * moe + model.moe_first_dense_layers * model.f) / model.num_layers


def layer_matmul_flops(model: ModelSpec) -> float:
    """Forward FLOPs of one layer's weight matmuls for one sequence (no t split), with the attention
    width q = a x head_dim (h unless head_dim says otherwise): QKV 2sh(q + 2qg/a) + projection
    2sqh + MLP 2*2shf (GeLU) or 3*2shf (SwiGLU). K22 (q = h, g = a, f = 4h): 24sh^2.

    A mixture-of-experts layer counts its ACTIVE parameters: the k routed experts a token goes through and
    the shared experts, 3*2sh(k f_e + f_s) (SwiGLU), and the router 2shE, not the E - k other experts
    (Megatron-LM megatron/training/training.py `num_floating_point_operations`: the routed-experts term
    is moe_ffn_hidden_size x moe_router_topk x the gated factor, the shared experts' term
    moe_shared_expert_intermediate_size, per MoE layer; it leaves out the router's 2shE, which memplan
    keeps). With dense layers first the figure is the mean over the layers (L times it is the model's)."""
    s, h, q, a, g = (float(x) for x in (model.seq_length, model.hidden_size, model.q, model.num_attention_heads,
                                         model.g))
    mlp_matrices = 3 if model.mlp == "swiglu" else 2
    router = 2 * s * h * model.num_experts * model.moe_layers / model.num_layers if model.is_moe else 0.0
    qkv = 2 * s * h * (q + 2 * q * g / a)
    if model.is_mla:  # its latent projections: 2 FLOPs per weight and token (states.mla_qkv_count)
        qkv = 2 * s * float(mla_qkv_count(model).evaluate(model.symbols()))
    return qkv + 2 * s * q * h + mlp_matrices * 2 * s * h * active_ffn_width(model) + router


def layer_attention_flops(model: ModelSpec) -> float:
    """Forward FLOPs of QK^T and attention over V for one sequence: 4s^2q, 4s^2h in K22 (appendix A);
    multi-head latent attention 2s^2 a (d_n + d_r) + 2s^2 a d_v (its queries and keys are d_n + d_r wide, its
    values d_v; Megatron-LM's num_floating_point_operations counts the same, halved for the causal mask)."""
    s, q = float(model.seq_length), float(model.q)
    if model.is_mla:
        a = float(model.num_attention_heads)
        return 2 * s * s * a * (model.qk_nope_head_dim + model.qk_rope_head_dim + model.v_head_dim)
    return 4 * s * s * q


def logits_flops(model: ModelSpec) -> float:
    """Forward FLOPs of the output layer for one sequence: 2shv (K22 appendix A)."""
    return 2.0 * model.seq_length * model.hidden_size * model.vocab_size


def model_flops(model: ModelSpec, global_batch: Any) -> Any:
    """Model FLOPs of one step, 3 x forward (backward = 2 x forward). For a K22 GPT (f = 4h,
    g = a) this is 72 B L s h^2 (1 + s/(6h) + v/(12hL)), K22 Eq. 7."""
    return _model_flops_per_sequence(model) * _f64(global_batch)


def _model_flops_per_sequence(model: ModelSpec) -> float:
    forward = model.num_layers * (layer_matmul_flops(model) + layer_attention_flops(model)) + logits_flops(model)
    return 3.0 * forward


@dataclass(frozen=True)
class _Floats:
    """The plan's fields as TIME_DTYPE scalars or arrays, converted once."""

    t: Any
    inv_t: Any
    sp: Any  # 1.0 where sequence parallelism is on
    p: Any
    m: Any
    d: Any
    b: Any
    M: Any
    selective: Any  # layers per chunk recomputed selectively (0 unless recompute = selective)
    full: Any  # layers per chunk recomputed fully (0 unless recompute = full)
    first: Any  # 1.0 where p = 1: the last stage is also the first
    sharded: Any  # 1.0 where ZeRO >= 1 (distributed optimizer)
    k: Any  # ranks the sharded states are split over (d, or the HSDP shard group)
    zero3: Any  # 1.0 where ZeRO = 3
    cp: Any = 1.0  # context-parallel size
    ep: Any = 1.0  # expert-parallel size
    etp: Any = 1.0  # expert tensor-parallel size


def _floats(plan: PlanValues) -> _Floats:
    t = _f(plan.t)
    layers = _f(plan.recomputed_layers)
    return _Floats(
        t=t, inv_t=1.0 / t, sp=_f(plan.sp), p=_f(plan.p), m=_f(plan.m), d=_f(plan.d), b=_f(plan.b),
        M=_f(plan.microbatches),
        selective=_f(plan.recompute == Recompute.SELECTIVE) * layers,
        full=_f(plan.recompute == Recompute.FULL) * layers,
        first=_f(plan.p == 1), sharded=_f(plan.zero >= 1), zero3=_f(plan.zero >= 3), k=_f(plan.shard),
        cp=_f(plan.cp), ep=_f(plan.ep), etp=_f(plan.expert_tp),
    )


def hardware_flops(model: ModelSpec, plan: PlanValues, global_batch: Any) -> Any:
    """Model FLOPs plus recomputation: selective re-runs the attention matmuls (4Bs^2h per layer,
    K22 section 5), full re-runs the layer's forward. (K22 Eq. 8 prints 1 + s/(3h) for selective;
    the 4Bs^2h per layer described in its text gives 1 + s/(6h) + s/(18h) instead.)"""
    # Recomputed layers per chunk x p m chunks, per sequence.
    layers = _f64(plan.recomputed_layers)
    selective = _f64(plan.recompute == Recompute.SELECTIVE) * layers
    full = _f64(plan.recompute == Recompute.FULL) * layers
    attention = layer_attention_flops(model)
    extra = _f64(plan.p * plan.m) * (selective * attention + full * (layer_matmul_flops(model) + attention))
    return model_flops(model, global_batch) + extra * _f64(global_batch)


# --- linear forms: seconds per sequence as c_t/t + c_r*rep + c_a*ag + c_s*ag*sp + c_u/b --------
@dataclass(frozen=True)
class _Basis:
    """The plan-dependent factors every per-sequence time is a linear combination of."""

    inv_t: Any  # 1/t: the tensor-parallel split
    rep: Any  # split of the replicated regions: 1/t with SP, 1 without
    ag: Any  # seconds per byte of an all-gather or reduce-scatter over t: (t-1)/t / bandwidth
    ag_sp: Any  # ag where SP is on, else 0
    inv_b: Any  # 1/b: a fixed cost per micro-batch (per kernel), shared by its b sequences


def _link_per_byte(gpu: GpuSpec, span: Any) -> Any:
    """Seconds per byte on one GPU's link for a group spanning `span` consecutive ranks: NVLink
    within a node, the network beyond (one NIC per GPU, as on DGX A100 / H100)."""
    intra = 1.0 / (gpu.intra_node_bandwidth * NCCL_BUS_EFFICIENCY)
    inter = 1.0 / (gpu.inter_node_bandwidth * NCCL_BUS_EFFICIENCY)
    return inter + (intra - inter) * _f(span <= gpu.gpus_per_node)


def _basis(gpu: GpuSpec, pf: _Floats) -> _Basis:
    rep = 1.0 + pf.sp * (pf.inv_t - 1.0)
    ag = (1.0 - pf.inv_t) * _link_per_byte(gpu, pf.t)
    return _Basis(pf.inv_t, rep, ag, ag * pf.sp, 1.0 / pf.b)


@dataclass(frozen=True)
class _Form:
    """Seconds per sequence: t/t + r*rep + a*ag + s*ag_sp + u/b (scalar coefficients)."""

    t: float = 0.0
    r: float = 0.0
    a: float = 0.0
    s: float = 0.0
    u: float = 0.0

    def __add__(self, other: "_Form") -> "_Form":
        return _Form(self.t + other.t, self.r + other.r, self.a + other.a, self.s + other.s, self.u + other.u)

    def __mul__(self, k: float) -> "_Form":
        return _Form(self.t * k, self.r * k, self.a * k, self.s * k, self.u * k)

    __rmul__ = __mul__

    def __call__(self, x: _Basis) -> Any:
        return _evaluate(x, (1.0, self))


_FORM_BASIS = (("t", "inv_t"), ("r", "rep"), ("a", "ag"), ("s", "ag_sp"), ("u", "inv_b"))


def _evaluate(x: _Basis, *weighted: tuple[Any, _Form]) -> Any:
    """Sum of weight x form (weights scalars or arrays), gathered per basis factor so that an array
    costs one multiply per (array weight, non-zero coefficient) and one per basis factor."""
    total: Any = None
    for coef_name, basis_name in _FORM_BASIS:
        coef: Any = None
        for weight, form in weighted:
            c = getattr(form, coef_name)
            if c:
                term = c if (isinstance(weight, float) and weight == 1.0) else weight * c
                coef = term if coef is None else coef + term
        if coef is not None:
            term = coef * getattr(x, basis_name)
            total = term if total is None else total + term
    return 0.0 if total is None else total


@dataclass(frozen=True)
class LayerBytes:
    """Memory-bound bytes of one layer for one sequence (no t split), forward and backward."""

    replicated_fwd: float  # norms, bias-dropout-residual adds (split by t only under SP)
    replicated_bwd: float
    tp_fwd: float  # softmax, attention dropout, activation function, rotary (split by t)
    tp_bwd: float
    attention_core_fwd: float  # softmax + attention dropout: what selective recompute re-runs


def layer_traffic_bytes(model: ModelSpec, activation_bytes: int = 2, fused: bool = True) -> LayerBytes:
    """Bytes the memory-bound kernels of one layer move for one sequence. `fused`: Megatron-LM's
    kernels (fused scale-mask-softmax, bias-GeLU, bias-dropout-add); otherwise PyTorch's eager ops,
    one pass over memory per op, as the reference torch layer (validation/layers.py) and
    transformers run them (bias adds ride in the GEMM epilogue either way)."""
    if not fused:
        return _eager_traffic_bytes(model, activation_bytes)
    A = activation_bytes
    s, h, f, a = (float(x) for x in (model.seq_length, model.hidden_size, active_ffn_width(model),
                                     model.num_attention_heads))
    sh, scores, sf = s * h, a * s * s, s * f
    drop = 1 if model.dropout else 0
    # Two norms (read + write), two residual adds (read 2, write 1), two dropout masks written.
    rep_fwd = (2 * 2 * A + 2 * 3 * A + 2 * drop * MASK_BYTES) * sh
    # Norm backward (read x and dy, write dx), dropout backward (read dy and the mask, write dx),
    # and the sum of residual and branch gradients at each sub-layer's input (read 2, write 1).
    rep_bwd = (2 * 3 * A + 2 * drop * (2 * A + MASK_BYTES) + 2 * 3 * A) * sh
    softmax_fwd, softmax_bwd = 2 * A * scores, 3 * A * scores  # fused scale-mask-softmax
    dropout = drop * (2 * A + MASK_BYTES) * scores  # forward writes the mask, backward reads it
    if model.attention == "flash":  # the scores never leave the chip (FlashAttention, Dao 2022)
        softmax_fwd = softmax_bwd = dropout = 0.0
    if model.mlp == "swiglu":  # read gate and up, write the product; backward reads 3, writes 2
        act_fwd, act_bwd = 3 * A * sf, 5 * A * sf
    else:  # fused bias-GeLU: read, write; backward reads input and dy, writes dx
        act_fwd, act_bwd = 2 * A * sf, 3 * A * sf
    rope = 0.0
    if model.position_embedding == "rope":  # rotate Q and K (read + write), in both passes
        rope = 2 * A * s * model.q * (1 + model.g / model.num_attention_heads)
    return LayerBytes(
        replicated_fwd=rep_fwd,
        replicated_bwd=rep_bwd,
        tp_fwd=softmax_fwd + dropout + act_fwd + rope,
        tp_bwd=softmax_bwd + dropout + act_bwd + rope,
        attention_core_fwd=softmax_fwd + dropout,
    )


def _eager_traffic_bytes(model: ModelSpec, A: int) -> LayerBytes:
    """PyTorch eager ops, per element of the tensor each op streams (read + write bytes), counted op
    by op on the reference layer (validation/layers.py: attention_core, ParallelAttention, GPTLayer)
    and autograd's backward of each op. Per token and hidden unit (sh) unless named:

    forward: LayerNorm read + write 2A, each; Q, K, V made contiguous from the fused QKV output
    2A(1 + 2g/a); the context transposed back 2A; dropout read + write + mask 2A + 1 and the
    residual add (read 2, write 1) 3A after each sub-layer; per score (as^2): scale 2A, causal
    masked_fill 2A, softmax 2A, dropout 2A + 1 (the QK^T output and attention-over-V input belong
    to the batched matmuls' time); per MLP element (sf): GeLU 2A (SwiGLU: SiLU 2A, product 3A).
    backward: the gradient sum at each residual 3A, dropout 2A + 1, LayerNorm dx (read x, dy,
    write) and its weight gradients (read x, dy) 5A, bias gradients (read dy) A per output element,
    the transposed context 2A, and the QKV split: each of Q, K, V's select-backward zero-fills a
    QKV-sized gradient and copies its slice, and autograd sums the three, 11A(1 + 2g/a); per score
    dropout 2A + 1, softmax 3A, masked_fill 2A, scale 2A; GeLU 3A per sf (SwiGLU 9A).
    RMSNorm (transformers' LlamaRMSNorm): fp32 upcast, square, mean, scale, downcast, weight:
    4A + 28 forward, twice that backward. RoPE (transformers' apply_rotary_pos_emb: two products,
    rotate_half, a sum) 9A per element of Q and K, in both passes.

    The K22 layer, A = 2: forward 46sh + 17as^2 + 4sf, backward 122sh + 19as^2 + 8sf bytes."""
    s, h, f, a = (float(x) for x in (model.seq_length, model.hidden_size, active_ffn_width(model),
                                     model.num_attention_heads))
    sh, scores, sf = s * h, a * s * s, s * f
    drop = 1 if model.dropout else 0
    wq = model.q / h  # the attention width in units of h
    qkv = wq * (1 + 2 * model.g / model.num_attention_heads)  # the QKV output in units of h
    if model.norm == "layernorm":
        norm_fwd, norm_bwd = 2 * A, 5 * A
    else:
        norm_fwd = 4 * A + 7 * FP32_BYTES
        norm_bwd = 2 * norm_fwd
    bias = 1 if model.bias else 0
    mlp_in = 2 if model.mlp == "swiglu" else 1  # fc1 output width in units of f
    rep_fwd = (2 * norm_fwd + 2 * drop * (2 * A + MASK_BYTES) + 2 * 3 * A) * sh
    rep_bwd = (2 * 3 * A + 2 * drop * (2 * A + MASK_BYTES) + 2 * norm_bwd + bias * 2 * A) * sh
    core_fwd = (3 * 2 * A + drop * (2 * A + MASK_BYTES)) * scores
    core_bwd = (3 * A + 2 * 2 * A + drop * (2 * A + MASK_BYTES)) * scores
    if model.attention == "flash":
        core_fwd = core_bwd = 0.0
    if model.mlp == "swiglu":
        act_fwd, act_bwd = 5 * A * sf, 9 * A * sf
    else:
        act_fwd, act_bwd = 2 * A * sf, 3 * A * sf
    rope = 9 * A * sh * wq * (1 + model.g / model.num_attention_heads) if model.position_embedding == "rope" else 0.0
    split_fwd, split_bwd = 2 * A * qkv * sh, 11 * A * qkv * sh
    context = 2 * A * wq * sh
    return LayerBytes(
        replicated_fwd=rep_fwd,
        replicated_bwd=rep_bwd,
        tp_fwd=split_fwd + context + core_fwd + act_fwd + rope,
        tp_bwd=split_bwd + context + core_bwd + act_bwd + rope + bias * A * (qkv * sh + mlp_in * sf),
        attention_core_fwd=core_fwd,
    )


@dataclass(frozen=True)
class _LayerForms:
    fwd_compute: _Form
    fwd_memory: _Form
    fwd_comm: _Form
    bwd_compute: _Form
    bwd_memory: _Form
    bwd_comm: _Form
    bwd_comm_exposed: _Form
    selective: _Form  # what selective recompute adds to a layer's backward
    full: _Form  # what full recompute adds: the whole forward

    @property
    def forward(self) -> _Form:
        return self.fwd_compute + self.fwd_memory + self.fwd_comm

    @property
    def backward(self) -> _Form:
        return self.bwd_compute + self.bwd_memory + self.bwd_comm_exposed


@functools.lru_cache(maxsize=64)
def _layer_forms(model: ModelSpec, gpu: GpuSpec, activation_bytes: int, impl: str = "megatron",
                 fp8: bool = False) -> _LayerForms:
    peak = gpu.peak_bf16_flops
    hbm = gpu.memory_bandwidth * memory_bound_efficiency(gpu)
    # FP8 (memplan/fp8.py): the weight GEMMs on the FP8 tensor cores, the attention core in bf16
    gemm_peak = gpu.peak_fp8_flops if fp8 and gpu.peak_fp8_flops else peak
    matmul = layer_matmul_flops(model) / (gemm_peak * gpu.matmul_efficiency)
    attention = attention_time_flops(model) / (peak * attention_matmul_efficiency(gpu, model))
    by = layer_traffic_bytes(model, activation_bytes, fused=impl in FUSED_IMPLS)
    if fp8:
        by = cast_traffic(model, activation_bytes, by)
    v = float(activation_bytes * model.seq_length * model.hidden_size)  # the A*sh a collective moves
    # Each GEMM kernel: its FLOPs at matmul_efficiency plus a fixed matmul_overhead_s, paid once per
    # micro-batch (the u/b coefficient), so large GEMMs run closer to matmul_efficiency than small.
    fwd_compute = _Form(t=matmul + attention, u=gemms_per_layer(model, impl) * gpu.matmul_overhead_s)
    fwd_memory = _Form(t=by.tp_fwd / hbm, r=by.replicated_fwd / hbm)
    # Forward: 2 all-reduces (2 ag each), or with SP 2 all-gathers + 2 reduce-scatters: exposed.
    fwd_comm = _Form(a=4 * v)
    # Backward: in the async slot 2 all-reduces, or with SP 2 reduce-scatters + 2 re-all-gathers of
    # the saved sequence-split input (4 ag either way); with SP also 2 synchronous all-gathers (the
    # backward of each row-parallel output's reduce-scatter).
    bwd_comm = _Form(a=4 * v, s=2 * v)
    bwd_exposed = _Form(a=4 * v * TP_ASYNC_EXPOSED_FRACTION, s=2 * v)
    forms = _LayerForms(
        fwd_compute=fwd_compute,
        fwd_memory=fwd_memory,
        fwd_comm=fwd_comm,
        bwd_compute=2 * fwd_compute,  # K22 appendix A: backward = 2 x forward
        bwd_memory=_Form(t=by.tp_bwd / hbm, r=by.replicated_bwd / hbm),
        bwd_comm=bwd_comm,
        bwd_comm_exposed=bwd_exposed,
        selective=_Form(t=attention + by.attention_core_fwd / hbm),
        full=_Form(),
    )
    return _LayerForms(**{**forms.__dict__, "full": forms.forward})


@dataclass(frozen=True)
class _HeadForms:
    """LM head (last stage) and embedding (first stage), forward + backward, one sequence."""

    head_compute: _Form
    head_memory: _Form
    head_comm: _Form
    head_comm_exposed: _Form
    embedding_memory: _Form
    embedding_comm: _Form  # all exposed


@functools.lru_cache(maxsize=64)
def _head_forms(model: ModelSpec, gpu: GpuSpec, activation_bytes: int) -> _HeadForms:
    A = activation_bytes
    hbm = gpu.memory_bandwidth * memory_bound_efficiency(gpu)
    s, h, v = float(model.seq_length), float(model.hidden_size), float(model.vocab_size)
    sh, sv, vol = s * h, s * v, A * s * h
    # Final norm (2A forward, 3A backward per element, replicated) and the fp32 cross-entropy over
    # the vocabulary-parallel logits (split by t); logits 2shv forward, twice that backward.
    head_memory = _Form(r=5 * A * sh / hbm,
                        t=sv * (A + FP32_BYTES * CROSS_ENTROPY_FWD_FP32_ACCESSES
                                + A + FP32_BYTES * CROSS_ENTROPY_BWD_FP32_ACCESSES) / hbm)
    # The head's input passes Megatron's f: an all-reduce in the backward (async, 2 ag), or with SP
    # an all-gather in the forward (synchronous) and a reduce-scatter in the backward (async).
    head_comm = _Form(a=2 * vol)
    head_exposed = _Form(a=2 * vol * TP_ASYNC_EXPOSED_FRACTION, s=vol * (1 - TP_ASYNC_EXPOSED_FRACTION))
    # Embedding: lookup (read + write), learned-position add (read 2, write 1), dropout; backward:
    # dropout and the accumulation into the fp32 main gradient (read A, read + write 4).
    drop = 1 if model.dropout else 0
    pos = 3 * A if model.position_embedding == "learned" else 0
    emb_bytes = 2 * A + pos + 2 * drop * (2 * A + MASK_BYTES) + A + 2 * FP32_BYTES
    # Vocabulary-parallel output: all-reduce (2 ag) forward, or with SP a reduce-scatter forward
    # and an all-gather backward: 2 ag, synchronous either way.
    return _HeadForms(
        # The logits GEMM forward, its dgrad and wgrad: 3 kernels.
        head_compute=_Form(t=3 * logits_flops(model) / (gpu.peak_bf16_flops * gpu.matmul_efficiency),
                           u=3 * gpu.matmul_overhead_s),
        head_memory=head_memory,
        head_comm=head_comm,
        head_comm_exposed=head_exposed,
        embedding_memory=_Form(r=emb_bytes * sh / hbm),
        embedding_comm=_Form(a=2 * vol),
    )


# --- one layer --------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerTime:
    """One layer, one micro-batch of b sequences, one GPU, in seconds (scalars or arrays).

    `backward_s` excludes recomputation; `recompute_s` is what the plan's recompute mode adds to
    the backward of a layer it applies to (K22 Table 4's backward column is their sum)."""

    forward_compute_s: Any
    forward_memory_s: Any
    forward_comm_s: Any  # all exposed
    backward_compute_s: Any
    backward_memory_s: Any
    backward_comm_s: Any  # every backward TP collective
    backward_comm_exposed_s: Any
    recompute_s: Any

    @property
    def forward_s(self) -> Any:
        return self.forward_compute_s + self.forward_memory_s + self.forward_comm_s

    @property
    def backward_s(self) -> Any:
        return self.backward_compute_s + self.backward_memory_s + self.backward_comm_exposed_s

    @property
    def backward_with_recompute_s(self) -> Any:
        return self.backward_s + self.recompute_s


def layer_time(model: ModelSpec, gpu: GpuSpec, plan: PlanValues, activation_bytes: int = 2,
               impl: str = "megatron") -> LayerTime:
    """Forward and backward seconds of one layer for one micro-batch of plan.b sequences, run by
    implementation `impl` (fused kernels for megatron, PyTorch eager ops otherwise)."""
    pf = _floats(plan)
    x = _basis(gpu, pf)
    lf = _layer_forms(model, gpu, activation_bytes, impl)
    selective = _f(plan.recompute == Recompute.SELECTIVE)
    full = _f(plan.recompute == Recompute.FULL)
    return LayerTime(**_as_python(dict(
        forward_compute_s=pf.b * lf.fwd_compute(x),
        forward_memory_s=pf.b * lf.fwd_memory(x),
        forward_comm_s=pf.b * lf.fwd_comm(x),
        backward_compute_s=pf.b * lf.bwd_compute(x),
        backward_memory_s=pf.b * lf.bwd_memory(x),
        backward_comm_s=pf.b * lf.bwd_comm(x),
        backward_comm_exposed_s=pf.b * lf.bwd_comm_exposed(x),
        recompute_s=pf.b * _evaluate(x, (selective, lf.selective), (full, lf.full)),
    )))


# --- the whole step ---------------------------------------------------------------------------
@dataclass(frozen=True)
class StepTime:
    """One training step (scalars or arrays), seconds on the bottleneck GPU unless named FLOPs.
    The exposed parts add up to step_time_s: compute + memory + tp_comm_exposed + recompute
    + bubble + pp_comm + dp_comm_exposed + zero3_gather_exposed + optimizer + host_copy + cp_ep_comm_exposed.

    The pipeline bubble is reported two ways: `bubble_share` = bubble_s / step_time_s (what share
    of the step the GPU idles in the bubble) and `bubble_over_ideal` = (p - 1)/(m M), the
    schedule's bubble over the busy time of one stage (Narayanan et al. 2021). The latter was
    called `bubble_fraction` before; it exceeds 100% when M < p - 1."""

    model_flops: Any  # per step, whole job (K22 Eq. 7 generalised)
    hardware_flops: Any  # model FLOPs + recomputation
    compute_s: Any  # matmuls of forward + backward, all micro-batches
    memory_s: Any  # memory-bound kernels of forward + backward
    recompute_s: Any  # the recomputed forwards (selective: attention core; full: whole layer)
    tp_comm_s: Any  # every tensor-parallel collective (forward + backward)
    tp_comm_exposed_s: Any  # the part not hidden behind GEMMs
    bubble_over_ideal: Any  # (p - 1)/(m M): the bubble over one stage's busy time
    bubble_s: Any
    bubble_share: Any  # bubble_s / step_time_s
    pp_comm_s: Any  # pipeline point-to-point sends (counted as exposed)
    dp_comm_s: Any  # gradient reduction (+ parameter all-gather with ZeRO 1 and 2)
    dp_comm_exposed_s: Any  # left after --overlap-grad-reduce / --overlap-param-gather
    zero3_gather_s: Any  # ZeRO-3 weight all-gathers, forward and backward of every micro-batch
    zero3_gather_exposed_s: Any
    optimizer_s: Any  # memory-bound optimizer update of this GPU's shard (the part the GPU steps)
    host_copy_s: Any  # offload's copies between host and GPU over PCIe (memplan/offload.py), all exposed
    cp_ep_comm_exposed_s: Any  # context parallelism's K/V exchange and expert parallelism's token all-to-alls left
    # exposed (memplan/parallel.py)
    step_time_s: Any
    tokens_per_s: Any
    mfu: Any  # model FLOPs / (step x GPUs x peak)
    hfu: Any  # hardware FLOPs / (step x GPUs x peak)
    calibrated: Any  # bool: the GPU, implementation and attention kernel were measured (calibration())
    uncertainty: Any  # relative spread of step_time_s when calibrated, else None


def _overlapped(comm: Any, window: Any, inv_buckets: Any) -> Any:
    """Exposed part of a collective issued in per-layer buckets behind `window` seconds of
    compute: all but the last bucket hide (Megatron Bridge docs, Communication Overlap: "This
    overlap method exposes only one DP communication chunk")."""
    return _maximum(comm - window, comm * inv_buckets)


def _stage_params(model: ModelSpec, plan: PlanValues) -> Any:
    """Parameters on one GPU of the last pipeline stage (also the first when p = 1): the
    states.py inventory, as floats."""
    return _f(stage_params(model, counter(plan.symbols(model)), plan.layers(model, plan.p - 1), plan.p == 1, 1,
                           plan.p))


def step_time(model: ModelSpec, training: TrainingSpec, gpu: GpuSpec, plan: PlanValues,
              global_batch: Any, breakdown: bool = True, impl: str = "megatron") -> StepTime:
    """Estimated time of one training step of `global_batch` sequences, its FLOPs and MFU, with
    the kernels of implementation `impl` (memplan impls; fused for megatron, eager otherwise).

    With breakdown=False (for ranking millions of plans) only model_flops, bubble_over_ideal,
    step_time_s, tokens_per_s, mfu, calibrated and uncertainty are returned, the same numbers bit
    for bit; the other fields are None.
    Long 1-D arrays are evaluated in blocks of CHUNK_SIZE plans (each block vectorised)."""
    values = [getattr(plan, f.name) for f in fields(PlanValues)] + [global_batch]
    arrays = [v for v in values if isinstance(v, np.ndarray)]
    n = arrays[0].shape[0] if arrays and arrays[0].ndim == 1 else 0
    if n <= CHUNK_SIZE or any(v.shape != (n,) for v in arrays):
        return _step_time(model, training, gpu, plan, global_batch, breakdown, impl)
    out: dict[str, Any] = {}
    for start in range(0, n, CHUNK_SIZE):
        block = slice(start, start + CHUNK_SIZE)
        part = _step_time(model, training, gpu, _slice_plan(plan, block),
                          global_batch[block] if isinstance(global_batch, np.ndarray) else global_batch, breakdown,
                          impl)
        for name, value in part.__dict__.items():
            if start == 0:
                out[name] = np.empty(n, value.dtype) if isinstance(value, np.ndarray) else value
            if isinstance(value, np.ndarray):
                out[name][block] = value
    return StepTime(**out)


# Plans per block in step_time: 64K float32 temporaries (256 KB) stay in cache and below the
# allocator's mmap threshold; measured on this 2-core machine, 5M plans run about twice as fast
# in such blocks as in one piece (tests/test_perf.py prints the timing).
CHUNK_SIZE = 1 << 16


def _slice_plan(plan: PlanValues, block: slice) -> PlanValues:
    return PlanValues(**{f.name: (v[block] if isinstance(v := getattr(plan, f.name), np.ndarray) else v)
                         for f in fields(PlanValues)})


def _cp_ep_comm_s(model: ModelSpec, gpu: GpuSpec, pf: _Floats, A: int, layers: float, attention_s: float,
                  comm: str = "p2p") -> Any:
    """Seconds per sequence on one GPU of a stage's `layers` layers that context and expert parallelism add
    (memplan/parallel.py), `attention_s` one layer's attention core forward for a whole sequence at t = 1.

    - cp, p2p: each ring step sends the rank's K/V chunk ((cp - 1) of them per layer in the forward; K/V and their
      gradients, twice that, in the backward) while the step's attention runs (Transformer Engine overlaps them on
      two streams): exposed is what the rank's attention compute, 1/cp of it (backward 2x), cannot hide.
    - cp, a2a: Q, K, V and the output (forward), their gradients (backward) are all-to-all'ed over cp, (cp - 1)/cp
      of each rank's share leaving it; not overlapped.
    - ep: the alltoall dispatcher's dispatch and combine, each k s b h / (t cp) routed tokens per GPU, in the forward
      and the backward, (ep - 1)/ep of them leaving the GPU, plus the all-gather / reduce-scatter over etp of
      (etp - 1) times them; per MoE layer, not overlapped.
    The CP group spans t cp consecutive ranks, the expert group etp ep (Megatron-LM rank order tp-cp-ep-dp-pp)."""
    s, h, q = float(model.seq_length), float(model.hidden_size), float(model.q)
    kv = 2.0 * s * q * model.g / model.num_attention_heads  # K and V of one sequence, elements
    inv_cp = 1.0 / pf.cp
    per_cp_byte = _link_per_byte(gpu, pf.t * pf.cp)
    if model.attention == "flash":
        ring_fwd = (A * kv * pf.inv_t) * (1.0 - inv_cp) * per_cp_byte
        att = attention_s * pf.inv_t * inv_cp
        ring = _maximum(ring_fwd - att, 0.0 * ring_fwd) + _maximum(2.0 * ring_fwd - 2.0 * att, 0.0 * ring_fwd)
        a2a = 2.0 * (A * (2.0 * s * q + kv) * pf.inv_t * inv_cp) * (1.0 - inv_cp) * per_cp_byte
        cp = layers * (ring if comm == "p2p" else a2a)
    else:
        cp = 0.0 * pf.cp
    moe = 0.0 * pf.ep
    if model.is_moe:
        tokens = (model.moe_top_k or 1) * s * pf.inv_t * inv_cp * (A * h)  # bytes of a GPU's routed tokens
        a2a_ep = 4.0 * tokens * (1.0 - 1.0 / pf.ep) * _link_per_byte(gpu, pf.etp * pf.ep)
        gather = 4.0 * tokens * (pf.etp - 1.0) * _link_per_byte(gpu, pf.etp)
        moe = (layers * model.moe_layers / model.num_layers) * (a2a_ep + gather)
    return cp + moe


def _step_time(model: ModelSpec, training: TrainingSpec, gpu: GpuSpec, plan: PlanValues,
               global_batch: Any, breakdown: bool, impl: str = "megatron") -> StepTime:
    A = training.activation_bytes
    pf = _floats(plan)
    x = _basis(gpu, pf)
    lf = _layer_forms(model, gpu, A, impl, training.fp8 is not None)
    hf = _head_forms(model, gpu, A)
    hbm = gpu.memory_bandwidth * memory_bound_efficiency(gpu)
    s, h = float(model.seq_length), float(model.hidden_size)
    b, M, p, m, d, first = pf.b, pf.M, pf.p, pf.m, pf.d, pf.first
    # uneven pipeline stages (memplan/pipeline.py stage_layers): `split` marks the plans whose split is uneven (the
    # others keep the even split's numbers exactly)
    uneven = plan.first_layers is not None
    split = uneven and (plan.first_layers * plan.p != model.num_layers) | (plan.last_layers * plan.p != model.num_layers)
    layers = model.num_layers / p  # the last stage's layers
    if uneven:
        layers = _select(split, _f(plan.last_layers), layers)
    bm = b * M  # sequences per step through this stage

    # Per sequence on the bottleneck stage: L/p layers, the LM head and (p = 1) the embedding.
    layer_compute, head_compute = lf.fwd_compute + lf.bwd_compute, hf.head_compute
    layer_memory, head_memory, emb_memory = lf.fwd_memory + lf.bwd_memory, hf.head_memory, hf.embedding_memory
    if training.loss_chunks > 1:
        # a chunked loss (memplan/chunked_loss.py) re-runs each chunk's forward in the backward: one more logits
        # GEMM and the forward cross-entropy's bytes, and 4 GEMM kernels per chunk (forward, recompute, input and
        # weight gradients) instead of 3 for the whole head (derived, not measured)
        chunks = training.loss_chunks
        head_compute = head_compute + _Form(t=hf.head_compute.t / 3.0,
                                            u=(4.0 * chunks - 3.0) * gpu.matmul_overhead_s)
        head_memory = head_memory + _Form(t=s * float(model.vocab_size) * (
            A + FP32_BYTES * CROSS_ENTROPY_FWD_FP32_ACCESSES) / hbm)
    layer_exposed, head_exposed, emb_comm = lf.fwd_comm + lf.bwd_comm_exposed, hf.head_comm_exposed, hf.embedding_comm
    forward = lf.forward(x)  # one layer's forward, also what full recompute adds
    recompute = m * (pf.selective * lf.selective(x) + pf.full * forward)
    compute = _evaluate(x, (layers, layer_compute), (1.0, head_compute))
    memory = _evaluate(x, (layers, layer_memory), (1.0, head_memory), (first, emb_memory))
    tp_exposed = _evaluate(x, (layers, layer_exposed), (1.0, head_exposed), (first, emb_comm))
    # Activation offload (memplan/offload.py): save_on_cpu copies every saved tensor of a layer to the host in the
    # forward and back in the backward, on the compute stream (exposed): 2 x its bytes per layer and micro-batch.
    host_bw = _host_bandwidth(gpu, training)
    act_copy = 0.0 * b
    if training.offload_activations:
        act_copy = layers * ((2.0 / host_bw) * _f(layer_copy_bytes(model, training, plan, impl))) / b
    # Context parallelism: each GPU computes 1/cp of every sequence (the causal load balance makes the shares equal),
    # and exchanges K/V (cp) and routed tokens (ep) on top (memplan/parallel.py).
    inv_cp = 1.0 / pf.cp
    cp_ep = _cp_ep_comm_s(model, gpu, pf, A, layers, attention_time_flops(model) / (
        gpu.peak_bf16_flops * attention_matmul_efficiency(gpu, model)), plan.cp_comm)
    per_sequence = (compute + memory + tp_exposed + recompute + act_copy) * inv_cp + cp_ep
    ideal = bm * per_sequence

    # 1F1B / interleaved pipeline bubble: (p - 1)/m slots of one stage's forward + backward of a
    # micro-batch (Narayanan et al. 2021), i.e. (p - 1)/(m M) of a stage's busy time. The slots
    # are the other stages' warm-up forwards and cool-down backwards, so they are priced at a
    # stage of L/p layers without the LM head (the bottleneck stage's own time is `ideal`).
    chunk_steps = m * M
    bubble_over_ideal = (p - 1.0) / chunk_steps
    stage_layers = (_evaluate(x, (layers, layer_compute + layer_memory + layer_exposed)) + recompute + act_copy) * inv_cp \
        + cp_ep
    bubble = bubble_over_ideal * (bm * stage_layers)
    if uneven:
        # Uneven stages: a micro-batch's forward + backward takes T_i on stage i (its layers, their recompute: the
        # first N of each of its m chunks, all of a shorter chunk; the last stage's also the LM head). The steady
        # state runs at the slowest stage, T* = max T_i, and the warm-up and cool-down slots are the other stages'
        # time, (sum T_i - T*)/m per sequence (with equal stages: (p - 1)/m stage times, as above).
        one_layer = _evaluate(x, (1.0, layer_compute + layer_memory + layer_exposed)) + act_copy / layers

        def stage_time(n: Any) -> Any:  # with cp: 1/cp of the work, and the layers' share of the K/V and token sends
            cap = n / m
            work = n * one_layer + m * (_minimum(pf.selective, cap) * lf.selective(x) + _minimum(pf.full, cap) * forward)
            return work * inv_cp + cp_ep * (n / layers)

        first_n = _f(plan.first_layers)
        middle_n = (model.num_layers - first_n - layers) / _maximum(p - 2.0, 1.0)
        t_first, t_middle = stage_time(first_n), stage_time(middle_n)
        slowest = _maximum(_maximum(per_sequence, t_first), t_middle * _f(p > 2))
        total = per_sequence + t_first + (p - 2.0) * t_middle
        ideal = _select(split, bm * slowest, ideal)
        bubble = _select(split, (b / m) * (total - slowest), bubble)

    # Pipeline point-to-point: every (micro-batch, chunk) receives its activation in the forward
    # and its gradient in the backward. Each TP rank sends 1/t of the A*sbh tensor to its peer of
    # the next stage: with SP its sequence shard; without SP the scatter/gather optimisation of
    # Narayanan et al. 2021 section 4.1 (Megatron-LM's --scatter-gather-tensors-in-pipeline, on by
    # default in the code K22 measured) splits the replicated tensor, and the receiving stage
    # re-assembles it with an all-gather over NVLink (x.ag per byte; none with SP). Stages are t*d
    # ranks apart (Megatron rank order tp-dp-pp), so the network is used once the pipeline spans
    # more than one node. Counted as exposed on the critical path: M m + p - 1 forward slots and
    # as many backward ones. (Charging the whole A*sbh per TP rank over the network, as before,
    # made K22 Table 5's full-recompute rows, which run without SP, 6.4 s too slow for 530B.)
    td = pf.t * d * pf.cp  # a stage's GPUs (Megatron-LM rank order tp-cp-dp-pp)
    tdp = td * p  # GPUs
    p2p_per_sequence = (A * s * h * inv_cp) * (pf.inv_t * _link_per_byte(gpu, tdp) + (1.0 - pf.sp) * x.ag)
    pp_comm = (1.0 - first) * (2.0 * b) * (chunk_steps + p - 1.0) * p2p_per_sequence

    # Data parallelism over d ranks t apart (NVLink while t*d fits a node). The stage's gradients
    # (training.grad_bytes each: fp32 main grads) are all-reduced without ZeRO, reduce-scattered
    # over the k ranks of a shard group with ZeRO >= 1 (Megatron-LM distributed optimizer; k = d
    # unless HSDP), then all-reduced (1/k of them) across the d/k replicas, followed for ZeRO 1-2
    # by an all-gather of the updated weights within the shard group. --overlap-grad-reduce hides
    # the reduction behind the last micro-batch's backward and --overlap-param-gather the
    # all-gather behind the next step's first forward, each but one per-layer bucket (_overlapped).
    # With context parallelism the gradients are reduced, and the states sharded, over d x cp ranks (the routed
    # experts' over their expert-data-parallel group: counted here as the others'; memplan/parallel.py).
    params = _stage_params(model, plan)
    inv_d, inv_k = 1.0 / (d * pf.cp), 1.0 / (pf.k * pf.cp)
    dp_per_byte = (1.0 - inv_d) * _link_per_byte(gpu, td)
    shard_per_byte = (1.0 - inv_k) * _link_per_byte(gpu, pf.t * pf.k * pf.cp)
    replica_per_byte = 2.0 * inv_k * (1.0 - pf.k * pf.cp * inv_d) * _link_per_byte(gpu, td)
    weights_gather = params * (training.weight_bytes * shard_per_byte)
    grad_bytes = params * training.grad_bytes
    grad_reduce = (1.0 - pf.sharded) * (2.0 * grad_bytes * dp_per_byte) + pf.sharded * (
        grad_bytes * (shard_per_byte + replica_per_byte))
    param_gather = (pf.sharded - pf.zero3) * weights_gather
    forward_window = (b * layers) * forward * inv_cp
    backward_window = b * per_sequence - forward_window  # the rest of the last micro-batch
    inv_layers = p * (1.0 / model.num_layers)  # one bucket per layer
    if uneven:
        inv_layers = _select(split, 1.0 / layers, inv_layers)
    # ZeRO-3 (Rajbhandari et al. 2020): every micro-batch gathers the stage's weights in its
    # forward and again in its backward, one layer ahead (DeepSpeed prefetch), so each pass
    # exposes what its compute cannot hide, and at least one layer's gather.
    gather_pass = pf.zero3 * weights_gather
    # The last micro-batch's backward hides its ZeRO-3 gathers and the gradient reduction on the
    # same links: the reduction hides only behind the compute the gathers leave (else a longer
    # backward, e.g. more recompute, would hide both at once and shorten the step).
    reduce_window = _maximum(backward_window - gather_pass, 0.0 * backward_window)
    dp_exposed = (_overlapped(grad_reduce, reduce_window, inv_layers)
                  + _overlapped(param_gather, forward_window, inv_layers))
    zero3_exposed = M * (_overlapped(gather_pass, forward_window, inv_layers)
                         + _overlapped(gather_pass, backward_window, inv_layers))

    # Optimizer step, memory-bound over this GPU's shard (1/k of it with ZeRO >= 1): read master
    # weights, gradients and moments, write master, moments and the 16-bit weights, plus one read
    # of the gradients for the global norm used to clip them (Megatron-LM clip_grad_norm).
    moments = training.optimizer_dense_bytes  # AdamW: 2 moments x state bytes (TrainingSpec)
    # Then the 16-bit weights are copied from the master copy (read master, write weights) and the
    # gradient buffer is zeroed for the next step (Megatron-LM Float16OptimizerWithFloat16Params:
    # _copy_main_params_to_model_params, zero_grad_buffer): 42 bytes per parameter for bf16-mixed.
    update_bytes = (3 * training.master_weight_bytes + 3 * training.grad_bytes + 2 * moments
                    + training.weight_bytes)
    optimizer = (params * (update_bytes / hbm)) * (1.0 + pf.sharded * (inv_k - 1.0))
    # Optimizer offload (memplan/offload.py): the GPU updates 1 - F of its shard; the offloaded F's gradients go to
    # the host and its parameters come back each step (stepped dtype, each way), exposed (Megatron-LM's default,
    # no --overlap-cpu-optimizer-d2h-h2d). The host's own optimizer step is not timed.
    fraction = training.offload_optimizer_fraction
    opt_copy = 0.0 * optimizer
    if fraction > 0:
        offloaded = (params * fraction) * (1.0 + pf.sharded * (inv_k - 1.0))
        opt_copy = offloaded * (2.0 * stepped_bytes(training) / host_bw)
        optimizer = optimizer * (1.0 - fraction)

    step = ideal + bubble + pp_comm + dp_exposed + zero3_exposed + optimizer + opt_copy
    sequences = _f(global_batch)
    # MFU against the peak of the GEMMs' precision: the FP8 one with FP8 (memplan/fp8.py), else bf16
    peak_flops = gpu.peak_fp8_flops if training.fp8 is not None and gpu.peak_fp8_flops else gpu.peak_bf16_flops
    gpus_peak_step = tdp * (peak_flops * step)
    cal = calibration(model, gpu, impl, training.fp8)
    essentials = dict(model_flops=model_flops(model, global_batch), bubble_over_ideal=bubble_over_ideal,
                      step_time_s=step, tokens_per_s=sequences * s / step,
                      mfu=(_model_flops_per_sequence(model) * sequences) / gpus_peak_step,
                      calibrated=cal.calibrated, uncertainty=cal.uncertainty)
    if not breakdown:
        return StepTime(**_as_python({f.name: essentials.get(f.name) for f in fields(StepTime)}))
    hw_flops = hardware_flops(model, plan, global_batch)
    tp_comm = _evaluate(x, (layers, lf.fwd_comm + lf.bwd_comm), (1.0, hf.head_comm), (first, emb_comm))
    return StepTime(**_as_python(dict(
        hardware_flops=hw_flops,
        compute_s=bm * compute * inv_cp,
        memory_s=bm * memory * inv_cp,
        recompute_s=bm * recompute * inv_cp,
        tp_comm_s=bm * tp_comm * inv_cp,
        tp_comm_exposed_s=bm * tp_exposed * inv_cp,
        cp_ep_comm_exposed_s=bm * cp_ep,
        bubble_s=bubble,
        bubble_share=bubble / step,
        pp_comm_s=pp_comm,
        dp_comm_s=grad_reduce + param_gather,
        dp_comm_exposed_s=dp_exposed,
        zero3_gather_s=(2.0 * M) * gather_pass,
        zero3_gather_exposed_s=zero3_exposed,
        optimizer_s=optimizer,
        host_copy_s=bm * act_copy * inv_cp + opt_copy,
        hfu=_f(hw_flops) / gpus_peak_step,
        **essentials,
    )))
