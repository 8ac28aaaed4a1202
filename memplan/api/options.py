"""The options every plan call shares (the CLI's plan options, as keyword arguments with its defaults), and what
they make: the model preset, the checked config, the GPU, the training settings a search keeps, the notes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any, Optional, Union

from pydantic import ValidationError

from memplan.api.values import Size, bounded_count, budget_bytes, expert_loads, finite, mst_pieces, mtp_layers, token_count
from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.core.spec_base import describe_validation_error, echo
from memplan.core.training import FUSIONS
from memplan.core.specs import Config, GpuSpec
from memplan.inventory.fp8 import check_fp8
from memplan.inventory.titan import checkpointed_layers, titan_ac_mode, titan_model
from memplan.inventory.titan_async_tp import check_async_tp
from memplan.inventory.titan_float8 import check_float8
from memplan.inventory.titan_moe import check_titan_moe, moe_etp
from memplan.inventory.traced_file import check_traced_file
from memplan.inventory.types import HF_IMPLS
from memplan.memory.pipeline import titan_split, titan_stage_layers, titan_stages_per_rank
from memplan.memory.pipeline_multi import MULTI_SCHEDULES, is_multi, multi_refusal, schedule_refusal
from memplan.memory.reserved import Replay
from memplan.presets.batch import batch_note, make_config
from memplan.presets.catalog import load_gpu, load_model
from memplan.presets.files import ModelPreset
from memplan.presets.hf_config import read_hf_config

ASSUMED_GPU = "a100-80gb"  # the GPU a plan is timed on and fitted to when neither --gpu nor the preset names one
# Megatron-LM --transformer-impl (TransformerConfig.transformer_impl, default transformer_engine) -> memplan's --impl
TRANSFORMER_IMPLS = {"transformer_engine": "megatron", "local": "megatron-local"}


# torchtitan's --ac modes (memplan/inventory/titan.py AC_MODES, LAYER_AC) as memplan's recompute modes; selective-layer[:N]
# (titan.py checkpointed_layers) is full recompute of the layers it checkpoints
# budget: nothing checkpointed; the compiled blocks keep the partitioner's saved set at the budget (compiled.py)
TITAN_AC = {"none": "none", "full": "full", "selective-op": "selective", "selective-layer": "full", "budget": "none"}


@dataclass
class PlanOptions:
    """The plan options of `memplan estimate / search / explain` (--tp -> tp, --seq-len -> seq_len, --mem -> mem,
    --gpu -> gpu, --host-mem -> host_mem, --offload optimizer -> offload=("optimizer",)); None = the preset's or
    memplan's default. Sizes take ints in bytes or text ("80GB", "80GiB"); global_batch_tokens an int or "4M"."""

    model: Optional[str] = None
    hf_config: Optional[str] = None
    inventory: Optional[str] = None  # a traced inventory file (memplan trace --out) for --impl hf-*
    attention: Optional[str] = None
    tp: Optional[int] = None
    pp: Optional[int] = None
    dp: Optional[int] = None
    vpp: Optional[int] = None
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None
    pipeline_schedule: Optional[str] = None  # torchtitan's pipeline_parallel_schedule (memplan/memory/pipeline.py)
    pipeline_layers_per_stage: Optional[int] = None  # torchtitan's pipeline_parallel_layers_per_stage (multi-stage)
    mtp: Optional[int] = None  # torchtitan DeepSeek-V3's num_mtp_layers (memplan/inventory/titan_mtp.py)
    sp: Optional[bool] = None
    cp: Optional[int] = None
    cp_comm_type: Optional[str] = None
    ep: Optional[int] = None
    etp: Optional[int] = None
    moe_imbalance: Optional[float] = None
    moe_expert_loads: Optional[tuple[float, ...]] = None
    moe_capacity_factor: Optional[float] = None
    moe_pad_to_capacity: Optional[bool] = None
    moe_token_dispatcher: Optional[str] = None
    moe_aux_loss_coeff: Optional[float] = None
    moe_z_loss_coeff: Optional[float] = None
    moe_router_dtype: Optional[str] = None
    moe_router_pre_softmax: Optional[bool] = None
    megatron_core_version: Optional[str] = None
    moe_grouped_gemm: Optional[bool] = None
    moe_permute_fusion: Optional[bool] = None
    moe_shared_expert_overlap: Optional[bool] = None
    recompute: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    recompute_modules: Union[str, tuple[str, ...], list[str], None] = None  # names, or one comma / space separated string
    recompute_method: Optional[str] = None
    ac: Optional[str] = None  # torchtitan's activation checkpointing: none | full | selective-op | selective-layer[:N]
    dp_replicate: Optional[int] = None  # torchtitan's HSDP: replicas of each shard group (--impl torchtitan)
    micro_batch: Optional[int] = None
    global_batch: Optional[int] = None
    global_batch_tokens: Union[int, str, None] = None
    seq_len: Optional[int] = None
    gpus: Optional[int] = None
    zero: Optional[int] = None
    zero_shard: Optional[int] = None
    distributed_optimizer: Optional[bool] = None
    fsdp2: Optional[bool] = None  # the HF Trainer / accelerate stacks (memplan/memory/dp_stack.py)
    deepspeed_zero: Optional[int] = None
    impl: str = "megatron"
    precision: Optional[str] = None
    optimizer: Optional[str] = None
    optimizer_impl: Optional[str] = None
    loss_chunks: Optional[int] = None
    fp8: Optional[str] = None
    fp8_format: Optional[str] = None
    fp8_amax_history_len: Optional[int] = None
    fp8_param_gather: Optional[bool] = None
    float8: Optional[str] = None  # torchtitan's torchao float8 linears: tensorwise | rowwise (--impl torchtitan)
    mst: Union[int, str, None] = None
    optimizer_in_backward: Optional[bool] = None
    compile: Optional[bool] = None
    async_tp: Optional[bool] = None  # torchtitan's compile.enable_async_tensor_parallel (inventory/titan_async_tp.py)
    lora: Optional[int] = None
    lora_targets: Optional[str] = None
    lora_dropout: Optional[float] = None
    qlora: Optional[bool] = None
    dora: Optional[bool] = None
    liger: Optional[bool] = None
    batch_layout: Optional[str] = None
    checkpoint_reentrant: Optional[bool] = None
    offload: tuple[str, ...] = ()
    offload_fraction: Optional[float] = None
    host_mem: Size = None
    frag_margin: Optional[float] = None
    allocator: str = "default"
    alloc_conf: Optional[str] = None
    first_step_seq_len: Optional[int] = None
    gpu: Optional[str] = None
    mem: Size = None
    # whose kernels and which Megatron-LM fusions (memplan/inventory/fusions.py): Megatron-LM's names and defaults
    device: Optional[str] = None
    transformer_impl: Optional[str] = None
    no_masked_softmax_fusion: Optional[bool] = None
    no_bias_gelu_fusion: Optional[bool] = None
    no_bias_swiglu_fusion: Optional[bool] = None
    no_bias_dropout_fusion: Optional[bool] = None
    no_rope_fusion: Optional[bool] = None
    no_gradient_accumulation_fusion: Optional[bool] = None
    cross_entropy_loss_fusion: Optional[bool] = None
    cross_entropy_fusion_impl: Optional[str] = None
    memory_efficient_layer_norm: Optional[bool] = None
    # Megatron-LM's activation offloading (memplan/memory/offload.py): the layer offloading it maps onto, the
    # fine-grained one it refuses
    cpu_offloading_num_layers: Optional[int] = None
    fine_grained_activation_offloading: Optional[bool] = None
    offload_modules: Optional[str] = None

    def replay(self) -> Replay:
        """How the run is replayed through the caching allocator: the allocator, its settings, the run's history."""
        return Replay(self.allocator, self.alloc_conf, self.first_step_seq_len)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "Optional[int]" and value is not None and (type(value) is bool or not isinstance(value, int)):
                raise MemplanError(f"{f.name}: an integer, not {type(value).__name__} {echo(str(value))}")
            setattr(self, f.name, finite(bounded_count(value, f.name), f.name))
        self.mem = budget_bytes(self.mem, "mem")
        self.host_mem = budget_bytes(self.host_mem, "host_mem")
        self.global_batch_tokens = token_count(self.global_batch_tokens)
        if self.first_step_seq_len is not None and self.first_step_seq_len < 1:
            raise MemplanError(f"first_step_seq_len {self.first_step_seq_len}: at least 1 token")
        self.mst = mst_pieces(self.mst)
        self.offload = (self.offload,) if isinstance(self.offload, str) else tuple(self.offload or ())
        if self.transformer_impl is not None:
            impl = TRANSFORMER_IMPLS.get(self.transformer_impl)
            if impl is None:
                raise MemplanError(f"unknown --transformer-impl {echo(self.transformer_impl)}; known: "
                                   f"{', '.join(TRANSFORMER_IMPLS)}")
            if self.impl not in ("megatron", impl):
                raise MemplanError(f"--transformer-impl {self.transformer_impl} is --impl {impl}; it conflicts with "
                                   f"--impl {self.impl}")
            self.impl = impl
        if self.fine_grained_activation_offloading or self.offload_modules:
            raise MemplanError("Megatron-LM's fine-grained activation offloading (--fine-grained-activation-offloading "
                               "--offload-modules: chosen modules' inputs) is not modelled; memplan models layer "
                               "offloading (--offload activations, --cpu-offloading-num-layers L-1)")
        if self.cpu_offloading_num_layers is not None and not self.impl.startswith("megatron"):
            raise MemplanError(f"--cpu-offloading-num-layers is Megatron-LM's (--impl megatron*); for --impl "
                               f"{self.impl} use --offload activations (torch's save_on_cpu)")
        if self.device == "cpu" and self.impl == "megatron":
            raise MemplanError("Transformer Engine (--impl megatron, --transformer-impl transformer_engine) runs on "
                               "CUDA only: --device cpu takes --impl megatron-local (--transformer-impl local)")

    @property
    def cross_entropy_fusion(self) -> Optional[str]:
        """Megatron-LM's fused cross-entropy (--cross-entropy-loss-fusion, --cross-entropy-fusion-impl native|te;
        memplan/inventory/fusions.py): None when off."""
        if self.cross_entropy_fusion_impl not in (None, "native", "te"):
            raise MemplanError(f"unknown --cross-entropy-fusion-impl {echo(self.cross_entropy_fusion_impl)}; known: "
                               "native, te")
        if not self.cross_entropy_loss_fusion:
            if self.cross_entropy_fusion_impl is not None:
                raise MemplanError("--cross-entropy-fusion-impl needs --cross-entropy-loss-fusion (Megatron-LM "
                                   "ignores it without)")
            return None
        return self.cross_entropy_fusion_impl or "native"

    @property
    def fusions_off(self) -> tuple[str, ...]:
        """The Megatron-LM fusions switched off (memplan/core/training.py FUSIONS): the --no-<name>-fusion options."""
        return tuple(name for name in FUSIONS if getattr(self, f"no_{name.replace('-', '_')}_fusion"))

    @classmethod
    def split(cls, kwargs: dict[str, Any]) -> tuple["PlanOptions", dict[str, Any]]:
        """The plan options among keyword arguments, and the rest (the call's own)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in kwargs.items() if k in names}), {k: v for k, v in kwargs.items()
                                                                        if k not in names}

    @property
    def zero_stage(self) -> Optional[int]:
        """--zero, with --distributed-optimizer as stage 1 (no conflict check: `config` makes it)."""
        return self.stack_zero(1 if self.distributed_optimizer else self.zero)[0]

    def cp_ep(self, moe: bool = False) -> dict[str, Any]:
        """The context- and expert-parallel options as ParallelSpec fields (torchtitan's MoE: its etp, `moe_etp`)."""
        if self.cp_comm_type == "allgather":
            raise MemplanError("cp_comm_type 'allgather' is torchtitan's and set by --impl torchtitan: give p2p or a2a")
        titan = self.impl == "torchtitan"  # comm: titan_recompute checks; ep: torchtitan's default 1 (as its tp, pp)
        comm, ep = ("allgather", self.ep or 1) if titan else (self.cp_comm_type, self.ep)  # not the preset's ep
        return dict(cp=self.cp, cp_comm_type=comm, ep=ep, etp=moe_etp(ep or 1, self.tp or 1) if moe and titan else self.etp)

    def moe_routing(self) -> dict[str, Any]:
        """The MoE routing and router options as ModelSpec fields (memplan/inventory/moe.py)."""
        return dict(moe_imbalance=self.moe_imbalance, moe_expert_loads=expert_loads(self.moe_expert_loads),
                    moe_capacity_factor=self.moe_capacity_factor, moe_pad_to_capacity=self.moe_pad_to_capacity,
                    moe_token_dispatcher=self.moe_token_dispatcher,
                    moe_aux_loss_coeff=self.moe_aux_loss_coeff, moe_z_loss_coeff=self.moe_z_loss_coeff,
                    moe_router_dtype=self.moe_router_dtype, moe_router_pre_softmax=self.moe_router_pre_softmax,
                    megatron_core_version=self.megatron_core_version, moe_grouped_gemm=self.moe_grouped_gemm,
                    moe_permute_fusion=self.moe_permute_fusion, moe_shared_expert_overlap=self.moe_shared_expert_overlap)

    def preset(self) -> Optional[ModelPreset]:
        """The model the options name: model (preset or YAML) or hf_config; None if neither."""
        if self.model and self.hf_config:
            raise MemplanError("give --model or --hf-config, not both")
        preset = read_hf_config(self.hf_config) if self.hf_config else load_model(self.model) if self.model else None
        if self.inventory is None:
            return preset
        if preset is None:
            raise MemplanError("--inventory is the traced inventory of one model: give --model or --hf-config")
        if self.impl not in HF_IMPLS or self.impl == "torchtune":
            raise MemplanError(f"--inventory is a traced inventory of transformers' code: plan with --impl hf-sdpa or "
                               f"hf-eager (got --impl {self.impl})")
        check_traced_file(self.inventory, self.impl, preset.model.num_layers)
        return dataclasses.replace(preset, model=preset.model.model_copy(update={"inventory": self.inventory}))

    def training_settings(self) -> dict[str, Any]:
        """Training settings that are not searched: precision, the optimizer and its implementation, loss chunks,
        FP8, MsT, LoRA / QLoRA, offload, selective recompute's modules."""
        fraction = self.offload_fraction
        if fraction is not None and "optimizer" not in self.offload:
            raise MemplanError("--offload-fraction needs --offload optimizer")
        if self.fp8 is None and any((self.fp8_format, self.fp8_amax_history_len, self.fp8_param_gather)):
            raise MemplanError("--fp8-format, --fp8-amax-history-len and --fp8-param-gather need --fp8 RECIPE")
        if self.fp8 is not None:
            check_fp8(self.fp8, self.impl)
        check_float8(self.float8, self.impl)
        if not self.lora and (self.lora_targets or self.lora_dropout or self.qlora or self.dora):
            raise MemplanError("--lora-targets, --lora-dropout, --qlora and --dora need --lora R (the adapters' rank)")
        targets = tuple(t.strip() for t in self.lora_targets.split(",") if t.strip()) if self.lora_targets else None
        return dict(dp_stack=self.stack_zero(self.zero)[1], lora_rank=self.lora, lora_targets=targets, lora_dropout=self.lora_dropout, qlora=self.qlora,
                    lora_dora=self.dora,
                    lora_impl="torchtune" if self.impl == "torchtune" else "peft",
                    liger=self.liger, batch_layout=self.batch_layout, compile=bool(self.compile), async_tp=bool(self.async_tp),
                    memory_budget=self.memory_budget(),
                    checkpoint_reentrant=self.checkpoint_reentrant,
                    precision=self.precision, optimizer=self.optimizer, optimizer_impl=self.optimizer_impl,
                    loss_chunks=self.loss_chunks, fp8=self.fp8, float8=self.float8, fp8_format=self.fp8_format,
                    fp8_amax_history_len=self.fp8_amax_history_len, fp8_param_gather=self.fp8_param_gather,
                    mst=self.mst, optimizer_in_backward=self.optimizer_in_backward,
                    offload_optimizer_fraction=(1.0 if fraction is None else fraction)
                    if "optimizer" in self.offload else None,
                    offload_activations=True if "activations" in self.offload or self.cpu_offloading_num_layers
                    else None, offload_activation_layers=self.cpu_offloading_num_layers,
                    activation_offloader="torchtune" if self.impl == "torchtune" and "activations" in self.offload
                    else "save_on_cpu",
                    **({} if self.recompute_modules is None else dict(recompute_modules=self.recompute_modules)),
                    device=self.device, fusions_off=self.fusions_off or None,
                    cross_entropy_fusion=self.cross_entropy_fusion,
                    memory_efficient_layer_norm=self.memory_efficient_layer_norm)

    def stack_zero(self, zero: Optional[int]) -> tuple[Optional[int], Optional[str]]:
        """The ZeRO stage and data-parallel stack of --fsdp2 (ZeRO 3) / --deepspeed-zero N (memplan/memory/dp_stack.py),
        which run the HF Trainer's model: --impl hf-sdpa / hf-eager."""
        if self.impl == "torchtitan":  # torchtitan's FSDP2 over every data-parallel rank (dp_shard)
            if self.fsdp2 or self.deepspeed_zero is not None or zero not in (None, 3):
                raise MemplanError("--impl torchtitan shards with its own FSDP2 (ZeRO 3 over --gpus): drop --fsdp2, "
                                   "--deepspeed-zero, --zero, --distributed-optimizer")
            return 3, "torchtitan"
        if not self.fsdp2 and self.deepspeed_zero is None:
            return zero, None
        if self.fsdp2 and self.deepspeed_zero is not None:
            raise MemplanError("--fsdp2 and --deepspeed-zero are two data-parallel stacks: give one")
        name, stage = ("--fsdp2", 3) if self.fsdp2 else (f"--deepspeed-zero {self.deepspeed_zero}", self.deepspeed_zero)
        if stage not in (1, 2, 3):
            raise MemplanError(f"--deepspeed-zero takes 1, 2 or 3, not {echo(stage)}")
        tune = self.impl == "torchtune" and self.fsdp2  # torchtune's distributed recipes: training.shard_model
        if not self.impl.startswith("hf-") and not tune:
            raise MemplanError(f"{name} runs the HF Trainer's transformers model: plan it with --impl hf-sdpa or "
                               f"hf-eager" + (" (--fsdp2 also torchtune's distributed recipes: --impl torchtune)"
                                              if self.fsdp2 else "") + f" (got --impl {self.impl})")
        if zero not in (None, stage):
            raise MemplanError(f"{name} is ZeRO stage {stage}; it conflicts with --zero {zero}"
                               + (" (--distributed-optimizer)" if self.distributed_optimizer else ""))
        return stage, "torchtune" if tune else "fsdp2" if self.fsdp2 else "deepspeed"

    def titan_recompute(self) -> Optional[str]:
        """--ac as memplan's recompute (none, full, selective-op = selective, selective-layer[:N] = full of the layers
        it checkpoints: memplan/inventory/titan.py), and what --impl torchtitan does not model refused; None for other
        implementations (torchtitan's own options refused: estimate's and search's one check)."""
        if self.impl != "torchtitan":
            if self.ac is not None or self.dp_replicate is not None:
                raise MemplanError("--ac and --dp-replicate are torchtitan's activation checkpointing and HSDP: give "
                                   "--impl torchtitan (elsewhere --recompute, --zero-shard)")
            if self.pipeline_schedule not in (None, "1F1B") or self.pipeline_layers_per_stage:
                raise MemplanError("--pipeline-schedule other than 1F1B and --pipeline-layers-per-stage are "
                                   "torchtitan's (--impl torchtitan); Megatron-LM interleaves with --vpp")
            return None
        mode = titan_ac_mode(self.ac)[0]
        if self.vpp not in (None, 1):
            raise MemplanError("--vpp is Megatron-LM's: torchtitan's stages a rank come with --pipeline-schedule")
        if self.cp_comm_type is not None:
            raise MemplanError("--impl torchtitan: --cp-comm-type is Megatron-LM's; torchtitan's context parallelism "
                               "all-gathers K and V (FlexAttention, its Llama 3 default): drop --cp-comm-type")
        if self.sp is False and self.tp not in (None, 1):
            raise MemplanError("--impl torchtitan: TP without sequence parallelism (enable_sequence_parallel = False) "
                               "is not modelled: drop --no-sp")
        if self.compile and self.cp not in (None, 1):
            raise MemplanError("--impl torchtitan: --compile with --cp is not modelled yet (the partitioner is traced "
                               "on the unsharded block and under TP)")
        if self.compile and self.float8 and self.tp not in (None, 1) and mode != "full":
            raise MemplanError("--impl torchtitan: --compile --float8 with --tp is modelled under --ac full only: with "
                               "the blocks' tensors kept, the partitioner saves float8 casts of the weights and inputs "
                               "per TP rank (measured: validation/titan_tp_compile.py), not modelled yet")
        if self.compile and self.tp not in (None, 1) and mode == "budget":
            raise MemplanError("--impl torchtitan: --ac budget:F with --tp is not traced (the partitioner's knapsack "
                               "under TP): --ac none, full or selective-op")
        if self.recompute is not None or self.recompute_num_layers is not None or self.recompute_modules:
            raise MemplanError("--impl torchtitan takes --ac none|full|selective-op|selective-layer[:N], not "
                               "--recompute*")
        if self.fp8 is not None or self.lora or self.mst or self.loss_chunks not in (None, 1):
            raise MemplanError("--impl torchtitan: --fp8 (Transformer Engine; torchtitan's float8 is --float8), LoRA, "
                               "MsT and loss chunks are not modelled yet")
        return TITAN_AC[mode]

    def memory_budget(self) -> Optional[float]:
        """--ac budget:F's F (torchtitan's MemoryBudgetAC; it needs --compile), else None."""
        mode, tenths = titan_ac_mode(self.ac) if self.impl == "torchtitan" else ("none", 0)
        return tenths / 10 if mode == "budget" else None  # refused without --compile: compiled.check_budget

    def titan_pipeline(self, preset: ModelPreset, search: bool = False) -> dict:
        """--pp, --vpp, --pipeline-schedule as ParallelSpec fields; torchtitan: its split (pipeline.py titan_split, as
        search) as first / last stage layers, or for a multi-stage schedule its stages a rank (titan_stages_per_rank)
        as vpp. `search`: a schedule without --pp pins the pipelined plans searched."""
        schedule = self.pipeline_schedule or "1F1B"
        if self.impl != "torchtitan":  # its options refused by titan_recompute
            return dict(vpp=self.vpp, first_stage_layers=self.first_stage_layers,
                        last_stage_layers=self.last_stage_layers)
        p, multi = self.pp or 1, is_multi(schedule)
        if self.pipeline_layers_per_stage is not None and not multi:
            raise MemplanError("--pipeline-layers-per-stage applies to torchtitan's multi-stage schedules "
                               f"({', '.join(MULTI_SCHEDULES)})")
        if p == 1:
            if multi and not (search and self.pp is None):  # search: the schedule pins the pp > 1 plans it tries
                raise MemplanError(f"--pipeline-schedule {schedule} needs pipeline parallelism: --pp 2 or more")
            return dict(pp_schedule=schedule)
        if self.first_stage_layers is not None or self.last_stage_layers is not None:
            raise MemplanError("--impl torchtitan splits the stages itself (the embedding and the output each count "
                               "as a layer): drop --first-stage-layers / --last-stage-layers")
        if self.float8 is not None:
            raise MemplanError("--impl torchtitan: --float8 with --pp is not modelled yet")
        L, dense = preset.model.num_layers, preset.model.moe_first_dense_layers
        try:
            if not multi:
                first, last = titan_split(p, L, dense)
                return dict(pp_schedule=schedule, first_stage_layers=first, last_stage_layers=last)
            m = titan_stages_per_rank(p, L, self.pipeline_layers_per_stage)
            titan_stage_layers(p * m, L)
        except ValueError as e:
            raise MemplanError(str(e)) from None
        if why := multi_refusal(p, m, None, schedule, bool(self.compile), preset.model.is_moe):
            raise MemplanError(why)
        return dict(pp_schedule=schedule, vpp=m)

    def titan_layers(self, preset: ModelPreset) -> dict:
        """--ac selective-layer:N as the number of layers fully recomputed (torchtitan checkpoints every N-th)."""
        mode, every = titan_ac_mode(self.ac)
        if self.impl != "torchtitan" or mode != "selective-layer":
            return {}
        layers = preset.model.num_layers
        if (self.pp or 1) > 1:  # torchtitan counts every N-th layer of each stage's own layers: not modelled
            raise MemplanError("--ac selective-layer with --pp is not modelled yet: use --ac full, selective-op or none")
        if every > layers:
            raise MemplanError(f"--ac selective-layer:{every} checkpoints no layer of {layers}: use --ac none")
        return dict(recompute_num_layers=len(checkpointed_layers(layers, every)))

    def titan_shard(self, dp: int) -> Optional[int]:
        """--dp-replicate R (torchtitan's HSDP, data_parallel_replicate_degree; torchtitan's parallelize_llama
        gives fully_shard the 2-D mesh (dp_replicate, fsdp): FSDP2 replicates over the first dimension, shards over
        the second) as the ranks each shard group spans: d / R (memplan's zero_shard); None for R = 1."""
        r = self.dp_replicate
        if self.zero_shard is not None:
            raise MemplanError("--impl torchtitan: give --dp-replicate R (HSDP), not --zero-shard")
        if not isinstance(r, int) or isinstance(r, bool) or r < 1 or dp % r or (r > 1 and dp // r < 2):
            raise MemplanError(f"--dp-replicate {echo(r)} must divide the data-parallel size {dp} and leave 2 or more "
                               "ranks per shard group")
        return None if r == 1 else dp // r

    def config(self) -> tuple[ModelPreset, Config]:
        """The preset and the checked config of one plan."""
        preset = self.preset()
        if preset is None:
            raise MemplanError("--model is required (a preset name or a YAML file; see `memplan models`), "
                               "or --hf-config config.json")
        zero, mtp = self.zero, mtp_layers(self.mtp, self.impl)
        recompute = self.titan_recompute()
        check_async_tp(bool(self.async_tp), self.impl, bool(self.compile), self.tp or 1)
        titan = self.impl == "torchtitan"  # FSDP2 x TP (titan_recompute refuses the rest)
        if titan:  # the layouts it models; MoE: FSDP2 / HSDP, --ep, --pp (inventory/titan_moe.py)
            preset = dataclasses.replace(preset, model=titan_model(preset.model, mtp))  # checked
            check_titan_moe(preset.model, self.ep or 1, self.etp, self.tp or 1, self.cp or 1, self.pp or 1, bool(self.compile),
                            self.float8, self.dp_replicate or 1, any(v is not None for v in self.moe_routing().values()),
                            self.gpus or 0)
        # --recompute-num-layers alone is full recompute of that many layers, as `search` pins it (fixed_from)
        recompute = ("full" if self.recompute is None and self.recompute_num_layers is not None else self.recompute
                     if recompute is None else recompute)
        if self.distributed_optimizer:
            if zero not in (None, 1):
                raise MemplanError("--distributed-optimizer is ZeRO stage 1; it conflicts with --zero " + str(zero))
            zero = 1
        zero = self.stack_zero(zero)[0]
        if zero is None and self.impl in HF_IMPLS:
            # a torch .grad loop (transformers, torchtune) keeps every optimizer state on every data-parallel rank
            # (DDP, a single device) unless a ZeRO stack is named: the preset's `zero` is Megatron-LM's
            # distributed optimizer, not theirs
            zero = 0

        def build(zero_shard: Optional[int]) -> Config:
            return make_config(
                preset,
                parallel=dict(tp=(self.tp or 1) if titan else self.tp, pp=(self.pp or 1) if titan else self.pp, dp=self.dp,
                              sp=True if titan and self.tp not in (None, 1) else self.sp, zero=zero, zero_shard=zero_shard, **self.cp_ep(preset.model.is_moe),
                              **self.titan_pipeline(preset)),
                training=dict(micro_batch=self.micro_batch, global_batch=self.global_batch, recompute=recompute,
                              **({"recompute_num_layers": self.recompute_num_layers} | self.titan_layers(preset)),
                              # Megatron-LM's --recompute-method of one plan (TrainingSpec checks it; search chooses its own)
                              **({} if self.recompute_method is None else dict(recompute_method=self.recompute_method)),
                              **self.training_settings()),
                model=dict(seq_length=self.seq_len, attention=self.attention, **self.moe_routing()),
                gpus=self.gpus,
                whole_model_per_rank=self.impl.startswith("hf-"),
                global_batch_tokens=self.global_batch_tokens,
            )

        config = build(self.zero_shard)
        if titan and self.dp_replicate is not None:  # HSDP: the shard groups span d / R ranks (the d of the plan)
            config = build(self.titan_shard(config.parallel.dp))
        par = config.parallel
        if titan and (why := schedule_refusal(par.pp, par.vpp, config.num_microbatches, par.pp_schedule)):
            raise MemplanError(why)
        return preset, config

    def gpu_spec(self, preset: Optional[ModelPreset]) -> Optional[GpuSpec]:
        """The GPU: the gpu option, else the preset's own; None if neither names one."""
        name = self.gpu or (preset.gpu if preset is not None else None)
        return load_gpu(name) if name else None

    def search_gpu(self, preset: ModelPreset) -> tuple[GpuSpec, list[str]]:
        """The GPU a search times a model on (and whose device model, allocator margin and runtime, decides its
        fit): the gpu option, else the preset's own, else the A100 (with a note). `estimate` with a budget and
        no GPU assumes the same one."""
        gpu = self.gpu_spec(preset)
        if gpu is not None:
            return gpu, []
        gpu = load_gpu(ASSUMED_GPU)
        return gpu, [f"{preset.model.name} names no GPU: timed on {gpu.name} (--gpu NAME sets one)"]

    def assumed_gpu(self, preset: ModelPreset) -> Optional[str]:
        """Why the GPU is assumed (`search_gpu` falls back on ASSUMED_GPU), or None when one is named."""
        if self.gpu_spec(preset) is not None:
            return None
        return f"assumed: {preset.model.name} names no GPU, memplan's default; --gpu NAME sets one"

    def routed(self, preset: ModelPreset, named: bool) -> ModelPreset:
        """A preset with the MoE routing options (search: pinned for every plan; a named dense model refuses them,
        the other presets of an all-presets search ignore them)."""
        given = {k: v for k, v in self.moe_routing().items() if v is not None}
        if not given or not (named or preset.model.is_moe):
            return preset
        try:
            return dataclasses.replace(preset, model=ModelSpec(**{**preset.model.model_dump(exclude_unset=True),
                                                                  **given}))
        except ValidationError as e:
            raise MemplanError(describe_validation_error(e)) from None

    def batch_notes(self, preset: ModelPreset, seq_length: int, global_batch: int) -> list[str]:
        """What the batch is and where it came from, when that is worth saying."""
        note = batch_note(preset, seq_length, global_batch, self.global_batch, self.global_batch_tokens, self.gpus)
        return [note] if note else []
