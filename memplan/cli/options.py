"""The options the commands share (the plan, the output format) and their parsing callbacks: sizes, token counts,
MsT pieces, the optimizers' names. Parsing only; what an option means is the API's (memplan/api/options.py)."""

from __future__ import annotations

import functools
from typing import Any, Callable, NoReturn, Optional

import click

# memplan/core/training.py OPTIMIZERS (a test checks they agree; specs loads pydantic, which --help does not need)
OPTIMIZERS = ("adamw", "sgd", "sgd-nomomentum", "adafactor", "adam8bit", "muon", "lion")
# memplan/core/training.py FUSIONS: Megatron-LM's --no-<name>-fusion switches (a test checks they agree)
FUSIONS = ("masked-softmax", "bias-gelu", "bias-swiglu", "bias-dropout", "rope", "gradient-accumulation")
# memplan/memory/reserved.py ALLOCATORS (a test checks they agree; the allocator model loads with estimate)
ALLOCATORS = ("default", "expandable")
# memplan/memory/pipeline.py TORCH_SCHEDULES: torch.distributed.pipelining's schedule names (a test checks they agree)
PIPELINE_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                      "DualPipeV")


def refuse(message: str) -> NoReturn:
    """Refuse the input with memplan's error (memplan.core.errors loads only when a command refuses)."""
    from memplan.core.errors import MemplanError

    raise MemplanError(message)


def _size(ctx: click.Context, param: click.Parameter, value: Optional[str]) -> Optional[int]:
    from memplan.api.values import budget_bytes

    return budget_bytes(value, param.opts[0])


def _tokens(ctx: click.Context, param: click.Parameter, value: Optional[str]) -> Optional[int]:
    from memplan.api.values import token_count

    return token_count(value)


def _loads(ctx: click.Context, param: click.Parameter, value: Optional[str]) -> Any:
    from memplan.api.values import expert_loads

    return expert_loads(value)


def _mst(ctx: click.Context, param: click.Parameter, value: Optional[str]) -> Any:
    from memplan.api.values import mst_pieces

    return mst_pieces(value)


class _AsciiDigits:
    """Whole numbers in ASCII digits only: Python's int() also reads other scripts' digits ('٨' as 8), which a
    user did not mean to give."""

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> Any:
        if isinstance(value, str) and not value.isascii():
            self.fail(f"{value!r} is not a whole number in ASCII digits", param, ctx)
        return super().convert(value, param, ctx)


class AsciiInt(_AsciiDigits, click.types.IntParamType):
    pass


class AsciiIntRange(_AsciiDigits, click.IntRange):
    pass


INT = AsciiInt()


