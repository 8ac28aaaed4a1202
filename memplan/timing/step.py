"""Step time, FLOPs and MFU of a training plan: a roofline-style model calibrated on K22 Tables 4
and 5 (A100) and on a K22 layer measured on an H100.

This module owns the step itself: the bottleneck stage's micro-batches, the pipeline
bubble (even and uneven stages), the pipeline point-to-point sends, the exposed data-parallel and ZeRO-3 traffic,
the optimizer update, offload's host copies, and from them StepTime (step time, MFU, HFU); step_time evaluates
long arrays of plans in blocks. The pieces live beside it in memplan/timing/: FLOPs (flops.py), the calibrated
efficiencies (calibration.py, which also holds the calibration's derivations), memory-bound bytes (traffic.py),
one layer and the LM head (layer.py), collectives (comm.py), the linear forms (forms.py) and the scalar / array
helpers (arrays.py).

A micro-batch on the bottleneck stage (the last one: it has the LM head, and also the embedding
when p = 1) costs L/p layers' forward + backward, m x recomputed_layers layers' recompute, the LM
head (logits 2bshv/t, fp32 cross-entropy) and, when p = 1, the embedding. A step is

    M micro-batches on the bottleneck stage
    + (p - 1)/m slots of a stage's micro-batch  1F1B / interleaved bubble (Narayanan et al. 2021)
    + pipeline point-to-point (1/t of the tensor per GPU: SP or Megatron-LM's scatter/gather)
    + exposed data-parallel communication + exposed ZeRO-3 gathers
    + the optimizer update (memory-bound)

and MFU = model_flops / (step x t p d x peak_bf16_flops) (K22 appendix A), its model FLOPs counting the
attention square as the causal mask leaves it, half (memplan/timing/flops.py CAUSAL_ATTENTION_FRACTION; K22's
full square gives MFU above 100 % at long s against a causal kernel's time).

Not modelled: context / expert parallelism, per-iteration costs outside the layers beyond the
head and the optimizer (K22's 22B iteration is about 50 ms longer than its 48 layers and head,
which leaves the 22B rows of Table 5 4.6% and 2.6% fast), and Megatron's TP communication overlap
(--tp-comm-overlap), which would hide part of the forward collectives."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.core.specs import GpuSpec
from memplan.core.training import TrainingSpec
from memplan.inventory import titan_float8
from memplan.memory.offload import layer_copy_bytes, offloads, stepped_bytes
from memplan.memory.states import counter, stage_params
from memplan.memory.pipeline_multi import bubble_share
from memplan.memory.term_bytes import PlanValues
from memplan.timing.arrays import as_python, as_time, maximum, minimum, plan_floats, select
from memplan.timing.calibration import attention_matmul_efficiency, calibration, memory_bound_efficiency
from memplan.timing.comm import cp_ep_comm_s, link_per_byte, overlapped
from memplan.timing.flops import attention_time_flops, hardware_flops, model_flops, model_flops_per_sequence
from memplan.timing.forms import Form, basis, evaluate
from memplan.timing.layer import async_tp_exposed, head_forms, layer_forms
from memplan.timing.traffic import CROSS_ENTROPY_FWD_FP32_ACCESSES, FP32_BYTES


def _host_bandwidth(gpu: GpuSpec, training: TrainingSpec) -> float:
    """The GPU preset's host <-> GPU bytes/s, which offload's copies need (1.0, unused, without offload)."""
    if not offloads(training):
        return 1.0
    if gpu.host_bandwidth is None:
        raise MemplanError(f"GPU {gpu.name} has no host_bandwidth (bytes/s between host memory and the GPU): offload's "
                           "copies cannot be timed; add it to the GPU's YAML, e.g. host_bandwidth: 25GB/s")
    return gpu.host_bandwidth


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

    model_flops: Any  # per step, whole job (K22 Eq. 7 generalised; attention halved as the causal mask leaves it)
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
    host_copy_s: Any  # offload's copies between host and GPU over PCIe (memplan/memory/offload.py), all exposed
    cp_ep_comm_exposed_s: Any  # context parallelism's K/V exchange and expert parallelism's token all-to-alls left
    # exposed (memplan/memory/parallel.py)
    step_time_s: Any
    tokens_per_s: Any
    mfu: Any  # model FLOPs / (step x GPUs x peak)
    hfu: Any  # hardware FLOPs / (step x GPUs x peak)
    calibrated: Any  # bool: the GPU, implementation and attention kernel were measured (calibration())
    uncertainty: Any  # relative spread of step_time_s when calibrated, else None


def _stage_params(model: ModelSpec, plan: PlanValues) -> Any:
    """Parameters on one GPU of the last pipeline stage (also the first when p = 1): the
    states.py inventory, as floats."""
    return as_time(stage_params(model, counter(plan.symbols(model)), plan.layers(model, plan.p - 1), plan.p == 1, 1,
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


def _step_time(model: ModelSpec, training: TrainingSpec, gpu: GpuSpec, plan: PlanValues,
               global_batch: Any, breakdown: bool, impl: str = "megatron") -> StepTime:
    A = training.activation_bytes
    pf = plan_floats(plan)
    x = basis(gpu, pf)
    lf = layer_forms(model, gpu, A, impl, training.fp8 is not None, bool(training.compile), training.float8,
                     training.memory_budget if training.compile else None)
    hf = head_forms(model, gpu, A)
    hbm = gpu.memory_bandwidth * memory_bound_efficiency(gpu)
    s, h = float(model.seq_length), float(model.hidden_size)
    b, M, p, m, d, first = pf.b, pf.M, pf.p, pf.m, pf.d, pf.first
    # uneven pipeline stages (memplan/memory/pipeline.py stage_layers): `split` marks the plans whose split is uneven (the
    # others keep the even split's numbers exactly)
    uneven = plan.first_layers is not None
    split = uneven and (plan.first_layers * plan.p != model.num_layers) | (plan.last_layers * plan.p != model.num_layers)
    layers = model.num_layers / p  # the last stage's layers
    if uneven:
        layers = select(split, as_time(plan.last_layers), layers)
    bm = b * M  # sequences per step through this stage

    # Per sequence on the bottleneck stage: L/p layers, the LM head and (p = 1) the embedding.
    layer_compute, head_compute = lf.fwd_compute + lf.bwd_compute, hf.head_compute
    layer_memory, head_memory, emb_memory = lf.fwd_memory + lf.bwd_memory, hf.head_memory, hf.embedding_memory
    if training.loss_chunks > 1:
        # a chunked loss (memplan/inventory/chunked_loss.py) re-runs each chunk's forward in the backward: one more logits
        # GEMM and the forward cross-entropy's bytes, and 4 GEMM kernels per chunk (forward, recompute, input and
        # weight gradients) instead of 3 for the whole head (derived, not measured)
        chunks = training.loss_chunks
        head_compute = head_compute + Form(t=hf.head_compute.t / 3.0,
                                            u=(4.0 * chunks - 3.0) * gpu.matmul_overhead_s)
        head_memory = head_memory + Form(t=s * float(model.vocab_size) * (
            A + FP32_BYTES * CROSS_ENTROPY_FWD_FP32_ACCESSES) / hbm)
    layer_exposed, head_exposed, emb_comm = lf.fwd_comm + lf.bwd_comm_exposed, hf.head_comm_exposed, hf.embedding_comm
    # torchtitan's async TP: one layer's exposed TP seconds per sequence become what its fused ops leave (forward;
    # forward and backward): the change, added where a layer's time is counted (zero without async TP)
    fwd_delta = delta = 0.0
    if training.async_tp:
        fwd_async, all_async = async_tp_exposed(model, gpu, x, A, training.float8 is not None)
        fwd_delta, delta = fwd_async - lf.fwd_comm(x), all_async - layer_exposed(x)
    forward = lf.forward(x) + fwd_delta  # one layer's forward, also what full recompute adds
    # torchtitan's memory-budget AC: every compiled layer re-runs what its partitioner did not save (zero otherwise)
    budget = lf.budget(x)
    recompute = m * (pf.selective * lf.selective(x) + pf.full * forward) + layers * budget
    compute = evaluate(x, (layers, layer_compute), (1.0, head_compute + hf.mtp_compute))  # MTP: the last stage's
    memory = evaluate(x, (layers, layer_memory), (1.0, head_memory), (first, emb_memory))
    tp_exposed = evaluate(x, (layers, layer_exposed), (1.0, head_exposed), (first, emb_comm)) + layers * delta
    # Activation offload (memplan/memory/offload.py): save_on_cpu copies every saved tensor of a layer to the host in the
    # forward and back in the backward, on the compute stream (exposed): 2 x its bytes per layer and micro-batch.
    # torchtune's OffloadActivations copies on a side stream, overlapped: no time added (derived).
    host_bw = _host_bandwidth(gpu, training)
    act_copy = 0.0 * b
    if training.offload_activations and training.activation_offloader != "torchtune":
        act_copy = layers * ((2.0 / host_bw) * as_time(layer_copy_bytes(model, training, plan, impl))) / b
    # Context parallelism: each GPU computes 1/cp of every sequence (the causal load balance makes the shares equal),
    # and exchanges K/V (cp) and routed tokens (ep) on top (memplan/memory/parallel.py).
    inv_cp = 1.0 / pf.cp
    cp_ep = cp_ep_comm_s(model, gpu, pf, A, layers, attention_time_flops(model) / (
        gpu.peak_bf16_flops * attention_matmul_efficiency(gpu, model)), plan.cp_comm)
    per_sequence = (compute + memory + tp_exposed + recompute + act_copy) * inv_cp + cp_ep
    ideal = bm * per_sequence

    # 1F1B / interleaved pipeline bubble: (p - 1)/m slots of one stage's forward + backward of a
    # micro-batch (Narayanan et al. 2021), i.e. (p - 1)/(m M) of a stage's busy time. The slots
    # are the other stages' warm-up forwards and cool-down backwards, so they are priced at a
    # stage of L/p layers without the LM head (the bottleneck stage's own time is `ideal`).
    chunk_steps = m * M
    bubble_over_ideal = (p - 1.0) / chunk_steps * bubble_share(plan.schedule)  # zero-bubble schedules: less
    stage_layers = (evaluate(x, (layers, layer_compute + layer_memory + layer_exposed)) + layers * delta + recompute
                    + act_copy) * inv_cp \
        + cp_ep
    bubble = bubble_over_ideal * (bm * stage_layers)
    if uneven:
        # Uneven stages: a micro-batch's forward + backward takes T_i on stage i (its layers, their recompute: the
        # first N of each of its m chunks, all of a shorter chunk; the last stage's also the LM head). The steady
        # state runs at the slowest stage, T* = max T_i, and the warm-up and cool-down slots are the other stages'
        # time, (sum T_i - T*)/m per sequence (with equal stages: (p - 1)/m stage times, as above).
        one_layer = evaluate(x, (1.0, layer_compute + layer_memory + layer_exposed)) + delta + act_copy / layers + budget

        def stage_time(n: Any) -> Any:  # with cp: 1/cp of the work, and the layers' share of the K/V and token sends
            cap = n / m
            work = n * one_layer + m * (minimum(pf.selective, cap) * lf.selective(x) + minimum(pf.full, cap) * forward)
            return work * inv_cp + cp_ep * (n / layers)

        first_n = as_time(plan.first_layers)
        middle_n = (model.num_layers - first_n - layers) / maximum(p - 2.0, 1.0)
        t_first, t_middle = stage_time(first_n), stage_time(middle_n)
        slowest = maximum(maximum(per_sequence, t_first), t_middle * as_time(p > 2))
        total = per_sequence + t_first + (p - 2.0) * t_middle
        ideal = select(split, bm * slowest, ideal)
        bubble = select(split, (b / m) * (total - slowest), bubble)

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
    p2p_per_sequence = (A * s * h * inv_cp) * (pf.inv_t * link_per_byte(gpu, tdp) + (1.0 - pf.sp) * x.ag)
    pp_comm = (1.0 - first) * (2.0 * b) * (chunk_steps + p - 1.0) * p2p_per_sequence

    # Data parallelism over d ranks t apart (NVLink while t*d fits a node). The stage's gradients
    # (training.grad_bytes each: fp32 main grads) are all-reduced without ZeRO, reduce-scattered
    # over the k ranks of a shard group with ZeRO >= 1 (Megatron-LM distributed optimizer; k = d
    # unless HSDP), then all-reduced (1/k of them) across the d/k replicas, followed for ZeRO 1-2
    # by an all-gather of the updated weights within the shard group. --overlap-grad-reduce hides
    # the reduction behind the last micro-batch's backward and --overlap-param-gather the
    # all-gather behind the next step's first forward, each but one per-layer bucket (overlapped).
    # With context parallelism the gradients are reduced, and the states sharded, over d x cp ranks (the routed
    # experts' over their expert-data-parallel group: counted here as the others'; memplan/memory/parallel.py).
    params = _stage_params(model, plan)
    inv_d, inv_k = 1.0 / (d * pf.cp), 1.0 / (pf.k * pf.cp)
    dp_per_byte = (1.0 - inv_d) * link_per_byte(gpu, td)
    shard_per_byte = (1.0 - inv_k) * link_per_byte(gpu, pf.t * pf.k * pf.cp)
    replica_per_byte = 2.0 * inv_k * (1.0 - pf.k * pf.cp * inv_d) * link_per_byte(gpu, td)
    # torchtitan's tensorwise float8 all-gathers the converted linears' weights at 1 byte each (titan_float8.py)
    f8_saved = (layers * pf.inv_t) * float(titan_float8.gathered_bytes_saved(model, training.float8,
                                                                             training.weight_bytes))
    weights_gather = (params * training.weight_bytes - f8_saved) * shard_per_byte
    grad_bytes = params * training.grad_bytes
    grad_reduce = (1.0 - pf.sharded) * (2.0 * grad_bytes * dp_per_byte) + pf.sharded * (
        grad_bytes * (shard_per_byte + replica_per_byte))
    param_gather = (pf.sharded - pf.zero3) * weights_gather
    forward_window = (b * layers) * forward * inv_cp
    backward_window = b * per_sequence - forward_window  # the rest of the last micro-batch
    inv_layers = p * (1.0 / model.num_layers)  # one bucket per layer
    if uneven:
        inv_layers = select(split, 1.0 / layers, inv_layers)
    # ZeRO-3 (Rajbhandari et al. 2020): every micro-batch gathers the stage's weights in its
    # forward and again in its backward, one layer ahead (DeepSpeed prefetch), so each pass
    # exposes what its compute cannot hide, and at least one layer's gather.
    gather_pass = pf.zero3 * weights_gather
    # The last micro-batch's backward hides its ZeRO-3 gathers and the gradient reduction on the
    # same links: the reduction hides only behind the compute the gathers leave (else a longer
    # backward, e.g. more recompute, would hide both at once and shorten the step).
    reduce_window = maximum(backward_window - gather_pass, 0.0 * backward_window)
    # torchtitan's FSDP2 reduce-scatters (HSDP: and all-reduces across the replicas) in every micro-batch's backward:
    # its train_step runs backward per micro-batch and leaves FSDP2's gradient sync on (torchtitan/trainer.py), each
    # hidden behind its own backward as the last one's is
    reductions = M if impl == "torchtitan" else 1.0
    dp_exposed = (reductions * overlapped(grad_reduce, reduce_window, inv_layers)
                  + overlapped(param_gather, forward_window, inv_layers))
    zero3_exposed = M * (overlapped(gather_pass, forward_window, inv_layers)
                         + overlapped(gather_pass, backward_window, inv_layers))

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
    # Optimizer offload (memplan/memory/offload.py): the GPU updates 1 - F of its shard; the offloaded F's gradients go to
    # the host and its parameters come back each step (stepped dtype, each way), exposed (Megatron-LM's default,
    # no --overlap-cpu-optimizer-d2h-h2d). The host's own optimizer step is not timed.
    fraction = training.offload_optimizer_fraction
    opt_copy = 0.0 * optimizer
    if fraction > 0:
        offloaded = (params * fraction) * (1.0 + pf.sharded * (inv_k - 1.0))
        opt_copy = offloaded * (2.0 * stepped_bytes(training) / host_bw)
        optimizer = optimizer * (1.0 - fraction)

    step = ideal + bubble + pp_comm + dp_exposed + zero3_exposed + optimizer + opt_copy
    sequences = as_time(global_batch)
    # MFU against the peak of the GEMMs' precision: the FP8 one with FP8 (memplan/inventory/fp8.py; torchtitan's
    # float8: titan_float8.py), else bf16
    fp8 = training.fp8 if training.fp8 is not None else training.float8
    peak_flops = gpu.peak_fp8_flops if fp8 is not None and gpu.peak_fp8_flops else gpu.peak_bf16_flops
    gpus_peak_step = tdp * (peak_flops * step)
    cal = calibration(model, gpu, impl, fp8)
    essentials = dict(model_flops=model_flops(model, global_batch, causal=True), bubble_over_ideal=bubble_over_ideal,
                      step_time_s=step, tokens_per_s=sequences * s / step,
                      mfu=(model_flops_per_sequence(model, causal=True) * sequences) / gpus_peak_step,
                      calibrated=cal.calibrated, uncertainty=cal.uncertainty)
    if not breakdown:
        return StepTime(**as_python({f.name: essentials.get(f.name) for f in fields(StepTime)}))
    hw_flops = hardware_flops(model, plan, global_batch, impl, training.memory_budget if training.compile else None)
    tp_comm = evaluate(x, (layers, lf.fwd_comm + lf.bwd_comm), (1.0, hf.head_comm), (first, emb_comm))
    return StepTime(**as_python(dict(
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
        dp_comm_s=reductions * grad_reduce + param_gather,
        dp_comm_exposed_s=dp_exposed,
        zero3_gather_s=(2.0 * M) * gather_pass,
        zero3_gather_exposed_s=zero3_exposed,
        optimizer_s=optimizer,
        host_copy_s=bm * act_copy * inv_cp + opt_copy,
        hfu=as_time(hw_flops) / gpus_peak_step,
        **essentials,
    )))
