"""One transformer layer and the LM head / embedding of one micro-batch, as linear forms (LayerForms,
HeadForms, cached per model and GPU), and LayerTime / layer_time: a layer's forward, backward and recompute
seconds.

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
- torchtitan (--impl torchtitan): its per-op selective AC re-runs two of the five matmuls and the forward's
  memory-bound ops (_titan_selective); a compiled layer's memory-bound ops run fused (layer_forms).
- torchtitan's memory-budget AC (--ac budget:F --compile): every compiled layer's backward re-runs what the
  partitioner chose not to save, traced (memplan/inventory/budget_recompute.py; _budget_recompute).
- recompute, per recomputed layer, in the backward: selective re-runs the attention core (its
  matmuls, softmax and dropout; with a flash kernel, megatron-core's checkpointed core attention
  re-runs the kernel's forward, which re-creates only its log-sum-exp); full re-runs the whole
  forward, its communication included (K22 section 5: one more forward, about 33% more FLOPs)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

from memplan.core.model import ModelSpec
from memplan.core.specs import GpuSpec
from memplan.core.training import Recompute
from memplan.inventory import budget_recompute, titan_float8
from memplan.inventory.fp8 import cast_traffic
from memplan.memory.term_bytes import PlanValues
from memplan.timing.arrays import as_python, as_time, maximum, plan_floats
from memplan.timing.calibration import attention_matmul_efficiency, memory_bound_efficiency
from memplan.timing.comm import TP_ASYNC_EXPOSED_FRACTION
from memplan.timing.flops import (
    attention_time_flops,
    gemms_per_layer,
    layer_attention_flops,
    layer_matmul_flops,
    logits_flops,
    mtp_flops,
    titan_selective_flops,
)
from memplan.timing.forms import Basis, Form, basis, evaluate
from memplan.timing.traffic import (
    CROSS_ENTROPY_BWD_FP32_ACCESSES,
    CROSS_ENTROPY_FWD_FP32_ACCESSES,
    FP32_BYTES,
    FUSED_IMPLS,
    MASK_BYTES,
    layer_traffic_bytes,
)


@dataclass(frozen=True)
class LayerForms:
    fwd_compute: Form
    fwd_memory: Form
    fwd_comm: Form
    bwd_compute: Form
    bwd_memory: Form
    bwd_comm: Form
    bwd_comm_exposed: Form
    selective: Form  # what selective recompute adds to a layer's backward
    full: Form  # what full recompute adds: the whole forward
    budget: Form = Form()  # what torchtitan's memory-budget AC re-runs in every compiled layer's backward

    @property
    def forward(self) -> Form:
        return self.fwd_compute + self.fwd_memory + self.fwd_comm

    @property
    def backward(self) -> Form:
        return self.bwd_compute + self.bwd_memory + self.bwd_comm_exposed


@functools.lru_cache(maxsize=64)
def layer_forms(model: ModelSpec, gpu: GpuSpec, activation_bytes: int, impl: str = "megatron",
                 fp8: bool = False, compiled: bool = False, float8: Optional[str] = None,
                 budget: Optional[float] = None) -> LayerForms:
    """One layer's forms; `compiled`: each decoder layer torch.compile'd (--compile), whose memory-bound ops Inductor
    fuses: their traffic taken as the fused kernels' (layer_traffic_bytes(fused=True): each elementwise chain reads
    its inputs and writes its output once) instead of eager's op-by-op passes. Derived, not measured: uncalibrated
    (docs/torchtitan.md compares the speed-up with torchtitan's published tables). `fp8`: Transformer Engine's FP8
    (Megatron-LM); `float8`: torchtitan's torchao float8 recipe (memplan/inventory/titan_float8.py), its GEMMs on the
    FP8 tensor cores and its casts' traffic, the weights' per micro-batch and TP rank. `budget`: torchtitan's
    memory-budget AC at F (compiled, tp 1), what its partitioner re-runs (`_budget_recompute`)."""
    peak = gpu.peak_bf16_flops
    hbm = gpu.memory_bandwidth * memory_bound_efficiency(gpu)
    # FP8 (memplan/inventory/fp8.py): the weight GEMMs on the FP8 tensor cores, the attention core in bf16
    gemm_peak = gpu.peak_fp8_flops if (fp8 or float8) and gpu.peak_fp8_flops else peak
    matmul = layer_matmul_flops(model) / (gemm_peak * gpu.matmul_efficiency)
    attention = attention_time_flops(model) / (peak * attention_matmul_efficiency(gpu, model))
    by = layer_traffic_bytes(model, activation_bytes, fused=impl in FUSED_IMPLS or compiled)
    if fp8:
        by = cast_traffic(model, activation_bytes, by)
    weight_casts = (0.0, 0.0)
    if float8:
        by = titan_float8.cast_traffic(model, compiled, by)
        weight_casts = titan_float8.weight_cast_bytes(model, float8, compiled)
    v = float(activation_bytes * model.seq_length * model.hidden_size)  # the A*sh a collective moves
    # Each GEMM kernel: its FLOPs at matmul_efficiency plus a fixed matmul_overhead_s, paid once per
    # micro-batch (the u/b coefficient), so large GEMMs run closer to matmul_efficiency than small.
    fwd_compute = Form(t=matmul + attention, u=gemms_per_layer(model, impl) * gpu.matmul_overhead_s)
    fwd_memory = Form(t=by.tp_fwd / hbm, r=by.replicated_fwd / hbm, w=weight_casts[0] / hbm)
    # Forward: 2 all-reduces (2 ag each), or with SP 2 all-gathers + 2 reduce-scatters: exposed.
    fwd_comm = Form(a=4 * v)
    # Backward: in the async slot 2 all-reduces, or with SP 2 reduce-scatters + 2 re-all-gathers of
    # the saved sequence-split input (4 ag either way); with SP also 2 synchronous all-gathers (the
    # backward of each row-parallel output's reduce-scatter).
    bwd_comm = Form(a=4 * v, s=2 * v)
    bwd_exposed = Form(a=4 * v * TP_ASYNC_EXPOSED_FRACTION, s=2 * v)
    forms = LayerForms(
        fwd_compute=fwd_compute,
        fwd_memory=fwd_memory,
        fwd_comm=fwd_comm,
        bwd_compute=2 * fwd_compute,  # K22 appendix A: backward = 2 x forward
        bwd_memory=Form(t=by.tp_bwd / hbm, r=by.replicated_bwd / hbm, w=weight_casts[1] / hbm),
        bwd_comm=bwd_comm,
        bwd_comm_exposed=bwd_exposed,
        selective=Form(t=attention + by.attention_core_fwd / hbm),
        full=Form(),
    )
    if impl == "torchtitan":
        forms = LayerForms(**{**forms.__dict__, "selective": _titan_selective(model, gpu, gemm_peak, fwd_memory, v)})
    if budget is not None:
        forms = LayerForms(**{**forms.__dict__, "budget": _budget_recompute(model, gpu, gemm_peak, hbm, attention,
                                                                           budget)})
    return LayerForms(**{**forms.__dict__, "full": forms.forward})


def _titan_selective(model: ModelSpec, gpu: GpuSpec, gemm_peak: float, fwd_memory: Form, v: float) -> Form:
    """What torchtitan's per-op selective AC (--ac selective-op: SelectiveAC, torchtitan/distributed/
    activation_checkpoint.py) re-runs in a layer's backward: its policy saves the outputs of the attention kernel,
    of TP's reduce-scatters and of every other matmul of the block (the 1st, 3rd, 5th: wqkv, w1, w2), and recomputes
    the rest: the 2nd and 4th matmuls (wo, 2sqh; w3, 2shf), every memory-bound op of the forward (norms, RoPE, SwiGLU,
    residual adds) and, under TP, the all-gathers of the sequence-parallel norms' outputs (2 of v, not in the save
    list). Derived from the policy, not measured."""
    return Form(t=titan_selective_flops(model) / (gemm_peak * gpu.matmul_efficiency), u=2 * gpu.matmul_overhead_s, a=2 * v) + fwd_memory


def _budget_recompute(model: ModelSpec, gpu: GpuSpec, gemm_peak: float, hbm: float, attention: float,
                      budget: float) -> Form:
    """What torchtitan's memory-budget AC (--ac budget:F --compile) re-runs in a compiled layer's backward beyond the
    plain compiled block's own recompute: the matmuls, the attention kernel and the memory-bound bytes traced from
    the partitioned graph (memplan/inventory/budget_recompute.py), timed as the forward's (GEMM efficiency, the
    attention's, the memory-bound one): derived from the traced graph, uncalibrated."""
    r = budget_recompute.recompute(model, budget)
    s = float(model.seq_length)
    return Form(t=r["matmul_flops"] * s / (gemm_peak * gpu.matmul_efficiency) + r["attention"] * attention
                + r["memory_bytes"] * s / hbm, u=r["gemms"] * gpu.matmul_overhead_s)


