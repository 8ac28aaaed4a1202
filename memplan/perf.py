"""Step time, FLOPs and MFU of a training plan: a roofline-style model calibrated on K22 Table 4.

Every function takes the plan as `PlanValues` whose fields are Python scalars or equally shaped
numpy arrays (one element per candidate plan); no function loops over candidates.

The model (one GPU of the bottleneck pipeline stage)
----------------------------------------------------
One layer, one micro-batch of b sequences, per GPU of a tensor-parallel group of t:

- matmuls: QKV 2bsh(h + 2hg/a), output projection 2bsh^2, MLP 2*2bshf (3 matrices, 2*3bshf, for
  SwiGLU), all split by t, at `matmul_efficiency` x peak; the attention core's batched matmuls
  QK^T and attention over V, 4bs^2h/t (K22 appendix A), at the lower ATTENTION efficiency.
  Backward = 2 x forward (K22 appendix A).
- memory-bound (elementwise) kernels: bytes moved / (HBM bandwidth x MEMORY_BOUND efficiency).
  In the replicated regions (layer norms, bias-dropout-residual adds) per token per hidden unit:
  forward 2*2A (norms) + 2*3A (residual adds) + 2*1 (masks) = 22 bytes for A = 2 (K22 layer),
  backward 2*3A (norms) + 2*(2A+1) (dropout) + 2*3A (residual-gradient sums) = 34 bytes; split
  by t under sequence parallelism (that is K22 Table 4's 3% SP gain). Inside the TP regions,
  split by t: softmax 2A (fwd) / 3A (bwd) and attention dropout 2A+1 / 2A+1 bytes per score
  element (a s^2 b), GeLU 2A / 3A (SwiGLU 3A / 5A) per MLP element (s b f).
- tensor-parallel communication, ring collectives over t ranks of V = A*sbh bytes:
  all-gather / reduce-scatter (t-1)/t * V / bw, all-reduce twice that, bw = link x
  NCCL_BUS_EFFICIENCY, NVLink when t <= gpus_per_node else the network.
  Forward: 2 all-reduces (with SP 2 all-gathers + 2 reduce-scatters, the same volume), exposed.
  Backward: Megatron-LM overlaps the input-gradient all-reduce of each column-parallel linear with
  its weight-gradient GEMM (async TP all-reduce); with SP that slot holds a reduce-scatter plus the
  re-all-gather of the sequence-split input (K22 section 4.2.2), and the all-gather that is the
  backward of each row-parallel output (the g-bar of K22 Fig. 5) is on the critical path.
  Overlapped collectives are exposed by TP_ASYNC_EXPOSED_FRACTION; the rest fully.
- recompute (per recomputed layer, in the backward pass): selective re-runs the attention core
  (its matmuls, softmax and dropout); full re-runs the whole forward, communication included.

A micro-batch on the bottleneck stage (the last: it holds the LM head, and also the embedding
when p = 1) costs L/p layers' forward + backward, recomputed_layers*m layers' recompute, the LM
head (logits 2bshv/t, fp32 cross-entropy) and, when p = 1, the embedding. Then

    step = M * t_mb * (1 + (p - 1)/(m M))     1F1B / interleaved pipeline bubble (Narayanan 2021)
         + pipeline point-to-point + exposed data-parallel communication + exposed ZeRO-3 gathers
         + optimizer step (memory-bound Adam update of this GPU's shard)

MFU = model_flops / (step x t p d x peak_bf16_flops) (K22 appendix A).

Calibration (A100 80GB, K22 Table 4: 22B layer a=64, h=6144, s=2048, b=4, t=8, A = 2 bytes)
-------------------------------------------------------------------------------------------
Per GPU: big matmuls 24bsh^2/t = 9.277e11 FLOPs, attention matmuls 4bs^2h/t = 5.154e10 FLOPs;
sbh = 5.033e7; score elements as^2b/t = 1.342e8; ag = (7/8) 2sbh / (300 GB/s x 0.8) = 0.367 ms.
Four unknowns, four equations, each solved in closed form from one published figure:

1. MEMORY_BOUND efficiency, from SP's forward gain 7.7 - 7.2 = 0.5 ms, which is the replicated
   22sbh bytes shrinking by (1 - 1/t): 22 x 5.033e7 x 7/8 / (2039e9 x 0.5e-3) = 0.95.
   (The 0.1 ms print rounding allows 0.79..1.19.)
2. ATTENTION matmul efficiency, from selective recompute's backward cost 13.2 - 11.9 = 1.3 ms
   = attention matmuls + softmax and dropout (9 bytes x 1.342e8 / (2039e9 x 0.95) = 0.624 ms):
   5.154e10 / ((1.3 - 0.624)e-3 x 312e12) = 0.24 (head dim 96 batched matmuls, plus the
   transposes of Megatron-LM's unfused attention, which this efficiency absorbs).
3. matmul_efficiency, from the baseline forward 7.7 ms = matmuls + 0.676 (attention matmuls)
   + 1.247 (memory-bound, 47 bytes-equivalents...: 22sbh + 9as^2b/t + 4sbf/t bytes at 0.95)
   + 1.468 (2 exposed all-reduces): 9.277e11 / (4.309e-3 x 312e12) = 0.69.
4. TP_ASYNC_EXPOSED_FRACTION, from the baseline backward 11.9 ms = 2 x 4.309 + 2 x 0.676
   + 1.723 (34sbh + 11as^2b/t + 6sbf/t bytes at 0.95) + x * 4ag: x = 0.207 / 1.468 = 0.14.

Predicted with the rounded constants (paper in brackets), forward / backward ms:
baseline 7.70 / 11.90 (7.7 / 11.9); SP 7.17 / 11.86 (7.2 / 11.8); full recompute 7.70 / 19.60
(7.7 / 19.5); selective 7.70 / 13.22 (7.7 / 13.2); selective + SP 7.17 / 13.18 (7.2 / 13.1).
Overheads: SP -2.8% (-3%), full +39.3% (39%), selective +6.7% (7%), selective + SP +3.9% (4%).
Full recompute necessarily costs one forward, 7.7 / 19.6 = 39.3%: Table 4's own recompute is
19.5 - 11.9 = 7.6 ms, 0.1 ms (print rounding) below its 7.7 ms forward.

H100 / H200 have no Table 4: their YAMLs reuse the A100 fractions of peak (an assumption).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from memplan.memory import PlanValues, symbol_values
from memplan.specs import GpuSpec, ModelSpec, Recompute, TrainingSpec
from memplan.states import stage_params

# --- calibrated constants (see the module docstring) -------------------------------------------
# Effective bus bandwidth of NCCL ring collectives and point-to-point sends as a fraction of the
# link rate: "450GB/s is the line rate. With the protocol overhead (~20%) NCCL can get an effective
# NVLink bandwidth of 370GB/s" (S. Jeaugey, NVIDIA/nccl-tests issue 212); 8 x A100 all_reduce
# busbw 232.5 of 300 GB/s and two DGX nodes 86 of 100 GB/s (NVIDIA/nccl-tests issue 175).
NCCL_BUS_EFFICIENCY = 0.80
# Fallbacks while GpuSpec lacks these fields (A100 values from K22 Table 4, module docstring).
DEFAULT_MEMORY_BOUND_EFFICIENCY = 0.95  # achieved fraction of HBM bandwidth in elementwise kernels
DEFAULT_ATTENTION_MATMUL_EFFICIENCY = 0.24  # achieved fraction of peak in QK^T and attention over V
# Exposed fraction of the backward TP collectives that Megatron-LM launches asynchronously next to
# an independent GEMM (input-gradient all-reduce / SP reduce-scatter and re-all-gather), from
# K22 Table 4's baseline backward (module docstring, step 4).
TP_ASYNC_EXPOSED_FRACTION = 0.14

# --- memory-bound kernels: bytes moved per element (A = activation bytes, 1-byte dropout masks) --
MASK_BYTES = 1  # K22 section 4.1: dropout masks are 1 byte
FP32_BYTES = 4
# Vocabulary-parallel cross-entropy on the logits (Megatron-LM): forward casts to fp32 (read A,
# write 4), max / exp-sum pass (read 4, write 4), normalise (read 4); backward reads the fp32
# softmax and writes the bf16 gradient (4 + A).
CROSS_ENTROPY_FWD_FP32_PASSES = 3  # fp32 bytes moved per logit beyond the cast: 3 x 4
CROSS_ENTROPY_BWD_FP32_PASSES = 1


# --- scalar / array helpers -----------------------------------------------------------------
def _is_array(*xs: Any) -> bool:
    return any(isinstance(x, np.ndarray) for x in xs)


def _where(cond: Any, x: Any, y: Any) -> Any:
    if _is_array(cond, x, y):
        return np.where(cond, x, y)
    return x if cond else y


def _maximum(x: Any, y: Any) -> Any:
    return np.maximum(x, y) if _is_array(x, y) else max(x, y)


def _f(x: Any) -> Any:
    """As float64 (FLOP counts overflow int64 for trillion-parameter models)."""
    return x.astype(np.float64) if isinstance(x, np.ndarray) else float(x)


def _gpu_memory_efficiency(gpu: GpuSpec) -> float:
    return getattr(gpu, "memory_bound_efficiency", DEFAULT_MEMORY_BOUND_EFFICIENCY)


def _gpu_attention_efficiency(gpu: GpuSpec) -> float:
    return getattr(gpu, "attention_matmul_efficiency", DEFAULT_ATTENTION_MATMUL_EFFICIENCY)


# --- FLOPs (K22 appendix A, generalised) ------------------------------------------------------
def layer_matmul_flops(model: ModelSpec) -> float:
    """Forward FLOPs of one layer's weight matmuls for one sequence (no t split):
    QKV 2sh(h + 2hg/a) + projection 2sh^2 + MLP 4shf (GeLU) or 6shf (SwiGLU); K22: 24sh^2."""
    s, h, a, g, f = (float(x) for x in (model.seq_length, model.hidden_size, model.num_attention_heads,
                                         model.g, model.f))
    mlp_matrices = 3 if model.mlp == "swiglu" else 2
    return 2 * s * h * (h + 2 * h * g / a) + 2 * s * h * h + mlp_matrices * 2 * s * h * f


def layer_attention_flops(model: ModelSpec) -> float:
    """Forward FLOPs of QK^T and attention over V for one sequence: 4s^2h (K22 appendix A)."""
    s, h = float(model.seq_length), float(model.hidden_size)
    return 4 * s * s * h


def logits_flops(model: ModelSpec) -> float:
    """Forward FLOPs of the output layer for one sequence: 2shv (K22 appendix A)."""
    return 2.0 * model.seq_length * model.hidden_size * model.vocab_size


def model_flops(model: ModelSpec, global_batch: Any) -> Any:
    """Model FLOPs of one step: 3 x forward (backward = 2 x forward). For a K22 GPT (f = 4h,
    g = a) this is 72 B L s h^2 (1 + s/(6h) + v/(12hL)), K22 Eq. 7."""
    per_sequence = model.num_layers * (layer_matmul_flops(model) + layer_attention_flops(model)) + logits_flops(model)
    return 3 * _f(global_batch) * per_sequence


def recomputed_layers_total(model: ModelSpec, plan: PlanValues) -> Any:
    """Layers of the whole model that the recompute mode applies to: recomputed_layers per chunk
    times p m chunks (0 when recompute is none)."""
    chunks = plan.p * plan.m
    return (plan.recompute != Recompute.NONE) * _minimum_layers(plan.recomputed_layers * chunks, model.num_layers)


def _minimum_layers(x: Any, layers: int) -> Any:
    return np.minimum(x, layers) if isinstance(x, np.ndarray) else min(x, layers)


def hardware_flops(model: ModelSpec, plan: PlanValues, global_batch: Any) -> Any:
    """Model FLOPs plus recomputation: selective re-runs the attention matmuls (4Bs^2h per layer),
    full re-runs the layer's forward. K22 Eq. 8 prints 1 + s/(3h) for selective; the count here
    is 1 + s/(6h) + s/(18h) (the 4Bs^2h of K22 section 5), which is what the text describes."""
    per_layer = _where(plan.recompute == Recompute.FULL,
                       layer_matmul_flops(model) + layer_attention_flops(model), layer_attention_flops(model))
    return model_flops(model, global_batch) + _f(global_batch) * recomputed_layers_total(model, plan) * per_layer


# --- one layer --------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Tp:
    """Plan-dependent factors shared by every formula (scalars or arrays)."""

    inv_t: Any  # 1/t: the tensor-parallel split
    rep: Any  # split of the replicated regions: 1/t with SP, else 1
    ag_per_byte: Any  # seconds per byte of an all-gather / reduce-scatter over t: (t-1)/t / bw
    sp: Any  # 0 / 1


def _tp_factors(gpu: GpuSpec, plan: PlanValues) -> _Tp:
    t = _f(plan.t)
    inv_t = 1.0 / t
    rep = _where(plan.sp != 0, inv_t, 1.0)
    link = _where(plan.t <= gpu.gpus_per_node, gpu.intra_node_bandwidth, gpu.inter_node_bandwidth)
    ag_per_byte = (1.0 - inv_t) / (link * NCCL_BUS_EFFICIENCY)
    return _Tp(inv_t, rep, ag_per_byte, plan.sp)


@dataclass(frozen=True)
class LayerBytes:
    """Memory-bound bytes of one layer for one sequence (no t split), forward and backward."""

    replicated_fwd: float  # norms, bias-dropout-residual adds (split by t only under SP)
    replicated_bwd: float
    tp_fwd: float  # softmax, attention dropout, activation function (split by t)
    tp_bwd: float
    attention_core_fwd: float  # softmax + attention dropout: what selective recompute re-runs


def layer_bytes(model: ModelSpec, activation_bytes: int = 2) -> LayerBytes:
    A = activation_bytes
    s, h, f, a = (float(x) for x in (model.seq_length, model.hidden_size, model.f, model.num_attention_heads))
    sh, scores, sf = s * h, a * s * s, s * f
    drop = 1 if model.dropout else 0
    # Two norms (read + write), two residual adds (read 2, write 1), two dropout masks.
    rep_fwd = (2 * 2 * A + 2 * 3 * A + 2 * drop * MASK_BYTES) * sh
    # Norm backward (read x, dy, write dx), dropout backward (read dy, mask, write dx), and the
    # sum of the residual and branch gradients at each sub-layer input (read 2, write 1).
    rep_bwd = (2 * 3 * A + 2 * drop * (2 * A + MASK_BYTES) + 2 * 3 * A) * sh
    softmax_fwd, softmax_bwd = 2 * A * scores, 3 * A * scores
    dropout_fwd = dropout_bwd = drop * (2 * A + MASK_BYTES) * scores
    if model.mlp == "swiglu":  # read gate and up, write the product; backward reads 3, writes 2
        act_fwd, act_bwd = 3 * A * sf, 5 * A * sf
    else:  # bias-GeLU: read, write; backward reads input and dy, writes dx
        act_fwd, act_bwd = 2 * A * sf, 3 * A * sf
    rope = 0.0
    if model.position_embedding == "rope":  # rotate Q and K (read + write), both passes
        rope = 2 * A * sh * (1 + model.g / model.num_attention_heads)
    return LayerBytes(
        replicated_fwd=rep_fwd,
        replicated_bwd=rep_bwd,
        tp_fwd=softmax_fwd + dropout_fwd + act_fwd + rope,
        tp_bwd=softmax_bwd + dropout_bwd + act_bwd + rope,
        attention_core_fwd=softmax_fwd + dropout_fwd,
    )


@dataclass(frozen=True)
class LayerTime:
    """One layer, one micro-batch, one GPU, in seconds (scalars or arrays).

    `backward_s` excludes recomputation; `recompute_s` is what the plan's recompute mode adds to
    the backward of a layer it applies to (K22 Table 4's backward column is their sum)."""

    forward_compute_s: Any
    forward_memory_s: Any
    forward_comm_s: Any  # exposed (all of it)
    backward_compute_s: Any
    backward_memory_s: Any
    backward_comm_s: Any  # all backward TP collectives
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


def layer_time(model: ModelSpec, gpu: GpuSpec, plan: PlanValues, activation_bytes: int = 2) -> LayerTime:
    """Forward and backward seconds of one layer for one micro-batch of plan.b sequences."""
    return _layer_time(model, gpu, plan, activation_bytes, _tp_factors(gpu, plan))


def _layer_time(model: ModelSpec, gpu: GpuSpec, plan: PlanValues, activation_bytes: int, tp: _Tp) -> LayerTime:
    b = _f(plan.b)
    peak = gpu.peak_bf16_flops
    bw_mem = gpu.memory_bandwidth * _gpu_memory_efficiency(gpu)
    matmul_s = layer_matmul_flops(model) / (peak * gpu.matmul_efficiency)  # per sequence, t = 1
    attention_s = layer_attention_flops(model) / (peak * _gpu_attention_efficiency(gpu))
    by = layer_bytes(model, activation_bytes)
    v_bytes = activation_bytes * float(model.seq_length * model.hidden_size)  # A*sh per sequence
    b_inv_t = b * tp.inv_t
    b_ag = b * v_bytes * tp.ag_per_byte  # one all-gather (or reduce-scatter) of the layer's A*sbh

    fwd_compute = b_inv_t * (matmul_s + attention_s)
    fwd_memory = b * (by.replicated_fwd * tp.rep + by.tp_fwd * tp.inv_t) / bw_mem
    fwd_comm = 4 * b_ag  # 2 all-reduces, or with SP 2 all-gathers + 2 reduce-scatters
    bwd_compute = 2 * fwd_compute
    bwd_memory = b * (by.replicated_bwd * tp.rep + by.tp_bwd * tp.inv_t) / bw_mem
    # Async slot: 2 all-reduces (= 4 ag), or with SP 2 reduce-scatters + 2 re-all-gathers (= 4 ag);
    # with SP also 2 synchronous all-gathers (backward of the row-parallel outputs' reduce-scatter).
    bwd_comm = b_ag * (4 + 2 * tp.sp)
    bwd_exposed = b_ag * (4 * TP_ASYNC_EXPOSED_FRACTION + 2 * tp.sp)

    selective = b_inv_t * (attention_s + by.attention_core_fwd / bw_mem)
    full = fwd_compute + fwd_memory + fwd_comm
    recompute = (plan.recompute == Recompute.SELECTIVE) * selective + (plan.recompute == Recompute.FULL) * full
    return LayerTime(fwd_compute, fwd_memory, fwd_comm, bwd_compute, bwd_memory, bwd_comm, bwd_exposed, recompute)


# --- the whole step ---------------------------------------------------------------------------
@dataclass(frozen=True)
class StepTime:
    """One training step (scalars or arrays). The exposed parts add up to step_time_s:
    compute + memory + tp_comm_exposed + recompute + bubble + pp_comm + dp_comm_exposed
    + zero3_gather_exposed + optimizer."""

    model_flops: Any  # per step, whole job (K22 Eq. 7 generalised)
    hardware_flops: Any  # model FLOPs + recomputation
    compute_s: Any  # matmuls of forward + backward, all micro-batches, bottleneck stage
    memory_s: Any  # memory-bound kernels of forward + backward
    recompute_s: Any  # the recomputed forwards (selective: attention core; full: whole layer)
    tp_comm_s: Any  # all tensor-parallel collectives (forward + backward)
    tp_comm_exposed_s: Any  # the part not hidden behind GEMMs
    bubble_fraction: Any  # (p - 1)/(m M) of the ideal pipeline time
    bubble_s: Any
    pp_comm_s: Any  # pipeline point-to-point sends (counted as exposed)
    dp_comm_s: Any  # gradient reduction (+ parameter all-gather with ZeRO >= 1)
    dp_comm_exposed_s: Any  # after --overlap-grad-reduce / --overlap-param-gather
    zero3_gather_s: Any  # ZeRO-3 weight all-gathers, forward and backward of every micro-batch
    zero3_gather_exposed_s: Any
    optimizer_s: Any  # memory-bound optimizer update of this GPU's shard
    step_time_s: Any
    tokens_per_s: Any
    mfu: Any  # model FLOPs / (step x GPUs x peak)
    hfu: Any  # hardware FLOPs / (step x GPUs x peak)


def _link(gpu: GpuSpec, span: Any) -> Any:
    """Per-GPU bandwidth of a group spanning `span` consecutive ranks: NVLink within a node."""
    return _where(span <= gpu.gpus_per_node, gpu.intra_node_bandwidth, gpu.inter_node_bandwidth) * NCCL_BUS_EFFICIENCY


def _overlapped(comm: Any, window: Any, buckets: Any) -> Any:
    """Exposed time of a collective split into `buckets` per-layer chunks, overlapped with `window`
    seconds of compute: all but the last chunk hide behind the compute (Megatron Bridge docs,
    communication overlap: "This overlap method exposes only one DP communication chunk")."""
    return _maximum(comm - window, comm / buckets)


def step_time(model: ModelSpec, training: TrainingSpec, gpu: GpuSpec, plan: PlanValues,
              global_batch: Any) -> StepTime:
    """Estimated time of one training step of `global_batch` sequences, its FLOPs and MFU."""
    A = training.activation_bytes
    tp = _tp_factors(gpu, plan)
    lt = _layer_time(model, gpu, plan, A, tp)
    b = _f(plan.b)
    M = _f(plan.microbatches)
    p, m, d = _f(plan.p), _f(plan.m), _f(plan.d)
    s, h, v = float(model.seq_length), float(model.hidden_size), float(model.vocab_size)
    peak, matmul = gpu.peak_bf16_flops, gpu.matmul_efficiency
    bw_mem = gpu.memory_bandwidth * _gpu_memory_efficiency(gpu)
    first = _f(plan.p == 1)  # the bottleneck (last) stage also holds the embedding when p = 1
    layers = model.num_layers / p
    recomputed = (plan.recompute != Recompute.NONE) * _f(plan.recomputed_layers) * m
    b_ag = b * A * s * h * tp.ag_per_byte

    # LM head (last stage): final norm, logits 2bshv/t, vocabulary-parallel fp32 cross-entropy.
    # Its input goes through Megatron's f (backward all-reduce, async) or with SP an all-gather
    # (forward, synchronous) whose backward is a reduce-scatter (async).
    head_compute = 3 * b * logits_flops(model) * tp.inv_t / (peak * matmul)
    logits_elements = b * s * v * tp.inv_t
    head_memory = (b * s * h * tp.rep * (2 * A + 3 * A)
                   + logits_elements * (A + FP32_BYTES * (1 + CROSS_ENTROPY_FWD_FP32_PASSES))
                   + logits_elements * (A + FP32_BYTES * CROSS_ENTROPY_BWD_FP32_PASSES)) / bw_mem
    head_comm = b_ag * (tp.sp + (2 - tp.sp))
    head_exposed = b_ag * (tp.sp + (2 - tp.sp) * TP_ASYNC_EXPOSED_FRACTION)
    # Embedding (first stage): lookup (read + write), learned-position add (read 2, write 1) and
    # dropout; backward: dropout and the gradient's accumulation (read A, read + write fp32).
    # Vocabulary-parallel output: all-reduce, or with SP reduce-scatter (backward: all-gather).
    drop = 1 if model.dropout else 0
    pos = 3 * A if model.position_embedding == "learned" else 0
    emb_memory = b * s * h * tp.rep * (2 * A + pos + drop * (2 * A + MASK_BYTES)
                                       + drop * (2 * A + MASK_BYTES) + A + 2 * FP32_BYTES) / bw_mem
    emb_comm = b_ag * (2 - tp.sp + tp.sp)

    compute_mb = layers * (lt.forward_compute_s + lt.backward_compute_s) + head_compute
    memory_mb = layers * (lt.forward_memory_s + lt.backward_memory_s) + head_memory + first * emb_memory
    tp_mb = layers * (lt.forward_comm_s + lt.backward_comm_s) + head_comm + first * emb_comm
    tp_exposed_mb = layers * (lt.forward_comm_s + lt.backward_comm_exposed_s) + head_exposed + first * emb_comm
    recompute_mb = recomputed * lt.recompute_s
    microbatch = compute_mb + memory_mb + tp_exposed_mb + recompute_mb

    bubble_fraction = (p - 1) / (m * M)
    ideal = M * microbatch
    bubble = bubble_fraction * ideal

    # Pipeline point-to-point: each (micro-batch, chunk) receives its activation in the forward and
    # its gradient in the backward, A*sbh/t bytes per GPU with SP (each TP rank sends its sequence
    # shard), A*sbh without (Megatron-core sends the full tensor from every TP rank; the old
    # scatter/gather optimisation of Narayanan et al. 2021 section 4.1 is not modelled). Each GPU
    # uses its own link (DGX: one NIC per GPU). Stages are t*d ranks apart (Megatron rank order
    # tp-dp-pp): the network as soon as the pipeline spans more than one node. Counted as exposed
    # along the critical path of M m + p - 1 forward and as many backward slots.
    p2p_bytes = b * A * s * h * tp.rep
    pp_bw = _link(gpu, plan.t * plan.d * plan.p)
    pp_comm = (p > 1) * 2 * (M * m + p - 1) * p2p_bytes / pp_bw

    # Data parallelism over d ranks t apart: NVLink while t*d fits a node. Gradients of this stage
    # (training.grad_bytes each, fp32 main grads); without ZeRO a ring all-reduce, with ZeRO >= 1
    # (Megatron-LM distributed optimizer) a reduce-scatter, then an all-gather of the updated bf16
    # weights (ZeRO-3 gathers on demand instead, below). Overlap: --overlap-grad-reduce hides the
    # reduction behind the last micro-batch's backward, --overlap-param-gather the all-gather
    # behind the next step's first forward; one per-layer bucket stays exposed (_overlapped).
    values = symbol_values(model, plan)
    params = _f(stage_params(model, values, model.num_layers // plan.p, plan.p == 1, 1, plan.p))
    dp_per_byte = (d - 1) / d / _link(gpu, plan.t * plan.d)
    sharded = plan.zero >= 1
    grad_reduce = params * training.grad_bytes * dp_per_byte * _where(sharded, 1.0, 2.0)
    param_gather = (plan.zero >= 1) * (plan.zero < 3) * params * training.weight_bytes * dp_per_byte
    backward_mb = layers * lt.backward_s + recompute_mb + head_compute * 2 / 3
    forward_mb = layers * lt.forward_s
    dp_comm = grad_reduce + param_gather
    dp_exposed = _overlapped(grad_reduce, backward_mb, layers) + _overlapped(param_gather, forward_mb, layers)

    # ZeRO-3 (Rajbhandari et al. 2020): every micro-batch gathers the stage's weights in the
    # forward and again in the backward, prefetched one layer ahead.
    gather_pass = (plan.zero >= 3) * params * training.weight_bytes * dp_per_byte
    zero3 = 2 * M * gather_pass
    zero3_exposed = M * (_overlapped(gather_pass, forward_mb, layers) + _overlapped(gather_pass, backward_mb, layers))

    # Optimizer step, memory-bound over this GPU's shard (ZeRO >= 1: 1/d of the stage): read the
    # master weights, gradients and moments, write master, moments and the bf16 weights, plus one
    # read of the gradients for the norm used in clipping (Megatron-LM clip_grad_norm).
    state = training.optimizer_moments * training.optimizer_state_bytes
    update_bytes = (2 * training.master_weight_bytes + 2 * training.grad_bytes + 2 * state
                    + training.weight_bytes)
    optimizer = params * _where(sharded, 1.0 / d, 1.0) * update_bytes / bw_mem

    step = ideal + bubble + pp_comm + dp_exposed + zero3_exposed + optimizer
    flops = model_flops(model, global_batch)
    hw_flops = hardware_flops(model, plan, global_batch)
    gpus = _f(plan.t * plan.p * plan.d)
    return StepTime(
        model_flops=flops,
        hardware_flops=hw_flops,
        compute_s=M * compute_mb,
        memory_s=M * memory_mb,
        recompute_s=M * recompute_mb,
        tp_comm_s=M * tp_mb,
        tp_comm_exposed_s=M * tp_exposed_mb,
        bubble_fraction=bubble_fraction,
        bubble_s=bubble,
        pp_comm_s=pp_comm,
        dp_comm_s=dp_comm,
        dp_comm_exposed_s=dp_exposed,
        zero3_gather_s=zero3,
        zero3_gather_exposed_s=zero3_exposed,
        optimizer_s=optimizer,
        step_time_s=step,
        tokens_per_s=_f(global_batch) * s / step,
        mfu=flops / (step * gpus * peak),
        hfu=hw_flops / (step * gpus * peak),
    )
