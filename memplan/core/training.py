"""The training spec: batch, activation recompute (`Recompute`), precisions and the byte size of every stored
number, the optimizers memplan models and their implementations (`TrainingSpec` and its tables)."""

from __future__ import annotations

import enum
from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from memplan.core.spec_base import Spec, echo


class Recompute(enum.IntEnum):
    """Activation recomputation, ordered from most memory to least (K22 section 4.1, 5)."""

    NONE = 0
    """Store every activation of every layer (K22 Eq. 1 / 2 / 4)."""

    SELECTIVE = 1
    """Recompute the attention core (QK^T, softmax, softmax dropout, attention over V) in the
    backward pass: drops the 5as^2b term for about 2-3% more FLOPs (K22 section 5)."""

    FULL = 2
    """Store only each layer's input (2sbh) and re-run the layer's forward in the backward pass
    (K22 section 4.1 'full activation recomputation'). With `recompute_num_layers` only that many
    layers per model chunk are recomputed (Megatron-LM `--recompute-method block`), the rest store
    everything."""

    @classmethod
    def parse(cls, value: "str | int | Recompute") -> "Recompute":
        if isinstance(value, Recompute):
            return value
        try:
            if isinstance(value, int) and not isinstance(value, bool):
                return cls(value)
            return cls[str(value).strip().upper()]
        except (KeyError, ValueError):
            raise ValueError(f"recompute must be one of none, selective, full (got {echo(value)})") from None

    @property
    def label(self) -> str:
        return self.name.lower()


# Byte sizes of each precision, with PyTorch Lightning's names. "mixed" follows Megatron-LM
# (docs/user-guide/features/dist_optimizer.md): 16-bit weights and activations, fp32 master
# weights and Adam moments; bf16 keeps fp32 main gradients (2 + 4 + 4 + 8 = 18 B per parameter),
# fp16 keeps fp16 model gradients and fp32 copies of them (2 + 2 + 4 + 4 + 8 = 20). "true" runs
# everything in that dtype with no master copy (a bf16 model with torch AdamW, as most
# transformers fine-tuning does: 2 + 2 + 4 = 8 B per parameter).
PRECISIONS: dict[str, dict[str, int]] = {
    "bf16-mixed": dict(activation_bytes=2, weight_bytes=2, grad_bytes=4, master_weight_bytes=4,
                       optimizer_state_bytes=4),
    "16-mixed": dict(activation_bytes=2, weight_bytes=2, grad_bytes=6, master_weight_bytes=4,
                     optimizer_state_bytes=4),
    "bf16-true": dict(activation_bytes=2, weight_bytes=2, grad_bytes=2, master_weight_bytes=0,
                      optimizer_state_bytes=2),
    "32-true": dict(activation_bytes=4, weight_bytes=4, grad_bytes=4, master_weight_bytes=0,
                    optimizer_state_bytes=4),
}


OPTIMIZER_IMPLS = ("foreach", "fused", "for-loop")


# The optimizers memplan models (memplan/memory/optimizers.py: states, step temporaries, sources); `adam` is
# the old name of `adamw`, still read from YAML files.
OPTIMIZERS = ("adamw", "sgd", "sgd-nomomentum", "adafactor", "adam8bit", "muon", "lion")


OPTIMIZER_ALIASES = {"adam": "adamw"}

# Megatron-LM's fusion switches that memplan models, by the name inside --no-<name>-fusion (megatron/training/
# arguments.py at core_v0.16.1, _add_training_args: all on by default; memplan/inventory/fusions.py says what each
# changes)
FUSIONS = ("masked-softmax", "bias-gelu", "bias-swiglu", "bias-dropout", "rope", "gradient-accumulation")