@dataclass(frozen=True)
class HeadForms:
    """LM head (last stage) and embedding (first stage), forward + backward, one sequence."""

    head_compute: Form
    mtp_compute: Form  # the multi-token-prediction layers' matmuls and attention, forward + backward (flops.mtp_flops)
    head_memory: Form
    head_comm: Form
    head_comm_exposed: Form
    embedding_memory: Form
    embedding_comm: Form  # all exposed


@functools.lru_cache(maxsize=64)
def head_forms(model: ModelSpec, gpu: GpuSpec, activation_bytes: int) -> HeadForms:
    A = activation_bytes
    hbm = gpu.memory_bandwidth * memory_bound_efficiency(gpu)
    s, h, v = float(model.seq_length), float(model.hidden_size), float(model.vocab_size)
    sh, sv, vol = s * h, s * v, A * s * h
    # Final norm (2A forward, 3A backward per element, replicated) and the fp32 cross-entropy over
    # the vocabulary-parallel logits (split by t); logits 2shv forward, twice that backward.
    head_memory = Form(r=5 * A * sh / hbm,
                        t=sv * (A + FP32_BYTES * CROSS_ENTROPY_FWD_FP32_ACCESSES
                                + A + FP32_BYTES * CROSS_ENTROPY_BWD_FP32_ACCESSES) / hbm)
    # The head's input passes Megatron's f: an all-reduce in the backward (async, 2 ag), or with SP
    # an all-gather in the forward (synchronous) and a reduce-scatter in the backward (async).
    head_comm = Form(a=2 * vol)
    head_exposed = Form(a=2 * vol * TP_ASYNC_EXPOSED_FRACTION, s=vol * (1 - TP_ASYNC_EXPOSED_FRACTION))
    # Embedding: lookup (read + write), learned-position add (read 2, write 1), dropout; backward:
    # dropout and the accumulation into the fp32 main gradient (read A, read + write 4).
    drop = 1 if model.dropout else 0
    pos = 3 * A if model.position_embedding == "learned" else 0
    emb_bytes = 2 * A + pos + 2 * drop * (2 * A + MASK_BYTES) + A + 2 * FP32_BYTES
    # the MTP layers (a sequence's share of every rank's, / t like the head): their GEMMs at the GEMM efficiency, their
    # attention core as a layer's kernel runs it (its causal share); derived, not measured
    mtp = mtp_flops(model)
    mtp = (mtp[0], mtp[1] * attention_time_flops(model) / layer_attention_flops(model))
    # Vocabulary-parallel output: all-reduce (2 ag) forward, or with SP a reduce-scatter forward
    # and an all-gather backward: 2 ag, synchronous either way.
    return HeadForms(
        # The logits GEMM forward, its dgrad and wgrad: 3 kernels.
        head_compute=Form(t=3 * logits_flops(model) / (gpu.peak_bf16_flops * gpu.matmul_efficiency),
                           u=3 * gpu.matmul_overhead_s),
        mtp_compute=Form(t=3 * (mtp[0] / (gpu.peak_bf16_flops * gpu.matmul_efficiency) + mtp[1] / (
            gpu.peak_bf16_flops * attention_matmul_efficiency(gpu, model)))),
        head_memory=head_memory,
        head_comm=head_comm,
        head_comm_exposed=head_exposed,
        embedding_memory=Form(r=emb_bytes * sh / hbm),
        embedding_comm=Form(a=2 * vol),
    )