def plan_options(func: Callable) -> Callable:
    """Options shared by every command that builds a plan for a model."""
    options = [
        click.option("--model", "model", metavar="NAME|FILE.yaml", help="Model preset or YAML file."),
        click.option("--hf-config", "hf_config", metavar="config.json",
                     help="A transformers config.json, or the directory holding it, read as data (the "
                          "architectures of docs/reference.md, config.json architectures)."),
        click.option("--inventory", "inventory", metavar="FILE.yaml",
                     help="A traced inventory written by `memplan trace --out` for the model's config.json: what "
                          "--impl hf-sdpa / hf-eager count (instead of the shipped or cached trace)."),
        click.option("--attention", type=click.Choice(["eager", "flash"]),
                     help="Attention kernel: eager stores the s x s scores; flash does not."),
        click.option("--tp", type=INT, help="Tensor-parallel size t."),
        click.option("--pp", type=INT, help="Pipeline-parallel size p."),
        click.option("--dp", type=INT, help="Data-parallel size d."),
        click.option("--vpp", type=INT, help="Interleaved (virtual) stages m per pipeline rank."),
        click.option("--pipeline-schedule", type=click.Choice(PIPELINE_SCHEDULES),
                     help="--impl torchtitan: its pipeline_parallel_schedule (default 1F1B; GPipe: every forward "
                          "first; the multi-stage Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, "
                          "DualPipeV with 2 stages per rank)."),
        click.option("--pipeline-layers-per-stage", type=AsciiIntRange(1), metavar="N",
                     help="--impl torchtitan, multi-stage schedules: its pipeline_parallel_layers_per_stage (stages "
                          "per rank = ceil((L + 2) / N) / pp, at least 2)."),
        click.option("--mtp", type=AsciiIntRange(0), metavar="N",
                     help="--impl torchtitan, DeepSeek-V3: its multi-token-prediction layers (model_registry "
                          "num_mtp_layers; default 0, as torchtitan's flavours; not with --pp or --cp, as torchtitan)."),
        click.option("--first-stage-layers", type=AsciiIntRange(1), metavar="N",
                     help="Transformer layers on the first pipeline stage (uneven stages: Megatron-LM "
                          "--decoder-first-pipeline-num-layers; the middle stages split the rest)."),
        click.option("--last-stage-layers", type=AsciiIntRange(1), metavar="N",
                     help="Transformer layers on the last pipeline stage (Megatron-LM "
                          "--decoder-last-pipeline-num-layers)."),
        click.option("--sp/--no-sp", default=None, help="Sequence parallelism."),
        click.option("--cp", type=AsciiIntRange(1), help="Context-parallel size: each sequence split over cp GPUs "
                     "(GPUs = t p d cp; needs flash attention and 2 cp | s; memplan/memory/parallel.py; --impl torchtitan: its "
                     "context_parallel_degree, memplan/inventory/titan.py). search: tried from s >= 16384 on."),
        click.option("--cp-comm-type", type=click.Choice(["p2p", "a2a"]),
                     help="Context-parallel attention: p2p ring (default) or a2a (Ulysses; cp | heads per GPU)."),
        click.option("--ep", type=AsciiIntRange(1), help="Expert-parallel size (MoE models): E/ep routed experts "
                     "per GPU; ep x etp must divide t x cp x d. --impl torchtitan: a Qwen3 MoE's or "
                     "DeepSeek-V3's expert_parallel_degree (its experts FSDP-sharded over dp_shard / ep)."),
        click.option("--etp", type=AsciiIntRange(1), help="Expert tensor-parallel size (MoE models; default t)."),
        click.option("--moe-imbalance", type=click.FloatRange(1.0, 1024.0), metavar="F",
                     help="MoE, --impl megatron*: the busiest GPU's routed tokens relative to the average (1.0 = "
                          "balanced, default); scales the routed-token activations (pinned in search)."),
        click.option("--moe-expert-loads", callback=_loads, metavar="L1,L2,..",
                     help="MoE, --impl megatron*: the busiest GPU's E/ep routed experts' loads relative to the average "
                          "expert (all E at ep = 1), in place of --moe-imbalance; with --moe-capacity-factor each "
                          "expert keeps min(load, C)."),
        click.option("--moe-capacity-factor", type=click.FloatRange(0, 1024.0, min_open=True), metavar="C",
                     help="MoE, --impl megatron*: each expert takes at most C k s b / E tokens, the rest dropped "
                          "(Megatron-LM --moe-expert-capacity-factor): routed terms bounded by min(imbalance, C), or per "
                          "expert with --moe-expert-loads."),
        click.option("--moe-pad-to-capacity", is_flag=True, default=None,
                     help="With --moe-capacity-factor: every expert's input padded to its capacity (Megatron-LM "
                          "--moe-pad-expert-input-to-capacity): routed terms x C."),
        click.option("--moe-token-dispatcher", type=click.Choice(["alltoall", "allgather", "flex"]),
                     help="MoE: Megatron-LM --moe-token-dispatcher-type (default alltoall; flex: DeepEP, CUDA only, "
                          "derived)."),
        click.option("--moe-aux-loss-coeff", type=click.FloatRange(0, 1e6), metavar="F",
                     help="MoE, --impl megatron*: Megatron-LM's load-balancing loss coefficient (default 0): > 0 "
                          "keeps the router's fp32 softmax over all E logits."),
        click.option("--moe-z-loss-coeff", type=click.FloatRange(0, 1e6), metavar="F",
                     help="MoE, --impl megatron*: Megatron-LM's router z-loss (default none): keeps the logits."),
        click.option("--moe-router-dtype", type=click.Choice(["fp32"]),
                     help="MoE, --impl megatron*: the router's logits and probabilities in fp32 (Megatron-LM; "
                          "default: the activations' dtype)."),
        click.option("--moe-router-pre-softmax", is_flag=True, default=None,
                     help="MoE, --impl megatron*: softmax over all E logits before the top-k (Megatron-LM; "
                          "required, so assumed, for k = 1)."),
        click.option("--moe-grouped-gemm", is_flag=True, default=None,
                     help="MoE, --impl megatron*, CUDA: the experts as grouped GEMMs (Megatron-LM; TEGroupedMLP, with "
                          "--transformer-impl local GroupedMLP); allows --recompute-modules moe_act."),
        click.option("--moe-permute-fusion", is_flag=True, default=None,
                     help="MoE, --impl megatron*, CUDA: Transformer Engine's fused token permutation (Megatron-LM): "
                          "an int32 row_id_map in place of the routing map, probabilities and int64 index."),
        click.option("--moe-shared-expert-overlap", is_flag=True, default=None,
                     help="MoE with shared experts, alltoall, --impl megatron*, CUDA: the shared experts on a second "
                          "stream (Megatron-LM): their fc1 keeps its own gathered input at t > 1."),
        click.option("--megatron-core-version", type=click.Choice(["0.16", "0.19"]),
                     help="MoE, --impl megatron*: the megatron-core modelled (default 0.16: 0.16.1; 0.19: 0.19.2's "
                          "alltoall permute keeps an int64 sort index over tokens x E)."),
        click.option("--recompute", type=click.Choice(["none", "selective", "full"]), help="Activation recompute."),
        click.option("--ac", metavar="MODE",
                     help="--impl torchtitan's activation checkpointing: none (default), full, selective-op or "
                          "selective-layer[:N] (every N-th layer checkpointed, default 2; torchtitan <= 0.2's "
                          "selective_ac_option) (memplan/inventory/titan.py), or budget:F with --compile (its "
                          "MemoryBudgetAC, F = 0, 0.1, ..., 1: the partitioner's saved set and recompute traced at "
                          "the Llama 3 widths; search tries it on the compiled tp 1 plans)."),
        click.option("--recompute-num-layers", type=INT,
                     help="Full recompute of this many layers per chunk (Megatron-LM block method; alone: --recompute full)."),
        click.option("--recompute-modules", metavar="NAMES",
                     help="Selective recompute of these submodules (Megatron-LM --recompute-modules, comma or space "
                          "separated): core_attn (default), layernorm, mlp, moe, shared_experts, mla_up_proj, "
                          "moe_act (with --moe-grouped-gemm)."),
        click.option("--recompute-method", type=click.Choice(["uniform", "block"]),
                     help="Full recompute (Megatron-LM --recompute-method): block with --recompute-num-layers N, "
                          "uniform one layer per checkpoint."),
        click.option("--micro-batch", type=INT, help="Micro-batch size b."),
        click.option("--global-batch", type=INT, help="Global batch in sequences per step."),
        click.option("--global-batch-tokens", callback=_tokens, metavar="TOKENS",
                     help="Global batch in tokens per step (4M = 4x10^6, 4Mi = 4x2^20), rounded to whole sequences."),
        click.option("--seq-len", type=INT,
                     help="Sequence length s (the preset's tokens per step are kept unless the batch is given)."),
        click.option("--gpus", type=INT, help="Number of GPUs (sets d = GPUs / (t p); scales the preset's global batch)."),
        click.option("--zero", type=AsciiIntRange(0, 3),
                     help="0 none; 1 optimizer states sharded over d (= Megatron-LM distributed optimizer); "
                          "2 also gradients; 3 also weights. Default: the preset's; 0 with --impl hf-* / torchtune "
                          "(their loops keep every state on every rank unless --fsdp2 / --deepspeed-zero)."),
        click.option("--zero-shard", type=INT,
                     help="Shard ZeRO states over this many data-parallel ranks (HSDP; default d)."),
        click.option("--dp-replicate", type=INT,
                     help="--impl torchtitan's HSDP: R replicas (data_parallel_replicate_degree), each shard group "
                          "d / R ranks (data_parallel_shard_degree; default 1: FSDP over all d)."),
        click.option("--distributed-optimizer", is_flag=True, default=None,
                     help="Megatron-LM distributed optimizer (same memory as --zero 1)."),
        click.option("--fsdp2", is_flag=True, default=None,
                     help="HF Trainer / accelerate with FSDP2 (fsdp_version 2; --impl hf-*): ZeRO 3 plus the "
                          "unsharded layers in flight (prefetch, reduce-scatter input; derived) or the output layer "
                          "at the loss (measured on CPU); with --impl torchtune its distributed recipes' "
                          "shard_model: 3 layers and the root (embedding, norm, output) gathered: "
                          "memplan/memory/dp_stack.py."),
        click.option("--deepspeed-zero", type=AsciiIntRange(1, 3), metavar="1|2|3",
                     help="HF Trainer with DeepSpeed ZeRO of this stage (--impl hf-*): its reduce buckets and stage 3's "
                          "prefetch with the Trainer's 'auto' sizes (derived; memplan/memory/dp_stack.py); with "
                          "--offload optimizer: offload_optimizer to CPU."),
        click.option("--impl", type=click.Choice(["megatron", "megatron-local", "torch", "hf-eager", "hf-sdpa", "torchtune",
                                                 "torchtitan"]), default="megatron",
                     show_default=True,
                     help="Which code runs the model: what it saves differs (see `memplan impls`)."),
        click.option("--transformer-impl", type=click.Choice(["transformer_engine", "local"]),
                     help="Megatron-LM --transformer-impl: transformer_engine = --impl megatron, local = --impl "
                          "megatron-local."),
        click.option("--device", type=click.Choice(["cuda", "cpu"]),
                     help="Whose kernels run the layers (default cuda): cpu = torch's CPU kernels, every CUDA-only "
                          "fusion off, as validation/ measures megatron-core (--impl megatron-local)."),
        *[click.option(f"--no-{name}-fusion", is_flag=True, default=None,
                       help=f"Megatron-LM --no-{name}-fusion (--impl megatron*; memplan/inventory/fusions.py).")
          for name in FUSIONS],
        click.option("--cross-entropy-loss-fusion", is_flag=True, default=None,
                     help="Megatron-LM --cross-entropy-loss-fusion (--impl megatron*): megatron-core's fused "
                          "vocab-parallel cross-entropy. native: the same tensors but an extra fp32 logits-sized "
                          "gradient buffer in its backward (measured on CPU); te: Transformer Engine's kernel keeps "
                          "the bf16 logits as their gradient instead of an fp32 softmax (derived, CUDA only)."),
        click.option("--cross-entropy-fusion-impl", type=click.Choice(["native", "te"]),
                     help="Megatron-LM --cross-entropy-fusion-impl (default native) with --cross-entropy-loss-fusion."),
        click.option("--cpu-offloading-num-layers", type=AsciiIntRange(1), metavar="N",
                     help="Megatron-LM --cpu-offloading-num-layers (--impl megatron*): Transformer Engine offloads the "
                          "first N layers' activations; N = L - 1 (no pipeline parallelism) is --offload activations "
                          "(derived, memplan/memory/offload.py); other N are refused."),
        click.option("--fine-grained-activation-offloading", is_flag=True, default=None,
                     help="Megatron-LM's module-level activation offloading: not modelled (refused)."),
        click.option("--offload-modules", metavar="MODULES",
                     help="Megatron-LM --offload-modules (with --fine-grained-activation-offloading): not modelled "
                          "(refused)."),
        click.option("--memory-efficient-layer-norm", is_flag=True, default=None,
                     help="Megatron-LM --memory-efficient-layer-norm (--impl megatron-local, LayerNorm, CUDA): apex's "
                          "fused LayerNorm saves its output (the next linear's input) instead of its input, and no "
                          "mean. Derived from apex's code, not measured."),
        click.option("--precision", type=click.Choice(["bf16-mixed", "bf16-true", "16-mixed", "32-true"]),
                     help="Byte sizes of weights, gradients, master weights and optimizer states (PyTorch "
                          "Lightning's names; default bf16-mixed: Megatron-LM's 18 bytes per parameter)."),
        click.option("--optimizer", type=click.Choice(OPTIMIZERS),
                     help="Optimizer (pinned: search keeps it): adamw (default; 'adam' in YAML), sgd (momentum), "
                          "sgd-nomomentum, adafactor (factored second moment), adam8bit (bitsandbytes), muon (hidden "
                          "matrices; AdamW on the rest), lion. States and step temporaries: `memplan impls`."),
        click.option("--optimizer-impl", type=click.Choice(["foreach", "fused", "for-loop"]),
                     help="The optimizer's implementation: torch's foreach keeps parameter-sized temporaries in its "
                          "step, fused none, for-loop one tensor's (default: the implementation's where the optimizer "
                          "has it, else the optimizer's own; see `memplan impls`)."),
        click.option("--loss-chunks", type=AsciiIntRange(1), metavar="N",
                     help="LM head + cross-entropy in N checkpointed sequence chunks (chunked / fused linear "
                          "cross-entropy): the full fp32 logits never exist (pinned in search). Measured for --impl "
                          "hf-* and torch; derived for megatron, which has no such flag (memplan/inventory/chunked_loss.py); "
                          "torchtune: its CEWithChunkedOutputLoss, measured (memplan/inventory/tune_loss.py)."),
        click.option("--fp8", "fp8", type=click.Choice(["delayed", "tensorwise", "blockwise", "mxfp8", "custom"]),
                     metavar="RECIPE",
                     help="FP8 training with Transformer Engine as Megatron-LM runs it (--fp8-recipe: delayed, "
                          "tensorwise or blockwise; pinned in search): FP8 linear inputs, weight caches, scaling "
                          "state, FP8 GEMMs. --impl megatron only; derived from TE's code, not measured (memplan/inventory/fp8.py)."),
        click.option("--float8", "float8", type=click.Choice(["tensorwise", "rowwise", "any"]),
                     help="--impl torchtitan's float8 linears (torchao Float8Linear on wqkv, wo, w1, w2, w3; the LM head "
                          "bf16): rowwise as torchtitan 0.3.0's Float8LinearConverter runs it, tensorwise with FSDP2's "
                          "float8 all-gather as torchtitan <= 0.2 ran it. A layer keeps what its bf16 version keeps "
                          "(measured on CPU); with --compile the partitioner's saved set with float8 (traced); "
                          "with --tp each rank's measured over gloo (compiled: --ac full only) "
                          "(memplan/inventory/titan_float8.py). search: pinned, or 'any' to search "
                          "bf16, tensorwise and rowwise (a dense model without --pp, on a GPU with FP8 tensor cores)."),
        click.option("--fp8-format", type=click.Choice(["hybrid", "e4m3"]),
                     help="With --fp8: Megatron-LM --fp8-format (default hybrid: E4M3 forward, E5M2 gradients)."),
        click.option("--fp8-amax-history-len", type=AsciiIntRange(1), metavar="N",
                     help="With --fp8 delayed: amax values kept per FP8 tensor (default 1, Megatron-LM's)."),
        click.option("--fp8-param-gather", is_flag=True, default=None,
                     help="With --fp8: the linear weights kept only in FP8 (Megatron-LM --fp8-param-gather)."),
        click.option("--mst", callback=_mst, metavar="M|auto",
                     help="Mini-Sequence Transformer (MsT, arXiv 2407.15892; --impl hf-*, Llama layout, with "
                          "--recompute full, b = 1): the MLP and the LM head + loss run on M pieces of the sequence; "
                          "auto: as MsT's code, the MLP in pieces of max(4096/b, 1024) tokens and the head in 64. "
                          "search keeps it for every plan (and b = 1). memplan/inventory/mst.py."),
        click.option("--compile/--no-compile", "compile", default=None,
                     help="torch.compile per decoder layer (--impl hf-sdpa, torchtune or torchtitan, Llama layout): "
                          "each layer's saved tensors traced from AOTAutograd's partitioner (torch 2.13, inductor on "
                          "CPU) and measured on CPU; the backward's transients the eager layer's (derived; "
                          "torchtitan's bf16 Llama 3, Qwen3 and Qwen3 MoE blocks: Inductor's generated backward measured "
                          "on CPU), Inductor's "
                          "fused kernels' own buffers left out; the loss not compiled but with --impl torchtune "
                          "--loss-chunks N (its recipes' compile_loss, measured on CPU); torchtune's LoRA / QLoRA "
                          "layers traced (memplan/inventory/compiled.py); torchtitan with --ac selective-op: its save list's "
                          "block compiled, traced and measured on CPU (not with --float8); torchtitan's Qwen3 MoE "
                          "and DeepSeek-V3 blocks at ep, tp, cp 1 (memplan/inventory/compiled_moe.py, "
                          "compiled_dsv3.py). "
                          "search --impl torchtitan tries both unless --compile or --no-compile pins it; --timing: its "
                          "fused memory-bound ops (derived)."),
        click.option("--async-tp", "async_tp", is_flag=True, default=None,
                     help="--impl torchtitan --compile --tp > 1: torchtitan's async TP (compile.enable_async_tensor_"
                          "parallel): its symmetric-memory workspace, 4 s b h / t bytes per GPU in bf16, counted outside "
                          "the caching allocator, and TP's all-gathers / reduce-scatters overlapped with the matmuls "
                          "they feed (the workspace traced from torch 2.13's fused ops on CPU; the overlap derived, uncalibrated: "
                          "memplan/inventory/titan_async_tp.py). "
                          "search: pinned on the compiled tp > 1 plans."),
        click.option("--optimizer-in-backward", is_flag=True, default=None,
                     help="Step each parameter in a post-accumulate-grad hook inside the backward and free its "
                          "gradient (PyTorch's 'optimizer step in backward' recipe, MsT's benchmark loop: a for-loop "
                          "AdamW per parameter, the LM head's step after the embedding's; --impl torchtune: its "
                          "optimizer_in_bwd, no step waits); --impl hf-* / torchtune, adamw or adam8bit (bitsandbytes, "
                          "one optimizer per parameter), one micro-batch. Measured (validation/step.py loop "
                          "in-backward; adam8bit's states with torchtune on CPU)."),
        click.option("--lora", "lora", type=AsciiIntRange(1), metavar="R",
                     help="peft LoRA adapters of rank R, the base model frozen (--impl hf-*, Llama layout): fp32 "
                          "adapters with their gradients and AdamW states, what peft's LoRA layers save (measured on "
                          "CPU, memplan/inventory/lora.py); with --impl torchtune its own LoRALinear (bf16 adapters, "
                          "measured)."),
        click.option("--lora-targets", metavar="NAMES",
                     help="With --lora: comma-separated linears (q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,"
                          "down_proj) or all-linear (default: peft's for the family, q_proj,v_proj; torchtune: its recipes', "
                          "q_proj,v_proj,o_proj and the MLP's three)."),
        click.option("--lora-dropout", type=click.FloatRange(0, 1, max_open=True), metavar="P",
                     help="With --lora: peft's lora_dropout (each target saves its mask; default 0)."),
        click.option("--batch-layout", type=click.Choice(["full", "padded", "packed"]), default=None,
                     help="The micro-batch's rows (--impl hf-*, Llama layout): full = s real tokens each (default, "
                          "no attention mask); padded = padded to s with an attention mask; packed = sequences packed "
                          "by position_ids (DataCollatorWithFlattening: --micro-batch 1, --seq-len the packed row). "
                          "With hf-sdpa a mask is saved in every layer and K / V keep all heads (measured on CPU with "
                          "the HF Trainer, memplan/inventory/hf_trainer.py)."),
        click.option("--checkpoint-reentrant", is_flag=True, default=None,
                     help="With --impl hf-* and --recompute full: transformers' gradient checkpointing with "
                          "use_reentrant=True (gradient_checkpointing_kwargs; its default is False): the recomputed "
                          "layer's output (s b h) is held through its backward (measured on CPU with the HF Trainer)."),
        click.option("--liger", is_flag=True, default=None,
                     help="Liger-Kernel 0.8.5's fused kernels (--impl hf-*, Llama layout): RMSNorm, SwiGLU, RoPE, "
                          "the fused linear cross-entropy. Derived from its code (Triton only), not measured "
                          "(memplan/inventory/liger.py)."),
        click.option("--qlora", is_flag=True, default=None,
                     help="With --lora: the frozen layer linears in bitsandbytes NF4 with double quantisation "
                          "(0.516 B per weight, measured on CPU), dequantised per GEMM (derived from bitsandbytes' code); "
                          "with --impl torchtune torchao's NF4Tensor (measured)."),
        click.option("--dora", is_flag=True, default=None,
                     help="With --lora (--impl hf-*, no --qlora or --lora-dropout): peft's DoRA (use_dora=True): a "
                          "magnitude vector per target and what its layer saves beyond LoRA, among them an in x in "
                          "identity per target (measured with peft on CPU)."),
        click.option("--offload", "offload", multiple=True, type=click.Choice(["optimizer", "activations"]),
                     help="Keep in host memory (repeatable; search keeps it for every plan): optimizer = the master "
                          "weights and moments, stepped on the host (Megatron-LM's HybridDeviceOptimizer); activations "
                          "= the decoder layers' saved tensors (torch's save_on_cpu; no recompute; with --impl torchtune its "
                          "OffloadActivations, with --recompute full). memplan/memory/offload.py."),
        click.option("--offload-fraction", type=click.FloatRange(0, 1, min_open=True), metavar="F",
                     help="With --offload optimizer: the fraction of the optimizer states offloaded (default 1.0; "
                          "Megatron-LM --optimizer-offload-fraction)."),
        click.option("--host-mem", "host_mem", callback=_size, metavar="SIZE",
                     help="Host memory per node for the offload, e.g. 2TB or 2TiB: a plan fits only within it too "
                          "(estimate's verdict, search's filter)."),
        click.option("--frag-margin", type=click.FloatRange(0, 1), metavar="FRACTION",
                     help="Caching-allocator margin above the allocated peak (default: the GPU preset's, 0.10; none "
                          "where the run's allocation stream is checked against the real code's, --impl hf-sdpa's "
                          "plain Llama loop: the replay decides)."),
        click.option("--allocator", type=click.Choice(ALLOCATORS), default="default",
                     help="The caching allocator the run is replayed through (memplan/memory/reserved.py)."),
        click.option("--alloc-conf", "alloc_conf", metavar="TEXT", help="PYTORCH_CUDA_ALLOC_CONF for the replay."),
        click.option("--first-step-seq-len", type=AsciiIntRange(1), metavar="N",
                     help="The run's history for the replay: step 1, where AdamW creates its states, at N tokens "
                          "(e.g. a short warm-up step), the later steps at --seq-len (default: every step at "
                          "--seq-len)."),
        click.option("--gpu", "gpu", metavar="NAME|FILE.yaml", help="GPU preset (budget, speed)."),
        click.option("--mem", "mem", callback=_size, metavar="SIZE",
                     help="Memory budget per GPU, e.g. 80GB (10^9 bytes) or 80GiB (2^30 bytes)."),
        click.option("--json", "as_json", is_flag=True, help="Print one JSON object."),
    ]
    return functools.reduce(lambda f, opt: opt(f), reversed(options), func)