# The implementations each has, its own default first (torch 2.13 torch/optim/: AdamW and SGD have
# foreach and fused; Adafactor a for-loop, its default, and foreach; Muon a for-loop beside an AdamW
# for the other parameters, whose implementation is the one named; bitsandbytes' 8-bit Adam one fused
# kernel; lion-pytorch's Lion a for-loop).
OPTIMIZER_IMPLS_OF = {"adamw": ("foreach", "fused", "for-loop"), "sgd": ("foreach", "fused"), "sgd-nomomentum": ("foreach", "fused"),
                      "adafactor": ("for-loop", "foreach"), "adam8bit": ("fused",), "muon": ("fused", "foreach"),
                      "lion": ("for-loop",)}


def parse_optimizer(value: Any) -> str:
    """An optimizer's name (the old `adam` read as `adamw`); an unknown one is refused with the list."""
    name = OPTIMIZER_ALIASES.get(value, value) if isinstance(value, str) else value
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {echo(value)}; known: {', '.join(OPTIMIZERS)} (adam = adamw)")
    return name


# megatron-core 0.16.1's selective recompute modules (TransformerConfig.recompute_modules) and its default
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
DEFAULT_RECOMPUTE_MODULES = ("core_attn",)


class TrainingSpec(Spec):
    """Batch, recompute and the byte size of every stored number."""

    micro_batch: int = Field(default=1, gt=0, description="b")
    global_batch: Optional[int] = Field(default=None, gt=0, description="sequences per step (default b*d)")
    recompute: Recompute = Recompute.NONE
    recompute_num_layers: Optional[int] = Field(
        default=None, gt=0, description="with full recompute: layers per model chunk recomputed (default all)"
    )
    recompute_modules: tuple[str, ...] = Field(
        default=DEFAULT_RECOMPUTE_MODULES, description="with selective recompute: the submodules recomputed "
        "(Megatron-LM --recompute-modules; default core_attn; memplan/inventory/recompute.py)")
    recompute_method: Optional[Literal["uniform", "block"]] = Field(
        default=None, description="with full recompute: Megatron-LM --recompute-method (block: the first "
        "recompute_num_layers layers of each chunk; uniform: every layer, one per checkpoint); default block with "
        "recompute_num_layers, else uniform")
    activation_bytes: int = Field(default=2, gt=0, description="16-bit activations (K22 section 4)")
    weight_bytes: int = Field(default=2, gt=0, description="bf16 model weights")
    grad_bytes: int = Field(default=4, gt=0, description="fp32 main gradients (Megatron-LM bf16 training)")
    master_weight_bytes: int = Field(default=4, ge=0, description="fp32 master copy of the weights; 0 if none")
    optimizer: str = Field(
        default="adamw", description="adamw (adam), sgd (momentum), sgd-nomomentum, adafactor, adam8bit, muon, lion "
        "(memplan/memory/optimizers.py)")
    optimizer_state_bytes: int = Field(default=4, ge=0, description="bytes of each optimizer moment")
    precision: Literal["bf16-mixed", "16-mixed", "bf16-true", "32-true"] = Field(
        default="bf16-mixed", description="sets the byte sizes above that are not given explicitly")
    optimizer_impl: Optional[Literal["foreach", "fused", "for-loop"]] = Field(
        default=None, description="the optimizer's implementation: torch's foreach (parameter-sized temporaries "
        "in the step), fused (none) or for-loop (one tensor at a time); default: the implementation's own "
        "where the optimizer has it, else the optimizer's (see `memplan impls`)")
    loss_chunks: int = Field(
        default=1, gt=0, description="LM head and cross-entropy computed in this many sequence chunks, each "
        "checkpointed, so the full fp32 logits never exist (chunked / fused linear cross-entropy)")
    fp8: Optional[Literal["delayed", "tensorwise", "blockwise"]] = Field(
        default=None, description="FP8 training with Transformer Engine as Megatron-LM launches it (--fp8-recipe): "
        "the linear layers' GEMMs in FP8, their saved inputs and weight copies in 1-byte FP8 (memplan/inventory/fp8.py; "
        "derived from Transformer Engine's code, not measured); None: no FP8")
    fp8_format: Literal["hybrid", "e4m3"] = Field(
        default="hybrid", description="FP8 format (Megatron-LM --fp8-format): hybrid = E4M3 forward, E5M2 gradients")
    fp8_amax_history_len: int = Field(
        default=1, gt=0, description="delayed scaling: amax values kept per FP8 tensor (Megatron-LM "
        "--fp8-amax-history-len, default 1; Transformer Engine's own default is 1024)")
    fp8_param_gather: bool = Field(
        default=False, description="the linear layers' weights kept only in FP8 (Megatron-LM --fp8-param-gather: "
        "Transformer Engine fp8_model_init, no bf16 copy; the fp32 master weights stay)")
    mst: int | Literal["auto"] = Field(
        default=1, description="Mini-Sequence Transformer (MsT, arXiv 2407.15892): the MLP and the LM head + loss "
        "run on this many pieces of the sequence, one after another, under layer-level gradient checkpointing; "
        "'auto' chooses the pieces as MsT's code does (memplan/inventory/mst.py); 1: off")
    optimizer_in_backward: bool = Field(
        default=False, description="each parameter's optimizer step runs in a post-accumulate-grad hook inside the "
        "backward and frees its gradient (PyTorch's 'optimizer step in backward' recipe; MsT's "
        "scripts/benchmark_minis.py, a for-loop Adam per parameter, the LM head's step after the embedding's): "
        "no step holds every gradient (memplan/memory/timeline.py)")
    offload_optimizer_fraction: float = Field(
        default=0.0, ge=0, le=1, description="fraction of each GPU's optimizer states (master weights and moments) "
        "kept and stepped in host memory, its gradients copied there and its weights back every step (Megatron-LM "
        "--optimizer-cpu-offload --optimizer-offload-fraction; memplan/memory/offload.py); 0: none")
    offload_activations: bool = Field(
        default=False, description="the decoder layers' saved tensors are copied to pinned host memory when saved "
        "and back when the backward needs them (torch.autograd.graph.save_on_cpu(pin_memory=True); "
        "memplan/memory/offload.py)")
    activation_offloader: Literal["save_on_cpu", "torchtune"] = Field(
        default="save_on_cpu", description="what offloads the activations: torch's save_on_cpu around the layers "
        "(no recompute), or torchtune's OffloadActivations (its recipes' enable_activation_offloading, with every "
        "layer checkpointed: the checkpoints' inputs go to the host on a side stream; memplan/memory/offload.py)")
    offload_activation_layers: Optional[int] = Field(
        default=None, gt=0, description="Megatron-LM --cpu-offloading-num-layers N (Transformer Engine's CPU "
        "offload of the first N layers' activations): modelled for N = L - 1 only, as offload_activations "
        "(memplan/memory/offload.py); None: not given")
    device: Literal["cuda", "cpu"] = Field(
        default="cuda", description="whose kernels run the layers: cuda, or cpu (torch's CPU kernels, which is "
        "what validation/ measures: every CUDA-only fusion off)")
    fusions_off: tuple[str, ...] = Field(
        default=(), description="Megatron-LM fusions turned off (--no-<name>-fusion, FUSIONS; memplan/inventory/"
        "fusions.py); (): Megatron-LM's defaults, all on")

    cross_entropy_fusion: Optional[Literal["native", "te"]] = Field(
        default=None, description="Megatron-LM --cross-entropy-loss-fusion with --cross-entropy-fusion-impl native|te "
        "(memplan/inventory/fusions.py); None: off, Megatron-LM's default")

    memory_efficient_layer_norm: bool = Field(
        default=False, description="Megatron-LM --memory-efficient-layer-norm: apex's fused LayerNorm saves its "
        "output, not its input (--impl megatron-local, LayerNorm, CUDA; memplan/inventory/fusions.py)")

    @field_validator("fusions_off", mode="after")
    @classmethod
    def _fusions(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [name for name in value if name not in FUSIONS]
        if unknown:
            raise ValueError(f"unknown fusion {echo(unknown[0])}; known: {', '.join(FUSIONS)}")
        return tuple(name for name in FUSIONS if name in value)  # one order, no repeats

    dp_stack: Optional[Literal["fsdp2", "deepspeed", "torchtitan", "torchtune"]] = Field(
        default=None, description="the data-parallel stack of an HF Trainer / accelerate run: fsdp2 (ZeRO 3) or "
        "deepspeed (ZeRO 1-3); torchtitan's FSDP2 (ZeRO 3, fp32 sharded parameters); torchtune's distributed "
        "recipes' FSDP2 (training.shard_model, ZeRO 3); its buffers: "
        "memplan/memory/dp_stack.py; None: the sharding alone")
    lora_rank: int = Field(
        default=0, ge=0, description="peft LoRA adapters of this rank on the target linears, the base weights frozen "
        "(no gradients or optimizer states; memplan/inventory/lora.py, memplan/memory/adapters.py); 0: full training")
    lora_targets: Optional[tuple[str, ...]] = Field(
        default=None, description="the linears LoRA adapts (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, "
        "or all-linear); None: peft's default for the family (q_proj, v_proj)")
    lora_dropout: float = Field(default=0.0, ge=0, lt=1, description="peft's lora_dropout (its mask is saved)")
    lora_impl: Literal["peft", "torchtune"] = Field(
        default="peft", description="whose LoRA modules: peft (fp32 adapters; QLoRA: bitsandbytes NF4) or torchtune's "
        "LoRALinear (adapters in the model's dtype; QLoRA: torchao NF4Tensor), which --impl torchtune sets")
    lora_dora: bool = Field(
        default=False, description="peft's DoRA (LoraConfig(use_dora=True)): a magnitude vector per target (fp32, "
        "trained) and what DoraLinearLayer saves beyond LoRA, measured with peft 0.21.2 on CPU (memplan/inventory/"
        "lora.py); peft's LoRA without dropout or QLoRA only")
    qlora: bool = Field(
        default=False, description="QLoRA: the frozen layer linears stored as bitsandbytes NF4 with double "
        "quantisation (measured with bitsandbytes on CPU), dequantised to the compute dtype per GEMM (derived from "
        "bitsandbytes' code, not measured)")

    batch_layout: Literal["full", "padded", "packed"] = Field(
        default="full", description="the micro-batch's rows: full (s real tokens each, no attention mask), padded "
        "(padded to s with an attention mask), packed (sequences packed, told apart by position_ids): with --impl "
        "hf-sdpa a mask in every layer and K / V at all heads (memplan/inventory/hf_trainer.py)")

    checkpoint_reentrant: bool = Field(
        default=False, description="transformers' gradient checkpointing with use_reentrant=True (its default is "
        "False): the recomputed layer's output is held through its backward (memplan/inventory/hf_trainer.py)")

    liger: bool = Field(
        default=False, description="Liger-Kernel's fused kernels (RMSNorm, SwiGLU, RoPE, fused linear "
        "cross-entropy) on transformers' Llama layout, derived from its code, not measured "
        "(memplan/inventory/liger.py)")

    float8: Optional[Literal["tensorwise", "rowwise"]] = Field(
        default=None, description="torchtitan's float8 linears (torchao Float8Linear, --impl torchtitan): rowwise as "
        "torchtitan 0.3.0's Float8LinearConverter sets it, tensorwise with FSDP2's float8 all-gather as torchtitan <= 0.2 "
        "ran it (memplan/inventory/titan_float8.py); None: bf16 linears")

    compile: bool = Field(
        default=False, description="torch.compile per decoder layer (--impl hf-sdpa / torchtune / torchtitan, Llama layout): the layer's saved "
        "tensors traced from AOTAutograd's partitioner (memplan/inventory/compiled.py)")

    async_tp: bool = Field(
        default=False, description="torchtitan's async TP (compile.enable_async_tensor_parallel, --impl torchtitan "
        "--compile --tp > 1): its symmetric-memory workspace outside the caching allocator and the TP collectives "
        "overlapped with their matmuls (memplan/inventory/titan_async_tp.py; derived, not measured)")

    memory_budget: Optional[float] = Field(
        default=None, ge=0, le=1, description="torchtitan's memory-budget AC (--ac budget:F, with compile): "
        "torch._functorch.config.activation_memory_budget, the partitioner's saved set traced at F "
        "(memplan/inventory/compiled.py BUDGET_SAVED); None: not set")

    @model_validator(mode="after")
    def _lora(self) -> "TrainingSpec":
        if self.qlora and not self.lora_rank:
            raise ValueError("qlora trains LoRA adapters on a 4-bit base: give lora_rank (--lora R)")
        if (self.lora_targets or self.lora_dropout) and not self.lora_rank:
            raise ValueError("lora_targets / lora_dropout need lora_rank (--lora R)")
        if self.lora_dora and (not self.lora_rank or self.lora_impl != "peft" or self.qlora or self.lora_dropout):
            raise ValueError("DoRA (--dora) is modelled for peft's LoRA (--lora R, --impl hf-*) without --qlora or "
                             "--lora-dropout (measured without them)")
        return self

    @model_validator(mode="before")
    @classmethod
    def _precision(cls, data: Any) -> Any:
        """Byte sizes not given explicitly come from the precision (explicit ones win)."""
        if isinstance(data, dict):
            name = data.get("precision", "bf16-mixed")
            if name in PRECISIONS:
                data = {**PRECISIONS[name], **data}
        return data

    @field_validator("recompute", mode="before")
    @classmethod
    def _recompute(cls, value: Any) -> Recompute:
        return Recompute.parse(value)

    @field_validator("recompute_modules", mode="before")
    @classmethod
    def _recompute_modules(cls, value: Any) -> tuple[str, ...]:
        """Megatron-LM's module names (megatron-core 0.16.1 TransformerConfig.recompute_modules), each once."""
        items = value.replace(",", " ").split() if isinstance(value, str) else list(value)
        for item in items:
            if item not in RECOMPUTE_MODULES:
                raise ValueError(f"recompute_modules takes {', '.join(RECOMPUTE_MODULES)} (got {echo(item)})")
        return tuple(dict.fromkeys(items))

    @model_validator(mode="after")
    def _recompute_method(self) -> "TrainingSpec":
        """Megatron-LM's --recompute-method as modelled: block recomputes --recompute-num-layers layers per chunk;
        uniform with one layer per checkpoint is every layer (N > 1 layers per checkpoint is not modelled)."""
        if self.recompute_method is None:
            return self
        if self.recompute != Recompute.FULL:
            raise ValueError("recompute_method applies to full recompute")
        if self.recompute_method == "block" and self.recompute_num_layers is None:
            raise ValueError("recompute_method block needs recompute_num_layers (the layers recomputed per chunk)")
        if self.recompute_method == "uniform" and self.recompute_num_layers not in (None, 1):
            raise ValueError("recompute_method uniform is modelled with one layer per checkpoint "
                             "(recompute_num_layers 1), not several layers per checkpoint")
        if self.recompute_method == "uniform":
            object.__setattr__(self, "recompute_num_layers", None)  # every layer, each its own checkpoint
        return self

    @field_validator("mst", mode="before")
    @classmethod
    def _mst(cls, value: Any) -> Any:
        """'auto' or a whole number >= 1 of mini-sequences (1: MsT off)."""
        if isinstance(value, str):
            text = value.strip().lower()
            if text == "auto":
                return "auto"
            if not text.isdigit():
                raise ValueError(f"mst takes a number of mini-sequences or 'auto', not {echo(value)}")
            value = int(text)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"mst takes a number of mini-sequences >= 1 or 'auto', not {echo(value)}")
        return value

    @model_validator(mode="after")
    def _mst_needs(self) -> "TrainingSpec":
        """MsT with its own LM head + loss in place of a chunked loss (its gradient checkpointing: Config, as the
        recompute mode is a plan's), and the optimizer step in the backward as modelled."""
        if self.optimizer_in_backward and (self.optimizer not in ("adamw", "adam8bit")
                                           or self.offload_optimizer_fraction > 0):
            raise ValueError("the optimizer step in the backward is modelled for AdamW and 8-bit Adam on the GPU (an "
                             "optimizer per parameter, as MsT's benchmark and torchtune's optimizer_in_bwd run it)")
        if self.mst != 1 and self.loss_chunks > 1:
            raise ValueError("MsT computes the LM head and loss in its own pieces: drop --loss-chunks")
        return self

    @field_validator("optimizer", mode="before")
    @classmethod
    def _optimizer(cls, value: Any) -> str:
        return parse_optimizer(value)

    @model_validator(mode="after")
    def _offload(self) -> "TrainingSpec":
        """Offload as modelled: optimizer offload steps AdamW or SGD on the host (Megatron-LM's HybridDeviceOptimizer
        has a CPU Adam and SGD only); save_on_cpu's activation offload without recompute (Megatron-LM refuses the two
        together; around checkpointed layers save_on_cpu would pack only the checkpoints' inputs, which torch 2.13's
        checkpoint saves through the hooks around it: not modelled); torchtune's with every layer checkpointed."""
        if self.offload_optimizer_fraction > 0 and self.optimizer not in ("adamw", "sgd", "sgd-nomomentum"):
            raise ValueError(f"optimizer offload is modelled for adamw and sgd (Megatron-LM's HybridDeviceOptimizer "
                             f"steps a CPU AdamW or SGD), not {self.optimizer}")
        if self.offload_activation_layers is not None and not self.offload_activations:
            raise ValueError("offload_activation_layers (--cpu-offloading-num-layers) needs offload_activations")
        if self.activation_offloader == "torchtune":
            if not self.offload_activations or self.recompute != Recompute.FULL:
                raise ValueError("torchtune's activation offloading runs with activation checkpointing of every layer "
                                 "(its recipes refuse it otherwise): --recompute full")
        elif self.offload_activations and self.recompute != Recompute.NONE:
            raise ValueError(f"activation offload is modelled without recompute (got recompute "
                             f"{self.recompute.label}): Megatron-LM refuses the two together (with --impl torchtune, "
                             "its own offloading runs with --recompute full)")
        return self

    @model_validator(mode="after")
    def _fp8(self) -> "TrainingSpec":
        """FP8 options need FP8, and Megatron-LM's FP8 runs bf16 or fp16 mixed precision."""
        if self.fp8 is None:
            if self.fp8_param_gather:
                raise ValueError("fp8_param_gather needs fp8 (a recipe: delayed, tensorwise or blockwise)")
            return self
        if self.precision not in ("bf16-mixed", "16-mixed"):
            raise ValueError(f"fp8 runs inside bf16-mixed or 16-mixed training (Megatron-LM --bf16 / --fp16 with "
                             f"--fp8-format), not {self.precision}")
        return self

    @model_validator(mode="after")
    def _optimizer_impl(self) -> "TrainingSpec":
        impls = OPTIMIZER_IMPLS_OF[self.optimizer]
        if self.optimizer_impl is not None and self.optimizer_impl not in impls:
            raise ValueError(f"optimizer {self.optimizer} has no {self.optimizer_impl} implementation (it has: "
                             f"{', '.join(impls)})")
        return self

    @property
    def optimizer_moments(self) -> int:
        """Full-size state tensors per parameter, in optimizer_state_bytes each: AdamW two (m, v), SGD
        with momentum, Lion and Muon one (Muon's AdamW share keeps two: memplan/memory/optimizers.py), SGD
        without momentum none, Adafactor none (its factored second moment is r + c values per r x c
        matrix) and 8-bit Adam none at that size (two 1-byte states: `optimizer_dense_bytes`)."""
        return {"adamw": 2, "sgd": 1, "sgd-nomomentum": 0, "adafactor": 0, "adam8bit": 0, "muon": 1,
                "lion": 1}[self.optimizer]

    @property
    def optimizer_dense_bytes(self) -> int:
        """Bytes of optimizer state per parameter in its full-size tensors (the step's memory traffic):
        the moments above, or 8-bit Adam's two uint8 states."""
        return 2 if self.optimizer == "adam8bit" else self.optimizer_moments * self.optimizer_state_bytes
