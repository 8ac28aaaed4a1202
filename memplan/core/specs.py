"""The parallel plan (`ParallelSpec`), the GPU (`GpuSpec`, `RuntimeBytes`) and `Config`, where the four specs a
memory estimate is made of (model: memplan/core/model.py, training: memplan/core/training.py) meet.

All are frozen pydantic models that reject unknown keys. Checks that involve a
single spec live on it; checks across specs (a % t, L % (p m), ...) live on
`Config`, the only place where the four meet. Symbols follow K22 Table 1.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Optional

from pydantic import ConfigDict, Field, field_validator, model_validator

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.core.spec_base import Spec, echo
from memplan.core.training import Recompute, TrainingSpec
from memplan.core.units import parse_size


class ParallelSpec(Spec):
    """How the model is split over GPUs (K22 Table 1: t, p, d, m)."""

    tp: int = Field(default=1, gt=0, description="t, tensor-parallel size")
    pp: int = Field(default=1, gt=0, description="p, pipeline-parallel size")
    dp: int = Field(default=1, gt=0, description="d, data-parallel size")
    vpp: int = Field(default=1, gt=0, description="m, interleaved (virtual) stages per pipeline rank")
    sp: bool = Field(default=False, description="sequence parallelism (needs t > 1)")
    zero: int = Field(
        default=0,
        ge=0,
        le=3,
        description="0: none; 1: optimizer states sharded over d (Megatron-LM distributed optimizer, "
        "ZeRO-1); 2: also gradients; 3: also weights",
    )
    first_stage_layers: Optional[int] = Field(
        default=None, gt=0, description="transformer layers on the first pipeline stage (Megatron-LM "
        "--decoder-first-pipeline-num-layers); default: the even split L/p, or with last_stage_layers alone the "
        "rest split evenly")
    last_stage_layers: Optional[int] = Field(
        default=None, gt=0, description="transformer layers on the last pipeline stage (Megatron-LM "
        "--decoder-last-pipeline-num-layers)")
    pp_schedule: Literal["1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                         "DualPipeV"] = Field(
        default="1F1B", description="the pipeline schedule: 1F1B (Megatron-LM's, torch's Schedule1F1B) or GPipe "
        "(torch's ScheduleGPipe, torchtitan's pipeline_parallel_schedule: every forward, then every backward; "
        "memplan/memory/pipeline.py); torchtitan's multi-stage ones with vpp stages per rank split by torchtitan "
        "(memplan/memory/pipeline_multi.py)")
    zero_shard: Optional[int] = Field(
        default=None,
        gt=1,
        description="data-parallel ranks the ZeRO states are split over (default d); d / zero_shard "
        "replicas of each shard (HSDP: torchtitan dp_shard, Megatron-LM "
        "--num-distributed-optimizer-instances d/zero_shard)",
    )

    cp: int = Field(default=1, gt=0, description="context-parallel size: each sequence split over cp ranks "
                    "(Megatron-LM --context-parallel-size; memplan/memory/parallel.py)")
    cp_comm_type: Literal["p2p", "a2a", "allgather"] = Field(
        default="p2p", description="how context-parallel attention exchanges keys / values: p2p (ring attention, "
        "Transformer Engine AttnFuncWithCPAndKVP2P) or a2a (Ulysses: heads all-to-all, AttnFuncWithCPAndQKVOA2A), "
        "Megatron-LM --cp-comm-type; allgather: torchtitan's (FlexAttention's K and V all-gathered over cp, their "
        "gradients reduce-scattered; set by --impl torchtitan)")
    ep: int = Field(default=1, gt=0, description="expert-parallel size: each MoE layer's routed experts split over "
                    "ep ranks (Megatron-LM --expert-model-parallel-size)")
    etp: Optional[int] = Field(default=None, gt=0, description="expert tensor-parallel size: each routed expert's "
                               "MLP split over etp ranks (default t; Megatron-LM --expert-tensor-parallel-size)")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def expert_tp(self) -> int:
        """etp, the routed experts' tensor-parallel size (t unless set, as Megatron-LM's arguments.py defaults it)."""
        return self.etp if self.etp is not None else self.tp

    @property
    def edp(self) -> int:
        """The expert-data-parallel size: Megatron-LM folds the t x cp x d ranks of a pipeline stage into
        etp x ep x edp for the experts (megatron/core/parallel_state.py initialize_model_parallel:
        expert_data_parallel_size = world_size // (etp * ep * pp))."""
        return self.tp * self.cp * self.dp // (self.expert_tp * self.ep)

    @property
    def shard(self) -> int:
        """Ranks the sharded states are split over (d unless zero_shard says fewer)."""
        return self.zero_shard if self.zero_shard is not None else self.dp

    @model_validator(mode="after")
    def _own(self) -> "ParallelSpec":
        if self.sp and self.tp == 1:
            raise ValueError("sequence parallelism needs tensor parallelism (t > 1)")
        if self.vpp > 1 and self.pp == 1:
            raise ValueError("interleaved stages (vpp > 1) need pipeline parallelism (p > 1)")
        if (self.first_stage_layers is not None or self.last_stage_layers is not None) and self.pp == 1:
            raise ValueError("first / last stage layers (an uneven pipeline split) need pipeline parallelism (p > 1)")
        if self.zero_shard is not None:
            if self.zero == 0 and self.zero_shard != self.dp:  # d itself: the effective value plan summaries give
                raise ValueError("zero_shard needs ZeRO stage 1-3 (sharded states)")
            if self.dp % self.zero_shard:
                raise ValueError(f"zero_shard={self.zero_shard} does not divide the data-parallel size d={self.dp}")
        folded = self.tp * self.cp * self.dp
        if folded % (self.expert_tp * self.ep):
            raise ValueError(f"ep*etp = {self.ep}*{self.expert_tp} does not divide t*cp*d = {self.tp}*{self.cp}*{self.dp}"
                             f" = {folded}: Megatron-LM folds a stage's t x cp x d ranks into etp x ep x expert-data-"
                             "parallel ranks (megatron/core/parallel_state.py)")
        if self.zero_shard is not None and self.ep * self.expert_tp > 1 and self.edp % (self.dp // self.zero_shard):
            raise ValueError(f"the {self.dp // self.zero_shard} distributed-optimizer instances (d/zero_shard) do not "
                             f"divide the expert-data-parallel size {self.edp} (megatron/core/parallel_state.py)")
        return self


def _sized(value: Any) -> Any:
    """A byte size in a YAML file: a number with its unit ('80GB', '81559MiB'); a bare number is
    refused, as on the command line, because 80 could mean bytes, GB or GiB."""
    if isinstance(value, str):
        try:
            return parse_size(value)
        except MemplanError as err:
            raise ValueError(str(err)) from None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        raise ValueError(f"give a size with its unit, e.g. 80GB (10^9 bytes) or 80GiB (2^30 bytes) (got {echo(value)})")
    return value


class RuntimeBytes(Spec):
    """Device memory outside PyTorch's caching allocator for one training process (CUDA context,
    kernel images; for megatron-core also the communicator of one NCCL group)."""

    torch: int = Field(default=0, ge=0, description="a plain PyTorch process (transformers, the reference loop)")
    megatron: int = Field(default=0, ge=0, description="a megatron-core process with one NCCL group")

    @field_validator("torch", "megatron", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        return _sized(value)

    def get(self, framework: str) -> int:
        return getattr(self, framework)


STEP_MATMUL_THREADS = 2  # the threads a training step runs matmuls on (GpuSpec.step_workspace_bytes)


class GpuSpec(Spec):
    """An accelerator's data-sheet figures (per GPU)."""

    # lax: YAML 1.1 reads 312.0e12 as a string; sizes and rates are parsed with their units above
    model_config = ConfigDict(frozen=True, extra="forbid", strict=False)

    name: str
    memory_bytes: int = Field(gt=0)
    peak_bf16_flops: float = Field(gt=0, description="dense bf16 FLOP/s")
    matmul_efficiency: float = Field(gt=0, le=1, description="achieved fraction of peak in large GEMMs")
    memory_bound_efficiency: float = Field(gt=0, le=1, description="achieved fraction of HBM bandwidth in "
                                           "elementwise kernels")
    attention_matmul_efficiency: float = Field(gt=0, le=1, description="achieved fraction of peak in the "
                                               "unfused QK^T and attention-over-V batched matmuls")
    matmul_overhead_s: float = Field(default=0.0, ge=0, description="fixed seconds per GEMM kernel on top of "
                                     "its FLOPs at matmul_efficiency (last partial wave of tiles, prologue)")
    calibration: str = Field(default="", description="the measurements the efficiencies above were fitted to; "
                             "empty: assumed, not measured on this GPU")
    calibrated_impls: tuple[str, ...] = Field(default=(), description="implementations (memplan impls) whose "
                                              "kernels those measurements ran")
    step_time_uncertainty: float = Field(default=0.0, ge=0, description="relative spread of a calibrated step "
                                         "time against published measurements")
    memory_bandwidth: float = Field(gt=0, description="HBM bytes/s")
    gpus_per_node: int = Field(default=8, gt=0)
    intra_node_bandwidth: float = Field(gt=0, description="bytes/s per GPU per direction (NVLink)")
    inter_node_bandwidth: float = Field(gt=0, description="bytes/s per GPU per direction (network)")
    peak_fp8_flops: Optional[float] = Field(
        default=None, gt=0, description="dense FP8 FLOP/s (tensor cores, no sparsity); None: the GPU has no FP8 "
        "tensor cores (FP8 training is refused)")
    host_bandwidth: Optional[float] = Field(
        default=None, gt=0, description="bytes/s per GPU per direction between pinned host memory and the GPU "
        "(PCIe copies: offload); None: not known, offloaded copies cannot be timed")
    runtime_bytes: RuntimeBytes = Field(
        default_factory=lambda: RuntimeBytes(),
        description="device memory a training process uses outside PyTorch's caching allocator, by framework")
    nccl_communicator_bytes: int = Field(default=0, ge=0, description="each further NCCL communicator")
    workspace_bytes: int = Field(default=0, ge=0, description="cuBLAS workspace of one thread's handle, allocated "
                                 "inside PyTorch's pool (part of torch.cuda.max_memory_allocated)")
    fragmentation_margin: float = Field(
        default=0.0, ge=0, le=1, description="caching-allocator reserve above the allocated peak, as a fraction")
    total_memory_bytes: Optional[int] = Field(
        default=None, gt=0, description="torch.cuda.get_device_properties(0).total_memory: what one process can have "
        "(less than nvidia-smi's total); None: not measured, memory_bytes is taken")
    source: str = ""

    @property
    def step_workspace_bytes(self) -> int:
        """The cuBLAS workspaces a training step keeps in PyTorch's pool: cuBLAS keeps one per (thread, stream)
        handle, and a step runs matmuls on two threads, the forward's and autograd's device thread's backward
        (recorded on an H100, torch 2.11: two 32 MiB blocks, made at the first forward and the first backward
        matmul, never freed; tests/data/alloc/cuda)."""
        return STEP_MATMUL_THREADS * self.workspace_bytes

    @field_validator("memory_bytes", "nccl_communicator_bytes", "workspace_bytes", "total_memory_bytes",
                     mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        return _sized(value)

    @field_validator("*", mode="after")
    @classmethod
    def _finite(cls, value: Any) -> Any:
        """Lax mode reads the text "nan" or "inf" as a float: refused, like every figure that is not finite."""
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"expected a finite number (got {value})")
        return value

    @property
    def process_memory_bytes(self) -> int:
        """The memory one process can have: the default budget (CUDA's total_memory where measured)."""
        return self.total_memory_bytes if self.total_memory_bytes is not None else self.memory_bytes

    @field_validator("memory_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth", "host_bandwidth",
                     mode="before")
    @classmethod
    def _rate(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().endswith("/s"):
            return float(_sized(value.strip()[:-2]))
        return value


class Config(Spec):
    """A model, a parallel plan and training settings: everything an estimate needs."""

    model: ModelSpec
    parallel: ParallelSpec = ParallelSpec()
    training: TrainingSpec = TrainingSpec()

    @property
    def uneven(self) -> bool:
        """An uneven pipeline split (first / last stage layers given)."""
        par = self.parallel
        return par.first_stage_layers is not None or par.last_stage_layers is not None

    @property
    def split(self) -> tuple[int, int, int]:
        """Transformer layers on the first, on each middle and on the last pipeline stage (Megatron-LM
        get_num_layers_to_build): L/p each when even; a stage whose count is not given shares the rest evenly
        with the middle ones. Only meaningful once `_across` has checked it."""
        par, L = self.parallel, self.model.num_layers
        p = par.pp
        if not self.uneven:
            return (L // p,) * 3
        first, last = par.first_stage_layers, par.last_stage_layers
        rest, left = L - (first or 0) - (last or 0), p - (first is not None) - (last is not None)
        even = rest // left if left > 0 else 0
        first = first if first is not None else even
        last = last if last is not None else even
        return first, (L - first - last) // (p - 2) if p > 2 else 0, last

    def stage_layers(self, stage: int) -> int:
        """Transformer layers on pipeline stage `stage`."""
        first, middle, last = self.split
        return first if stage == 0 else last if stage == self.parallel.pp - 1 else middle

    @property
    def layers_per_chunk(self) -> int:
        """Layers in one model chunk: L / (p m); with uneven stages the largest chunk (a stage's layers / m)."""
        if not self.uneven:
            return self.model.num_layers // (self.parallel.pp * self.parallel.vpp)
        return max(n for n in self.split if n) // self.parallel.vpp

    @property
    def global_batch(self) -> int:
        t = self.training
        return t.global_batch if t.global_batch is not None else t.micro_batch * self.parallel.dp

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per step on each data-parallel rank."""
        return self.global_batch // (self.training.micro_batch * self.parallel.dp)

    def plan_summary(self) -> dict[str, Any]:
        """The plan in one flat schema, shared by search rows and estimate's JSON (`plan`), with
        effective values: the ZeRO shard group (d unless HSDP) and the layers per model chunk the
        recompute mode applies to (all of them unless --recompute-num-layers says fewer; None unless full recompute,
        and the first / last stage layers None unless the split is uneven, so that the summary given back to
        `estimate` is the same plan)."""
        par, tr = self.parallel, self.training
        layers = tr.recompute_num_layers if tr.recompute_num_layers is not None else self.layers_per_chunk
        layers = layers if tr.recompute == Recompute.FULL else None
        return dict(tp=par.tp, pp=par.pp, dp=par.dp, vpp=par.vpp, sp=par.sp, cp=par.cp, cp_comm_type=par.cp_comm_type,
                    ep=par.ep, etp=par.expert_tp, zero=par.zero, zero_shard=par.shard,
                    micro_batch=tr.micro_batch, recompute=tr.recompute.label, recompute_num_layers=layers,
                    num_microbatches=self.num_microbatches, global_batch=self.global_batch,
                    global_batch_tokens=self.global_batch * self.model.seq_length, gpus=par.gpus,
                    first_stage_layers=self.split[0] if self.uneven else None,
                    last_stage_layers=self.split[2] if self.uneven else None)

    def _check_split(self) -> None:
        """Megatron-LM's rules for uneven stages (megatron/core/transformer/transformer_config.py, the
        "Uneven PP" checks of TransformerConfig.__post_init__): the layers left for the middle stages
        split evenly over them (none left when there are none), and with interleaving every stage's layers
        divide by m."""
        par, L = self.parallel, self.model.num_layers
        given = (par.first_stage_layers or 0) + (par.last_stage_layers or 0)
        left = par.pp - (par.first_stage_layers is not None) - (par.last_stage_layers is not None)
        rest = L - given
        if rest < 0 or bool(rest) != bool(left):
            raise ValueError(f"first / last stage layers ({par.first_stage_layers}, {par.last_stage_layers}) leave "
                             f"{rest} of L={L} layers for the {left} other stage(s) of p={par.pp}: each stage needs "
                             "layers, and every layer a stage")
        if left and rest % left:
            raise ValueError(f"the {rest} layers left by the first / last stage layers do not split evenly over the "
                             f"{left} other stage(s) of p={par.pp}")
        for name, n in zip(("first", "middle", "last"), self.split):
            if n and n % par.vpp:
                raise ValueError(f"the {n} layers of the {name} stage(s) are not divisible by m={par.vpp} "
                                 "interleaved chunks")

    @model_validator(mode="after")
    def _across(self) -> "Config":
        m, par, tr = self.model, self.parallel, self.training
        a, g, t, L = m.num_attention_heads, m.g, par.tp, m.num_layers
        if a % t:
            raise ValueError(f"tensor-parallel size t={t} does not divide the attention heads a={a}")
        if g % t:
            raise ValueError(f"tensor-parallel size t={t} does not divide the key/value heads {g}")
        if self.uneven:
            self._check_split()
        elif L % (par.pp * par.vpp) and par.pp_schedule in ("1F1B", "GPipe"):  # torchtitan splits the others
            raise ValueError(
                f"layers L={L} are not divisible by p*m = {par.pp}*{par.vpp}: every model chunk needs whole layers"
                + (" (an uneven split, --first-stage-layers / --last-stage-layers, may fit them)"
                   if par.vpp == 1 else ""))
        first_chunk = self.split[0] // par.vpp  # torchtitan's multi-stage schedules: counted chunk by chunk instead
        if m.moe_first_dense_layers > first_chunk and par.pp_schedule in ("1F1B", "GPipe"):
            raise ValueError(f"moe_first_dense_layers={m.moe_first_dense_layers} exceed the {first_chunk} "
                             f"layers of the first model chunk (L/(p m)): memplan places the dense layers on the first "
                             "pipeline stage")
        if tr.mst != 1 and (tr.recompute != Recompute.FULL or tr.recompute_num_layers not in (None, L)):
            raise ValueError("MsT runs with gradient checkpointing of every layer (mini-s' minisequence turns it "
                             "on): add --recompute full (without --recompute-num-layers)")
        if tr.optimizer_in_backward and self.num_microbatches > 1:
            raise ValueError("the optimizer step in the backward steps every micro-batch: it needs one micro-batch "
                             "per step (global batch = micro-batch x data-parallel)")
        if m.seq_length % tr.loss_chunks:
            raise ValueError(f"loss chunks {tr.loss_chunks} do not divide the sequence length s={m.seq_length}")
        if par.sp and m.seq_length % t:
            raise ValueError(f"sequence parallelism needs t={t} to divide the sequence length s={m.seq_length}")
        _check_cp_ep(m, par)
        if (par.ep > 1 or par.expert_tp != t) and not expert_parallel_modelled(tr):
            raise ValueError(EXPERT_PARALLEL_RULE + f" (got {tr.optimizer}"
                             f"{', offload' if tr.offload_optimizer_fraction else ''})")
        gb, b, d = self.global_batch, tr.micro_batch, par.dp
        if gb % (b * d):
            raise ValueError(f"global batch {gb} is not divisible by micro-batch * data-parallel = {b}*{d}")
        if tr.recompute_num_layers is not None:
            if tr.recompute != Recompute.FULL:
                raise ValueError("recompute_num_layers only applies to full recompute")
            if tr.recompute_num_layers > self.layers_per_chunk:
                raise ValueError(
                    f"recompute_num_layers={tr.recompute_num_layers} exceeds the {self.layers_per_chunk} "
                    "layers of a model chunk"
                )
        n = tr.offload_activation_layers
        if n is not None and (par.pp > 1 or n != m.num_layers - 1):
            raise ValueError(f"--cpu-offloading-num-layers {n}: modelled for N = L - 1 = {m.num_layers - 1} without "
                             "pipeline parallelism only (Transformer Engine then keeps one layer's activations on the "
                             "GPU, as memplan's --offload activations does; memplan/memory/offload.py)")
        return self


EXPERT_PARALLEL_RULE = ("expert parallelism is modelled with the optimizers whose states are per-parameter copies "
                        "(adamw, sgd, lion) and without optimizer offload")


def expert_parallel_modelled(tr: TrainingSpec) -> bool:
    """Whether expert parallelism (ep > 1, or an expert tensor-parallel size other than t) is modelled with these
    training settings (EXPERT_PARALLEL_RULE): the plan check refuses it otherwise, and `search` leaves it out."""
    return tr.optimizer in ("adamw", "sgd", "sgd-nomomentum", "lion") and not tr.offload_optimizer_fraction


def _check_cp_ep(m: ModelSpec, par: ParallelSpec) -> None:
    """Context and expert parallelism as Megatron-LM / Transformer Engine accept them (memplan/memory/parallel.py)."""
    s, t, cp = m.seq_length, par.tp, par.cp
    if cp > 1:
        if s % (2 * cp):
            raise ValueError(f"context parallelism needs 2*cp = {2 * cp} to divide the sequence length s={s} (the causal "
                             "load-balanced layout: 2 cp chunks; Megatron-LM arguments.py)")
        if par.sp and (s // cp) % t:
            raise ValueError(f"sequence parallelism needs t={t} to divide a context-parallel rank's s/cp = {s // cp} "
                             "tokens")
        if m.attention == "eager":
            raise ValueError("context parallelism needs flash attention (--attention flash): Transformer Engine's "
                             "unfused attention does not support it (dot_product_attention/utils.py "
                             "get_attention_backend)")
        if par.cp_comm_type == "a2a" and ((m.num_attention_heads // t) % cp or (m.g // t) % cp):
            raise ValueError(f"--cp-comm-type a2a needs cp={cp} to divide each tensor-parallel rank's query heads "
                             f"a/t = {m.num_attention_heads // t} and key/value heads g/t = {m.g // t} "
                             "(Transformer Engine AttnFuncWithCPAndQKVOA2A)")
    if (par.ep > 1 or par.etp not in (None, t)) and not m.is_moe:  # etp = t: the effective value summaries give
        raise ValueError("expert parallelism (--ep / --etp) needs a mixture-of-experts model (num_experts)")
    if m.is_moe:
        if m.num_experts % par.ep:
            raise ValueError(f"expert-parallel size ep={par.ep} does not divide the experts E={m.num_experts} "
                             "(Megatron-LM arguments.py)")
        if m.moe_expert_loads is not None and len(m.moe_expert_loads) != m.num_experts // par.ep:
            raise ValueError(f"moe_expert_loads gives {len(m.moe_expert_loads)} loads: it takes the busiest GPU's "
                             f"E/ep = {m.num_experts // par.ep} experts' (ep={par.ep})")
        if m.fe % par.expert_tp:
            raise ValueError(f"expert tensor-parallel size etp={par.expert_tp} does not divide the expert MLP width "
                             f"f_e={m.fe}")
        if m.moe_token_dispatcher == "flex" and par.ep * par.expert_tp == 1:
            raise ValueError("the flex dispatcher needs etp x ep > 1 GPUs to exchange tokens between "
                             "(megatron-core 0.16.1 MoEFlexTokenDispatcher)")
        if t > 1 and not par.sp:
            raise ValueError("a mixture-of-experts model with tensor parallelism needs sequence parallelism (--sp): "
                             "Megatron-LM's MoELayer refuses to train without it (moe_layer.py)")


def check_gpus(gpus: int) -> None:
    """A GPU count must be positive (the divisibility checks live with the plan)."""
    if gpus <= 0:
        raise MemplanError(f"GPU count must be positive (got {gpus})")
