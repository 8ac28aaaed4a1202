"""Communication time: the NCCL bus efficiency and the seconds per byte of a group's links (NVLink within a
node, the network beyond: link_per_byte), what a collective issued in per-layer buckets leaves exposed
(overlapped), the exposed fraction of the backward tensor-parallel collectives, and the context- and
expert-parallel exchanges of a stage (cp_ep_comm_s). The tensor-parallel collectives of a layer are in layer.py,
the pipeline and data-parallel traffic of a step in step.py."""

from __future__ import annotations

from typing import Any

from memplan.core.model import ModelSpec
from memplan.core.specs import GpuSpec
from memplan.timing.arrays import PlanFloats, as_time, maximum

# --- calibrated constants (see calibration.py's docstring) ------------------------------------
# Effective bus bandwidth of NCCL collectives and point-to-point sends as a fraction of the link
# rate: "450GB/s is the line rate. With the protocol overhead (~20%) NCCL can get an effective
# NVLink bandwidth of 370GB/s" (S. Jeaugey, NVIDIA/nccl-tests issue 212); 8 x A100 all_reduce
# busbw 232.5 of 300 GB/s and two DGX nodes 86 of 100 GB/s (NVIDIA/nccl-tests issue 175).
NCCL_BUS_EFFICIENCY = 0.80


# Exposed fraction of the backward TP collectives that Megatron-LM runs asynchronously next to an
# independent GEMM (the input-gradient all-reduce; with SP its reduce-scatter and the re-all-gather
# of the saved input), from K22 Table 4's baseline backward (calibration.py docstring, step 4).
TP_ASYNC_EXPOSED_FRACTION = 0.12


def link_per_byte(gpu: GpuSpec, span: Any) -> Any:
    """Seconds per byte on one GPU's link for a group spanning `span` consecutive ranks: NVLink
    within a node, the network beyond (one NIC per GPU, as on DGX A100 / H100)."""
    intra = 1.0 / (gpu.intra_node_bandwidth * NCCL_BUS_EFFICIENCY)
    inter = 1.0 / (gpu.inter_node_bandwidth * NCCL_BUS_EFFICIENCY)
    return inter + (intra - inter) * as_time(span <= gpu.gpus_per_node)


def overlapped(comm: Any, window: Any, inv_buckets: Any) -> Any:
    """Exposed part of a collective issued in per-layer buckets behind `window` seconds of
    compute: all but the last bucket hide (Megatron Bridge docs, Communication Overlap: "This
    overlap method exposes only one DP communication chunk")."""
    return maximum(comm - window, comm * inv_buckets)


def cp_ep_comm_s(model: ModelSpec, gpu: GpuSpec, pf: PlanFloats, A: int, layers: float, attention_s: float,
                  comm: str = "p2p") -> Any:
    """Seconds per sequence on one GPU of a stage's `layers` layers that context and expert parallelism add
    (memplan/memory/parallel.py), `attention_s` one layer's attention core forward for a whole sequence at t = 1.

    - cp, p2p: each ring step sends the rank's K/V chunk ((cp - 1) of them per layer in the forward; K/V and their
      gradients, twice that, in the backward) while the step's attention runs (Transformer Engine overlaps them on
      two streams): exposed is what the rank's attention compute, 1/cp of it (backward 2x), cannot hide.
    - cp, allgather (torchtitan, FlexAttention): K/V all-gathered before the attention in the forward (the ring's
      volume, (cp - 1)/cp of them received), their gradients reduce-scattered after it in the backward (as much);
      cplib::flex_cp_allgather waits at once: not overlapped (derived, uncalibrated).
    - cp, a2a: Q, K, V and the output (forward), their gradients (backward) are all-to-all'ed over cp, (cp - 1)/cp
      of each rank's share leaving it; not overlapped.
    - ep: the alltoall dispatcher's dispatch and combine, each k s b h / (t cp) routed tokens per GPU, in the forward
      and the backward, (ep - 1)/ep of them leaving the GPU, plus the all-gather / reduce-scatter over etp of
      (etp - 1) times them; per MoE layer, not overlapped. torchtitan (comm "allgather") gathers no routed tokens:
      at ep 1 its MoE's input all-gather and output reduce-scatter over tp are the dense layer's (timed with TP's),
      at ep > 1 etp is 1.
    The CP group spans t cp consecutive ranks, the expert group etp ep (Megatron-LM rank order tp-cp-ep-dp-pp)."""
    s, h, q = float(model.seq_length), float(model.hidden_size), float(model.q)
    kv = 2.0 * s * q * model.g / model.num_attention_heads  # K and V of one sequence, elements
    inv_cp = 1.0 / pf.cp
    per_cp_byte = link_per_byte(gpu, pf.t * pf.cp)
    if model.attention == "flash":
        ring_fwd = (A * kv * pf.inv_t) * (1.0 - inv_cp) * per_cp_byte
        att = attention_s * pf.inv_t * inv_cp
        ring = maximum(ring_fwd - att, 0.0 * ring_fwd) + maximum(2.0 * ring_fwd - 2.0 * att, 0.0 * ring_fwd)
        a2a = 2.0 * (A * (2.0 * s * q + kv) * pf.inv_t * inv_cp) * (1.0 - inv_cp) * per_cp_byte
        cp = layers * (ring if comm == "p2p" else 2.0 * ring_fwd if comm == "allgather" else a2a)
    else:
        cp = 0.0 * pf.cp
    moe = 0.0 * pf.ep
    if model.is_moe:
        tokens = (model.moe_top_k or 1) * s * pf.inv_t * inv_cp * (A * h)  # bytes of a GPU's routed tokens
        a2a_ep = 4.0 * tokens * (1.0 - 1.0 / pf.ep) * link_per_byte(gpu, pf.etp * pf.ep)
        gather = 4.0 * tokens * (pf.etp - 1.0) * link_per_byte(gpu, pf.etp) * (comm != "allgather")
        moe = (layers * model.moe_layers / model.num_layers) * (a2a_ep + gather)
    return cp + moe
