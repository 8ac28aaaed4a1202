"""Offload to host memory: what leaves the GPU, what the host then holds, and what the copies cost.

Optimizer offload (`--offload optimizer`, TrainingSpec.offload_optimizer_fraction F) follows Megatron-LM's
HybridDeviceOptimizer (megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py at tag core_v0.16.1, commit
55ac7082; line numbers below are that file's unless named):

- it walks the GPU's parameters (with the distributed optimizer: this rank's shard of each, distrib_optimizer.py:
  367-369, 441-444) in order and moves them to the host until F of their elements are there (:255-276): a pinned
  clone of each (:274), turned fp32 (:277-279; param_update_in_fp32, which megatron/core/optimizer/__init__.py:344
  sets): the host master copy. The CPU AdamW (torch.optim.AdamW, fused, __init__.py:10, 319-329) keeps its two fp32
  moments beside it. The GPU keeps the 16-bit weights, the gradient buffer (the fp32 main gradients,
  distrib_optimizer.py:2411-2417) and the master copy and moments of the other 1 - F (a GPU Adam, :211-212, 277-279):
  of memplan's optimizer bytes (master + moments) F move to the host, the rest stay.
- every step copies the offloaded gradients into pinned host buffers of the master's dtype (:108-114, allocated once;
  pin_cpu_grads defaults to True, optimizer_config.py:322) and, after the CPU step, the updated parameters back into
  the 16-bit GPU weights (:119-125). torch's copy_ with a dtype change and non_blocking=True converts on the GPU: the
  fp32 values first land in a GPU temporary of the source dtype (aten/src/ATen/native/cuda/Copy.cu copy_kernel_cuda:
  `conversion_device = non_blocking ? kCUDA : kCPU`), one tensor at a time: an fp32 temporary as large as the largest
  offloaded tensor (its shard), beside the step's other temporaries.
- the 16-bit pinned clone (:274) is dropped once its fp32 copy exists, but PyTorch's pinned-memory cache keeps the
  block (aten/src/ATen/core/CachingHostAllocator.h: freed blocks go back to its free lists, reused for requests of
  their power-of-two size class only): memplan counts it as host memory, with the pinned gradient buffers ("pinned
  staging"). Their power-of-two rounding is not counted (the shards' sizes depend on the bucket layout): up to 2x of
  the staging.
- the copies run on the current stream unless --overlap-cpu-optimizer-d2h-h2d (default False, optimizer_config.py:313;
  :217-221), and the CPU step waits for the gradients (:171-173): exposed. The CPU optimizer's own compute time is not
  modelled.

With bf16-mixed, per offloaded parameter: host 4 (master) + 8 (moments) + 4 (pinned fp32 gradient) + 2 (cached 16-bit
clone) = 18 B, 12 B less on the GPU, 4 + 4 = 8 B over PCIe each step.

Activation offload (`--offload activations`) is torch.autograd.graph.save_on_cpu(pin_memory=True) (torch 2.13,
torch/autograd/graph.py:400-420) around the decoder layers:

- pack (:403-414): every tensor an op saves is copied into a new pinned host tensor when it is saved
  (`packed.copy_(tensor, non_blocking=True)` on the current stream): the layer's saved activations, the weights its
  matmuls and norms save (a parameter is a saved tensor like any other: measured on CPU, the packs of the reference
  layer are its saved activations plus its weight matrices and norm parameters, not the linear biases, which no op
  saves; tests/test_offload.py), and a tensor several layers save (the causal mask, the rope tables) once per save.
  The GPU tensor is freed when nothing else holds it.
- unpack (:416-418): `tensor.to(device, non_blocking=True)` when the backward node that saved it runs, on that
  stream; the GPU copy lives while the node runs. No prefetch, both copies on the compute stream: exposed.
- the pinned host tensors come from PyTorch's CachingHostAllocator, which rounds each request up to a power of two
  (CachingHostAllocator.h:300-308; pinned_max_round_threshold is unlimited by default, c10/core/AllocatorConfig.h)
  and keeps freed blocks for reuse.

So of the decoder layers' saved tensors the GPU holds: none of the other layers' or the other micro-batches'; in the
forward, the current layer's until they are packed (memplan counts the whole layer: an upper bound); in a layer's
backward, that layer's (memplan counts every saved tensor of the layer the moment has not freed, an upper bound on the
one node's tensors unpack brings back), one copy of the tensors the layers share and the largest unpacked weight.
Derived from torch's code, not measured on a GPU: on a CPU-only machine the copies are CPU to CPU and the "device"
cannot be told from the host. What is measured (on CPU) is which tensors save_on_cpu packs and their bytes.

torchtune's activation offloading (`--impl torchtune --recompute full --offload activations`: its recipes'
enable_activation_offloading, which they allow only with enable_activation_checkpointing) is OffloadActivations
(torchtune/training/_activation_offloading.py, torchtune 0.6.1), a saved_tensors_hooks around the model's forward
(not the loss), defaults use_pin_memory, use_streams, max_fwd_stash_size 5, min_offload_size 1024 B:

- pack: a saved tensor of at least 1,024 B that is not a Parameter is copied to a new pinned host tensor on a side
  stream; the rest stay as they are. With every layer checkpointed, the checkpoints save their inputs through these
  hooks (torch/utils/checkpoint.py `save_inputs`, before its own hooks) and the recomputation's saves do not go
  through them: what is packed is the token ids (int64), each layer's input (bf16 s b h) and the final norm's
  saves (its fp32 input twice, rstd twice, the normalised fp32 input once: F.rms_norm's composite ops); the output
  projection runs under NoOpManager (nothing packed) and the loss outside. Measured on CPU with use_streams=False
  (validation/tune_offload.py): which tensors are packed, offloaded and kept, and their bytes.
- the GPU keeps each offloaded tensor in a forward stash until a later pack of id 5 more (ids count every pack):
  in the forward, the inputs of the last min(j, 5) layers; the final norm's packs empty the stash of layer inputs
  before the loss (its own tensors stay: the stash or the norm hold them until its backward), but for the last
  layer's with LoRA (its frozen scale: one pack fewer that offloads). Measured with its stream code on CPU, the
  streams stubbed (validation/tune_offload.py tune_offload_stash).
- unpack (streams): the checkpoint's input comes back to the GPU when its layer's backward starts and is freed once
  the next layer's first node has run: in layer j's backward, layer j + 1's input too (memplan counts it for the
  whole of layer j's backward: an upper bound). The token ids stay on the GPU (the batch holds them).
- host: the packed tensors of one micro-batch, each a pinned block rounded to a power of two (as save_on_cpu's).
The copies run on the side stream, overlapped with compute: no time is added (derived, not measured on a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from memplan.core.model import ModelSpec
from memplan.core.training import Recompute, TrainingSpec
from memplan.inventory.assemble import training_inventory
from memplan.memory.parallel import state_shard
from memplan.memory.shapes import weight_shapes
from memplan.memory.term_bytes import term_bytes_for

MICRO = 1_000_000
# parameter groups no op saves (a bias add's backward needs no tensor): states.param_groups' names
UNSAVED_GROUPS = ("column-parallel biases (QKV, MLP input)", "row-parallel biases (output projection, MLP output)")


def share(n: Any, fraction: float) -> Any:
    """ceil(n x fraction) in integers (the fraction to 1e-6): the part of n that is offloaded."""
    micro = round(fraction * MICRO)
    return -(-(n * micro) // MICRO)


def pow2ceil(n: Any) -> Any:
    """The power of two at or above n (0 stays 0), as PyTorch's pinned-memory allocator rounds a request:
    Python ints, or int64 numpy arrays (exact below 2^53 bytes)."""
    if isinstance(n, int) or not hasattr(n, "shape"):
        n = int(n)
        return 0 if n <= 0 else 1 << (n - 1).bit_length()
    import numpy as np

    x = np.asarray(n, dtype=np.int64)
    mant, exp = np.frexp(x.astype(np.float64))
    up = np.where(mant == 0.5, exp - 1, exp)
    return np.where(x > 0, np.left_shift(np.int64(1), np.maximum(up, 0).astype(np.int64)), 0)


def offloads(training: TrainingSpec) -> bool:
    return training.offload_optimizer_fraction > 0 or training.offload_activations


# --- optimizer offload ----------------------------------------------------------------------------
def stepped_bytes(training: TrainingSpec) -> int:
    """Bytes of a stepped parameter: the master copy's, else the weights' (the host copy's dtype, and so that of
    its pinned gradient buffer and of the copy back)."""
    return training.master_weight_bytes or training.weight_bytes


def split_optimizer(training: TrainingSpec, optimizer_bytes: Any) -> tuple[Any, Any]:
    """(on the GPU, on the host) of one GPU's master weights + optimizer states."""
    host = share(optimizer_bytes, training.offload_optimizer_fraction)
    return optimizer_bytes - host, host