def output_options(func: Callable) -> Callable:
    """--format and --plot, shared by estimate and search."""
    options = [
        click.option("--format", "fmt", type=click.Choice(["table", "json", "markdown", "csv"]),
                     help="Output: a terminal table (default), JSON (= --json), a Markdown table (docs, issue "
                          "threads) or CSV (spreadsheets); all from the one JSON schema."),
        click.option("--plot", "plot", metavar="FILE.png|FILE.svg",
                     help="Also draw a picture into FILE (PNG or SVG by the extension; needs memplan[plot])."),
    ]
    return functools.reduce(lambda f, opt: opt(f), reversed(options), func)


def output_format(opts: dict[str, Any]) -> str:
    """The output format: --format, with --json as an alias of --format json (both taken out of `opts`, which
    are then the API's keyword arguments)."""
    fmt = opts.pop("fmt")
    if opts.pop("as_json"):
        if fmt not in (None, "json"):
            refuse(f"--json conflicts with --format {fmt}")
        return "json"
    return fmt or "table"


def check_plots(paths: dict[str, Optional[str]]) -> None:
    """Refuse bad --plot files (name, folder, two options on one file) before any work (plots load only then)."""
    if any(paths.values()):
        from memplan.report.plots import check_plot_paths

        check_plot_paths(paths)


