"""From plan to launch, the HF Trainer way: a plan with --fsdp2 or --deepspeed-zero N as an accelerate config YAML
(`accelerate launch --config_file`) or a DeepSpeed config JSON (TrainingArguments(deepspeed=...)).

Keys as accelerate 1.15's config classes read them (accelerate/commands/config/config_args.py ClusterConfig,
cluster.py: fsdp_config / deepspeed_config) and as deepspeed 0.19.8's DeepSpeedConfig reads a JSON
(runtime/config.py, runtime/zero/config.py); tests/test_launch_trainer.py loads both with those parsers. The DeepSpeed
bucket sizes are written as numbers, the values the HF Trainer gives "auto" (memplan/memory/dp_stack.py), so the run
uses what memplan planned; the micro-batch and accumulation a YAML cannot carry are said in the notes."""

from __future__ import annotations

import json
from typing import Any

import yaml

from memplan.core.errors import MemplanError
from memplan.core.specs import Config
from memplan.core.training import Recompute
from memplan.launch.megatron import Launch
from memplan.memory.dp_stack import DS_MAX_LIVE_PARAMETERS, hf_auto_buckets, overlap_comm

# memplan's precision -> accelerate's mixed_precision; bf16-true: the model loaded in bf16 with no autocast
_ACCELERATE_PRECISION = {"bf16-mixed": "bf16", "16-mixed": "fp16", "32-true": "no", "bf16-true": "no"}


def _check(config: Config, emit: str) -> str:
    """The plan's stack, refusing what the emitted file cannot say."""
    stack, tr = config.training.dp_stack, config.training
    if stack is None:
        raise MemplanError(f"--emit {emit} writes an HF Trainer stack's config: give --fsdp2 or --deepspeed-zero N")
    if emit == "deepspeed" and stack != "deepspeed":
        raise MemplanError("--emit deepspeed writes a DeepSpeed config: plan it with --deepspeed-zero N (or use "
                           "--emit accelerate with --fsdp2)")
    if stack == "deepspeed" and tr.precision == "bf16-true":
        raise MemplanError("DeepSpeed keeps fp32 master weights with bf16 (its bf16 optimizer): plan it with "
                           "--precision bf16-mixed, not bf16-true")
    if tr.recompute not in (Recompute.NONE, Recompute.FULL) or tr.recompute_num_layers:
        raise MemplanError("the HF Trainer checkpoints every decoder layer or none (gradient_checkpointing): plan it "
                           "with --recompute none or full")
    if config.parallel.zero_shard not in (None, config.parallel.dp):
        raise MemplanError("--emit accelerate / deepspeed write one shard group over all d ranks: drop --zero-shard")
    return stack


def _trainer_notes(config: Config) -> list[str]:
    tr = config.training
    # FSDP2 checkpoints through fsdp_activation_checkpointing (the Trainer's own would all-gather twice)
    trainer_ckpt = tr.recompute == Recompute.FULL and tr.dp_stack != "fsdp2"
    notes = [f"TrainingArguments: per_device_train_batch_size={tr.micro_batch}, gradient_accumulation_steps="
             f"{config.num_microbatches}, gradient_checkpointing={trainer_ckpt}, on {config.parallel.dp} processes"]
    if tr.precision == "bf16-true":
        notes.append("bf16-true: load the model with torch_dtype=torch.bfloat16 (mixed_precision no)")
    return notes


def deepspeed_document(config: Config) -> dict[str, Any]:
    """The DeepSpeed config of the plan: its ZeRO stage, the buckets memplan planned, offload, precision, batch."""
    tr, zero, model = config.training, config.parallel.zero, config.model
    buckets = hf_auto_buckets(model)
    block: dict[str, Any] = {"stage": zero, "contiguous_gradients": True, "overlap_comm": overlap_comm(zero),
                             "reduce_bucket_size": buckets["reduce_bucket_size"]}
    if zero == 3:
        block.update(stage3_prefetch_bucket_size=buckets["stage3_prefetch_bucket_size"],
                     stage3_param_persistence_threshold=buckets["stage3_param_persistence_threshold"],
                     stage3_max_live_parameters=DS_MAX_LIVE_PARAMETERS)
    if tr.offload_optimizer_fraction > 0:
        if tr.offload_optimizer_fraction != 1:
            raise MemplanError("DeepSpeed offloads all of a GPU's optimizer states or none: drop --offload-fraction")
        block["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    doc: dict[str, Any] = {"train_micro_batch_size_per_gpu": tr.micro_batch,
                           "gradient_accumulation_steps": config.num_microbatches, "zero_optimization": block}
    if tr.precision == "bf16-mixed":
        doc["bf16"] = {"enabled": True}
    elif tr.precision == "16-mixed":
        doc["fp16"] = {"enabled": True}
    return doc


def accelerate_document(config: Config) -> dict[str, Any]:
    """The accelerate config of the plan (FSDP2, or DeepSpeed with its ZeRO settings inline)."""
    tr, stack = config.training, config.training.dp_stack
    doc: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE", "machine_rank": 0, "num_machines": 1,
                           "num_processes": config.parallel.dp, "mixed_precision": _ACCELERATE_PRECISION[tr.precision],
                           "use_cpu": False}
    if stack == "fsdp2":
        if tr.offload_optimizer_fraction > 0:
            raise MemplanError("FSDP2 offloads parameters, gradients and optimizer states together (fsdp_offload_params),"
                               " which memplan does not plan: drop --offload optimizer")
        doc["distributed_type"] = "FSDP"
        doc["fsdp_config"] = {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                              "fsdp_reshard_after_forward": True, "fsdp_offload_params": False,
                              "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_cpu_ram_efficient_loading": True,
                              "fsdp_activation_checkpointing": tr.recompute == Recompute.FULL}
    else:
        ds = deepspeed_document(config)
        doc["distributed_type"] = "DEEPSPEED"
        doc["deepspeed_config"] = {"zero_stage": config.parallel.zero,
                                   "gradient_accumulation_steps": config.num_microbatches,
                                   "offload_optimizer_device": "cpu" if "offload_optimizer" in ds["zero_optimization"]
                                   else "none", "offload_param_device": "none",
                                   "zero3_init_flag": config.parallel.zero == 3}
    return doc


def trainer_launch(config: Config, emit: str) -> Launch:
    """--emit accelerate (a YAML) or deepspeed (a JSON) for a plan with an HF Trainer stack."""
    stack = _check(config, emit)
    notes = _trainer_notes(config)
    if emit == "deepspeed":
        doc = deepspeed_document(config)
        text = json.dumps(doc, indent=2)
    else:
        doc = accelerate_document(config)
        text = yaml.safe_dump(doc, sort_keys=False)
        if stack == "deepspeed":
            notes.append("the DeepSpeed bucket sizes are the HF Trainer's 'auto' (h^2, 0.9 h^2); --emit deepspeed "
                         "writes them out")
    return Launch(text.rstrip("\n").split("\n"), {}, notes, kind=emit, document=doc)