def shard_params(params: Any, shard: Any, zero: Any) -> Any:
    """The parameters whose optimizer states a GPU holds: its shard with ZeRO >= 1."""
    on = zero >= 1
    return on * (-(-params // shard)) + (1 - on) * params


def offloaded_params(training: TrainingSpec, params: Any, shard: Any, zero: Any, trained: Any = None) -> Any:
    """Parameters one GPU steps on the host, of its `params` (`trained`: of those, the ones the optimizer steps,
    StageMemory.trained_params; LoRA's adapters are not counted here)."""
    stepped = params if trained is None or training.lora_rank else trained
    return share(shard_params(stepped, shard, zero), training.offload_optimizer_fraction)


def optimizer_staging_bytes(training: TrainingSpec, offloaded: Any) -> Any:
    """Pinned host memory beside the offloaded states: the gradient buffers (stepped dtype) and the cached 16-bit
    clones (module docstring)."""
    return offloaded * (stepped_bytes(training) + training.weight_bytes)


def optimizer_copy_bytes(training: TrainingSpec, offloaded: Any) -> Any:
    """Bytes one GPU copies over PCIe each step: the gradients to the host, the parameters back (stepped dtype)."""
    return 2 * stepped_bytes(training) * offloaded


def conversion_temp_bytes(training: TrainingSpec, largest: Any, offloaded: Any) -> Any:
    """The GPU temporary of the copy back when the host dtype differs from the weights' (Copy.cu): the largest
    offloaded tensor in the stepped dtype, at most what is offloaded."""
    p = stepped_bytes(training)
    if p == training.weight_bytes:
        return 0 * offloaded
    n = largest - (largest - offloaded) * (largest > offloaded)
    return p * n


# --- activation offload ---------------------------------------------------------------------------
def saved_weight_shapes(model: ModelSpec, layout: str) -> tuple:
    """The parameter tensors of one decoder layer its ops save (so save_on_cpu packs): all but the linear biases."""
    return tuple(w for w in weight_shapes(model, layout)["layer"] if w.group not in UNSAVED_GROUPS)


def layer_weight_bytes(model: ModelSpec, training: TrainingSpec, values: dict, layout: str,
                       rounded: bool = True) -> tuple[Any, Any]:
    """(bytes packed, largest tensor) of the weights one decoder layer saves on one GPU (`values`: the symbols);
    `rounded`: each pinned tensor rounded up to a power of two."""
    total: Any = 0
    largest: Any = 0
    for w in saved_weight_shapes(model, layout):
        n = w.on_gpu(values, True).numel * training.weight_bytes
        total = total + (pow2ceil(n) if rounded else n)
        largest = largest + (n - largest) * (n > largest)
    return total, largest


# --- torchtune's OffloadActivations ---------------------------------------------------------------
TUNE_STASH = 5  # max_fwd_stash_size: packs of the last 5 ids stay on the GPU
TUNE_MIN_BYTES = 1024  # min_offload_size
# what it packs outside the layers (term id, packs of it): the tokens, the final norm's composite ops
TUNE_PACKED = (("token_ids", 1), ("final_norm_fp32_input", 2), ("final_norm_rstd", 2), ("final_norm_normed", 1))


def tune_loss_stash(terms: Any) -> int:
    """Layer inputs still in OffloadActivations' forward stash at the loss: the final norm packs its fp32 input,
    rstd twice, its fp32 input again, the scale (a parameter: no stash cleanup) and, unless the scale is frozen
    (LoRA), its normalised input. A pack of id t drops ids <= t - 5: the normalised input (6th) drops every layer
    input, the fp32 input (4th) all but the last layer's (measured: validation/tune_offload.py tune_offload_stash)."""
    last = 6 if any(t.id == "final_norm_normed" for t in terms) else 4
    return max(0, TUNE_STASH - last)


def tune_host_bytes(terms: Any, sizes: Any, layers: Any, rounded: bool = True) -> Any:
    """Host bytes torchtune's OffloadActivations holds for one micro-batch: the packs of at least TUNE_MIN_BYTES,
    each its own host tensor (a pinned block, a power of two, unless `rounded` is False), of `layers` layer inputs
    and of the tensors TUNE_PACKED names that the inventory saves (`sizes`: a term's bytes; with LoRA the frozen
    embedding's token ids and the final norm's normalised input are not saved: memplan/inventory/lora.py)."""
    by_id = {t.id: t for t in terms}
    total: Any = 0
    for tid, packs in (("layer_input", layers), *TUNE_PACKED):
        if tid not in by_id:
            continue
        n = sizes(by_id[tid])
        total = total + packs * (n >= TUNE_MIN_BYTES) * (pow2ceil(n) if rounded else n)
    return total


@dataclass(frozen=True)
class HostBytes:
    """Host memory one GPU's offload takes (scalars or arrays)."""

    optimizer: Any = 0  # master weights + moments stepped on the host
    staging: Any = 0  # pinned gradient buffers + cached 16-bit clones (optimizer offload)
    activations: Any = 0  # packed saved tensors of the decoder layers (pinned, power-of-two blocks)
    weights: Any = 0  # the layers' weights packed with them (pinned, power-of-two blocks)

    @property
    def total(self) -> Any:
        return self.optimizer + self.staging + self.activations + self.weights


def activation_host_bytes(model: ModelSpec, terms: Any, training: TrainingSpec, plan: Any, stage_mem: Any,
                          layout: str = "fused", rounded: bool = True) -> tuple[Any, Any]:
    """(saved activations, weights) save_on_cpu packs on one GPU of a stage at its peak: every copy of the decoder
    layers' saved terms the stage holds (the in-flight chunks' layers), the shared (chunk) terms once per layer
    that saves them, and each layer copy's saved weights; each pinned tensor rounded to a power of two unless
    `rounded` is False (what the packs themselves hold: the measured figure)."""
    sizes = term_bytes_for(model, plan, training.activation_bytes)  # the tensors' own sizes (no GPU blocks)
    n = stage_mem.layers // plan.m  # layers of one of the stage's chunks
    act: Any = 0
    layer_copies: Any = 0
    for t in terms:
        if t.scope not in ("layer", "chunk"):
            continue
        unit = stage_mem.unit_bytes[t.id]
        copies = stage_mem.term_bytes[t.id] // (unit + (unit == 0)) * (unit > 0)
        if t.scope == "chunk":
            copies = copies * n  # one pack per layer that saves it
        elif t.kept(Recompute.NONE) and not t.only_full:
            layer_copies = layer_copies + (copies - layer_copies) * (copies > layer_copies)
        one = sizes(t)
        if rounded:
            each = -(-one // t.storages)
            one = t.storages * pow2ceil(each)
        act = act + one * copies
    per_layer, _ = layer_weight_bytes(model, training, model.symbols(t=plan.t), layout, rounded)
    return act, per_layer * layer_copies


def host_bytes(model: ModelSpec, terms: Any, training: TrainingSpec, plan: Any, stage_mem: Any,
               layout: str = "fused") -> HostBytes:
    """Host memory one GPU of a stage takes for its offload (optimizer states and staging; activations)."""
    act = weights = 0
    if training.activation_offloader == "torchtune":
        act = tune_host_bytes(terms, term_bytes_for(model, plan, training.activation_bytes), stage_mem.layers)
    elif training.offload_activations:
        act, weights = activation_host_bytes(model, terms, training, plan, stage_mem, layout)
    staging: Any = 0
    if training.offload_optimizer_fraction > 0:
        staging = optimizer_staging_bytes(training, offloaded_params(training, stage_mem.params,
                                                                     state_shard(plan), plan.zero,
                                                                     stage_mem.trained_params))
    return HostBytes(stage_mem.host_optimizer, staging, act, weights)


def gpus_on_node(gpus: Any, gpus_per_node: int) -> Any:
    """GPUs of the job on one node: a node's worth, or all of them when the job is smaller."""
    return gpus - (gpus - gpus_per_node) * (gpus > gpus_per_node)


def per_node(host_per_gpu: Any, gpus: Any, gpus_per_node: Optional[int]) -> Any:
    """Host memory of a node: its GPUs' offload (the most loaded GPU's figure for each: a node holds GPUs of one or
    a few stages; rank order tp-dp-pp puts a stage's t x d GPUs together)."""
    return host_per_gpu * gpus_on_node(gpus, gpus_per_node or 8)


def layer_copy_bytes(model: ModelSpec, training: TrainingSpec, plan: Any, impl: str = "megatron",
                     device: str = "cuda") -> Any:
    """Bytes save_on_cpu packs for one decoder layer and one micro-batch on one GPU (its saved tensors, the shared
    ones once more, its saved weights; no rounding: what the copies move), each way over PCIe."""
    inventory = training_inventory(model, impl, device, training)
    sizes = term_bytes_for(model, plan, training.activation_bytes)
    total: Any = 0
    for t in inventory.terms:
        if t.scope in ("layer", "chunk"):
            total = total + sizes(t) * t.kept(Recompute.NONE)
    weights, _ = layer_weight_bytes(model, training, model.symbols(t=plan.t), inventory.weight_layout, rounded=False)
    return total + weights


def notes(training: TrainingSpec, impl: str) -> list[str]:
    """What a report says about the offload it models, and where the figures come from."""
    out = []
    fraction = training.offload_optimizer_fraction
    if fraction > 0:
        out.append(f"optimizer offload: {fraction:.0%} of the master weights and moments are stepped in host memory "
                   "(Megatron-LM's HybridDeviceOptimizer, derived from its code, not measured): their gradients go to "
                   "pinned host buffers and the weights come back every step over PCIe, exposed; the host's optimizer "
                   "step itself is not timed")
    if training.activation_offloader == "torchtune":
        out.append("activation offload: torchtune's OffloadActivations with every layer checkpointed (torchtune "
                   "0.6.1): what it packs and its forward stash measured on CPU with its own code (streams stubbed); "
                   "the layer inputs, token ids and final norm's tensors go to pinned host memory on a side stream; "
                   "derived from its code: two layer inputs in a layer's backward, no time added (copies overlapped)")
    elif training.offload_activations:
        out.append("activation offload: torch.autograd.graph.save_on_cpu(pin_memory=True) around the decoder layers, "
                   "derived from torch/autograd/graph.py:400-420 (torch 2.13), not measured on a GPU: every saved "
                   "tensor, weights included, is copied to pinned host memory (power-of-two blocks) when saved and "
                   "back when its backward runs, on the compute stream (exposed)")
        if impl == "megatron":
            out.append("Megatron-LM's own layer offloading (--cpu-offloading-num-layers, Transformer Engine's offload "
                       "synchronizer) is not what memplan models: it copies on a side stream, a layer ahead, and "
                       "skips weights and tensors under 1 MB; memplan's figures are torch's save_on_cpu")
    return out