def async_tp_exposed(model: ModelSpec, gpu: GpuSpec, x: Basis, activation_bytes: int, fp8: bool) -> tuple[Any, Any]:
    """Seconds per sequence of one layer's TP collectives that torchtitan's async TP leaves exposed: the forward's,
    and the forward's and backward's together (memplan/inventory/titan_async_tp.py). Inductor's micro-pipeline pass
    (torch/_inductor/fx_passes/micro_pipeline_tp.py) fuses an all-gather with the matmuls it feeds and a reduce-scatter
    with the one matmul (`_find_producer_matmul`: an mm, or reshape-mm-reshape) that produces its input. A fused op
    runs its collective, A s h / t bytes at the all-gather's x.ag per byte, chunk by chunk beside its matmul's chunks,
    so it charges only what the matmul cannot hide: max(comm - matmul, 0) (the last chunk's own transfer, the copy
    engines' contention and the smaller chunked GEMMs' efficiency not counted). Forward: all-gather + wqkv,
    all-gather + w1 / w3 (one fused op, two matmuls), wo + reduce-scatter, w2 + reduce-scatter. Backward (the 6
    collectives the eager forms count, layer_forms): the all-gathers of wo's and w2's output gradients with their
    input-gradient GEMMs; wqkv's input-gradient GEMM with its reduce-scatter; the MLP's input gradient is w1's and
    w3's summed, no single matmul, so its reduce-scatter is not fused: exposed whole; the re-all-gathers of wqkv's and
    w1 / w3's sequence-sharded inputs with their weight-gradient GEMMs. Derived, uncalibrated; the LM head's
    collectives stay as they were (the head is not in a compiled block)."""
    s, h, q, a, g, f = (float(v) for v in (model.seq_length, model.hidden_size, model.q, model.num_attention_heads,
                                           model.g, model.f))
    rate = (gpu.peak_fp8_flops if fp8 and gpu.peak_fp8_flops else gpu.peak_bf16_flops) * gpu.matmul_efficiency
    qkv, w13 = 2 * s * h * (q + 2 * q * g / a), 2 * 2 * s * h * f  # column-parallel: wqkv; w1 and w3
    wo, w2 = 2 * s * q * h, 2 * s * h * f  # row-parallel
    comm = activation_bytes * s * h * x.ag  # one collective's seconds per sequence

    def left(flops: float) -> Any:
        return maximum(comm - (flops / rate) * x.inv_t, 0.0)

    forward = left(qkv) + left(w13) + left(wo) + left(w2)
    backward = left(wo) + left(w2) + left(qkv) + comm + left(qkv) + left(w13)
    return forward, forward + backward


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
               impl: str = "megatron", compiled: bool = False) -> LayerTime:
    """Forward and backward seconds of one layer for one micro-batch of plan.b sequences, run by
    implementation `impl` (fused kernels for megatron, PyTorch eager ops otherwise)."""
    pf = plan_floats(plan)
    x = basis(gpu, pf)
    lf = layer_forms(model, gpu, activation_bytes, impl, compiled=compiled)
    selective = as_time(plan.recompute == Recompute.SELECTIVE)
    full = as_time(plan.recompute == Recompute.FULL)
    return LayerTime(**as_python(dict(
        forward_compute_s=pf.b * lf.fwd_compute(x),
        forward_memory_s=pf.b * lf.fwd_memory(x),
        forward_comm_s=pf.b * lf.fwd_comm(x),
        backward_compute_s=pf.b * lf.bwd_compute(x),
        backward_memory_s=pf.b * lf.bwd_memory(x),
        backward_comm_s=pf.b * lf.bwd_comm(x),
        backward_comm_exposed_s=pf.b * lf.bwd_comm_exposed(x),
        recompute_s=pf.b * evaluate(x, (selective, lf.selective), (full, lf.full)),
    )))