def emit_options(what: str) -> Callable[[Callable], Callable]:
    """--emit and --emit-only, shared by estimate (what: "the plan") and search ("the best plan")."""
    options = [
        click.option("--emit", type=click.Choice(["megatron", "bridge", "accelerate", "deepspeed", "torchtitan"]),
                     help=f"Also print {what} as Megatron-LM arguments (bridge: as Megatron-Bridge recipe overrides, "
                          "section.field=value; accelerate: an accelerate config YAML, with --fsdp2 or "
                          "--deepspeed-zero; deepspeed: a DeepSpeed config JSON, with --deepspeed-zero; torchtitan: a Python module "
                          "returning torchtitan 0.3.0's Trainer.Config, with --impl torchtitan) and the environment they need (with "
                          "PYTORCH_CUDA_ALLOC_CONF when the plan fits only with the allocator settings it was replayed "
                          "with, e.g. expandable segments; with --json: inside the document, as launch)."),
        click.option("--emit-only", is_flag=True,
                     help="With --emit: print only the launch block (export/unset lines, then the arguments one per "
                          "line with \\ continuations, to paste after `torchrun ... pretrain_gpt.py`); notes go to "
                          "stderr."),
    ]
    return lambda func: functools.reduce(lambda f, opt: opt(f), reversed(options), func)
