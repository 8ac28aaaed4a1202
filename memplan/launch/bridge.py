"""From plan to launch, the Megatron-Bridge way: the plan's Megatron-LM arguments (launch/megatron.py) as
Megatron-Bridge recipe overrides, `section.field=value` (Hydra's KEY=VALUE syntax, which
scripts/training/train.sh and run_recipe.py apply to a recipe's ConfigContainer), the environment unchanged.

The names are the fields of Megatron-Bridge 0.6.2's ConfigContainer sections: model (GPTModelProvider, a
megatron-core TransformerConfig), train (TrainingConfig), optimizer (OptimizerConfig), ddp
(DistributedDataParallelConfig), dataset (GPTDatasetConfig), checkpoint (CheckpointConfig) and mixed_precision (a
recipe name of training/mixed_precision.py); most are the Megatron-LM flag's argparse name, as Bridge's own
training/mlm_compat/arguments.py maps them, with its exceptions (--norm-epsilon: layernorm_epsilon, --num-experts:
num_moe_experts, --decoder-first-pipeline-num-layers: num_layers_in_first_pipeline_stage, --swiglu:
gated_linear_unit). tests/test_launch_bridge.py checks every name against a list read from Bridge's dataclasses."""

from __future__ import annotations

import shlex
from typing import Callable, Union

from memplan.core.specs import Config
from memplan.launch.megatron import Launch, megatron_launch
from memplan.launch.titan import titan_launch
from memplan.launch.trainer import trainer_launch

Value = Union[str, Callable[[str, Config], str]]

# Megatron-LM flag -> ((override key, value), ...): a value "$" is the flag's own value, a callable makes it from
# the flag's value and the plan. A flag with () has no override of its own (said in the comment beside it).
_TRUE, _FALSE = "true", "false"
OVERRIDES: dict[str, tuple[tuple[str, Value], ...]] = {
    "--num-layers": (("model.num_layers", "$"),),
    "--hidden-size": (("model.hidden_size", "$"),),
    "--num-attention-heads": (("model.num_attention_heads", "$"),),
    "--ffn-hidden-size": (("model.ffn_hidden_size", "$"),),
    "--seq-length": (("model.seq_length", "$"), ("dataset.seq_length", "$")),
    "--max-position-embeddings": (),  # GPTModelProvider has no such field: its seq_length sizes the positions
    "--kv-channels": (("model.kv_channels", "$"),),
    "--group-query-attention": (),  # num_query_groups alone says it (mlm_compat: None without the switch)
    "--num-query-groups": (("model.num_query_groups", "$"),),
    "--swiglu": (("model.gated_linear_unit", _TRUE),),  # activation_func: a note (a callable, no KEY=VALUE)
    "--normalization": (("model.normalization", "$"),),
    "--position-embedding-type": (("model.position_embedding_type", "$"),),
    "--untie-embeddings-and-output-weights": (("model.share_embeddings_and_output_weights", _FALSE),),
    "--disable-bias-linear": (("model.add_bias_linear", _FALSE),),
    "--attention-dropout": (("model.attention_dropout", "$"),),
    "--hidden-dropout": (("model.hidden_dropout", "$"),),
    "--qk-layernorm": (("model.qk_layernorm", _TRUE),),
    "--rotary-base": (("model.rotary_base", "$"),),
    "--norm-epsilon": (("model.layernorm_epsilon", "$"),),
    "--add-qkv-bias": (("model.add_qkv_bias", _TRUE),),
    "--window-size": (("model.window_size", lambda v, c: f"[{v}]"),),
    "--window-attn-skip-freq": (("model.window_attn_skip_freq", "$"),),
    "--attention-backend": (("model.attention_backend", "$"),),
    "--tensor-model-parallel-size": (("model.tensor_model_parallel_size", "$"),),
    "--pipeline-model-parallel-size": (("model.pipeline_model_parallel_size", "$"),),
    # Bridge counts virtual stages (ModelParallelConfig.virtual_pipeline_model_parallel_size), Megatron-LM layers
    "--num-layers-per-virtual-pipeline-stage": (("model.virtual_pipeline_model_parallel_size",
                                                 lambda v, c: str(c.parallel.vpp)),),
    "--num-virtual-stages-per-pipeline-rank": (("model.virtual_pipeline_model_parallel_size", "$"),),
    "--decoder-first-pipeline-num-layers": (("model.num_layers_in_first_pipeline_stage", "$"),),
    "--decoder-last-pipeline-num-layers": (("model.num_layers_in_last_pipeline_stage", "$"),),
    "--sequence-parallel": (("model.sequence_parallel", _TRUE),),
    "--context-parallel-size": (("model.context_parallel_size", "$"),),
    "--cp-comm-type": (("model.cp_comm_type", "$"),),
    "--expert-model-parallel-size": (("model.expert_model_parallel_size", "$"),),
    "--expert-tensor-parallel-size": (("model.expert_tensor_parallel_size", "$"),),
    "--recompute-granularity": (("model.recompute_granularity", "$"),),
    "--recompute-method": (("model.recompute_method", "$"),),
    "--recompute-num-layers": (("model.recompute_num_layers", "$"),),
    "--micro-batch-size": (("train.micro_batch_size", "$"),),
    "--global-batch-size": (("train.global_batch_size", "$"),),
    "--use-distributed-optimizer": (("ddp.use_distributed_optimizer", _TRUE),
                                    ("optimizer.use_distributed_optimizer", _TRUE)),
    "--num-distributed-optimizer-instances": (("ddp.num_distributed_optimizer_instances", "$"),),
    "--use-megatron-fsdp": (("ddp.use_megatron_fsdp", _TRUE),),
    "--data-parallel-sharding-strategy": (("ddp.data_parallel_sharding_strategy", "$"),),
    "--no-gradient-accumulation-fusion": (("model.gradient_accumulation_fusion", _FALSE),),
    # Megatron-LM's core_transformer_config_from_args: bias_activation_fusion is bias_swiglu_fusion with --swiglu,
    # else bias_gelu_fusion (memplan emits the switch of the model's own activation)
    "--no-bias-swiglu-fusion": (("model.bias_activation_fusion", _FALSE),),
    "--no-bias-gelu-fusion": (("model.bias_activation_fusion", _FALSE),),
    "--no-masked-softmax-fusion": (("model.masked_softmax_fusion", _FALSE),),
    "--no-bias-dropout-fusion": (("model.bias_dropout_fusion", _FALSE),),
    "--no-rope-fusion": (("model.apply_rope_fusion", _FALSE),),
    "--transformer-impl": (("model.transformer_impl", "$"),),
    "--cross-entropy-loss-fusion": (("model.cross_entropy_loss_fusion", _TRUE),),
    "--cross-entropy-fusion-impl": (("model.cross_entropy_fusion_impl", "$"),),
    "--memory-efficient-layer-norm": (("model.memory_efficient_layer_norm", _TRUE),),
    "--recompute-modules": (("model.recompute_modules", lambda v, c: "[" + ",".join(v.split()) + "]"),),
    "--ckpt-format": (("checkpoint.ckpt_format", "$"),),
    "--overlap-grad-reduce": (("ddp.overlap_grad_reduce", _TRUE),),
    "--overlap-param-gather": (("ddp.overlap_param_gather", _TRUE), ("optimizer.overlap_param_gather", _TRUE)),
    "--optimizer": (("optimizer.optimizer", "$"),),
    "--sgd-momentum": (("optimizer.sgd_momentum", "$"),),
    "--use-precision-aware-optimizer": (("optimizer.use_precision_aware_optimizer", _TRUE),),
    "--optimizer-cpu-offload": (("optimizer.optimizer_cpu_offload", _TRUE),),
    "--optimizer-offload-fraction": (("optimizer.optimizer_offload_fraction", "$"),),
    # arguments.py turns cpu_offloading on with N > 0; Bridge's TransformerConfig takes both fields
    "--cpu-offloading-num-layers": (("model.cpu_offloading", _TRUE), ("model.cpu_offloading_num_layers", "$")),
    # precision: one of Bridge's mixed-precision recipes (training/mixed_precision.py), which set the model's,
    # the optimizer's and the DDP's dtypes (and FP8) when the config is finalised; FP8: see _precision
    "--bf16": (),
    "--fp16": (),
    "--fp8-format": (),
    "--fp8-recipe": (),
    "--fp8-amax-history-len": (),
    "--fp8-param-gather": (),
    "--num-experts": (("model.num_moe_experts", "$"),),
    "--moe-router-topk": (("model.moe_router_topk", "$"),),
    "--moe-ffn-hidden-size": (("model.moe_ffn_hidden_size", "$"),),
    "--moe-shared-expert-intermediate-size": (("model.moe_shared_expert_intermediate_size", "$"),),
    "--moe-layer-freq": (("model.moe_layer_freq", lambda v, c: "[" + ",".join(
        ["0"] * c.model.moe_first_dense_layers + ["1"] * c.model.moe_layers) + "]"),),
    "--moe-token-dispatcher-type": (("model.moe_token_dispatcher_type", "$"),),
    "--moe-expert-capacity-factor": (("model.moe_expert_capacity_factor", "$"),),
    "--moe-pad-expert-input-to-capacity": (("model.moe_pad_expert_input_to_capacity", _TRUE),),
    "--moe-aux-loss-coeff": (("model.moe_aux_loss_coeff", "$"),),
    "--moe-z-loss-coeff": (("model.moe_z_loss_coeff", "$"),),
    "--moe-router-dtype": (("model.moe_router_dtype", "$"),),
    "--moe-router-pre-softmax": (("model.moe_router_pre_softmax", _TRUE),),
    "--moe-flex-dispatcher-backend": (("model.moe_flex_dispatcher_backend", "$"),),
    "--moe-grouped-gemm": (("model.moe_grouped_gemm", _TRUE),),
    "--moe-permute-fusion": (("model.moe_permute_fusion", _TRUE),),
    "--moe-shared-expert-overlap": (("model.moe_shared_expert_overlap", _TRUE),),
    # MLATransformerConfig's fields: a DeepSeek (MLA) provider's recipe takes them
    "--multi-latent-attention": (("model.multi_latent_attention", _TRUE),),
    "--q-lora-rank": (("model.q_lora_rank", "$"),),
    "--kv-lora-rank": (("model.kv_lora_rank", "$"),),
    "--qk-head-dim": (("model.qk_head_dim", "$"),),
    "--qk-pos-emb-head-dim": (("model.qk_pos_emb_head_dim", "$"),),
    "--v-head-dim": (("model.v_head_dim", "$"),),
    "--mtp-num-layers": (("model.mtp_num_layers", "$"),),
}

# (precision, FP8 recipe) -> Bridge's mixed-precision recipe (training/mixed_precision.py: bf16_mixed, fp16_mixed,
# {bf16,fp16}_with_fp8_delayed_scaling_mixed, _with_fp8_current_scaling_mixed, _with_mxfp8_mixed,
# _with_fp8_subchannel_scaling_mixed); fp32: null (no recipe)
_MIXED = {"bf16-mixed": "bf16", "16-mixed": "fp16"}
_FP8_RECIPE = {"delayed": "fp8_delayed_scaling", "tensorwise": "fp8_current_scaling", "mxfp8": "mxfp8",
               "blockwise": "fp8_subchannel_scaling"}


def _precision(config: Config, notes: list[str]) -> list[str]:
    tr = config.training
    base = _MIXED.get(tr.precision)
    if tr.precision == "32-true":
        return ["mixed_precision=null"]
    if base is None:  # bf16-true: megatron.py's note says why no precision is given
        return []
    if tr.fp8 is None:
        return [f"mixed_precision={base}_mixed"]
    name = f"{base}_with_{_FP8_RECIPE[tr.fp8]}_mixed"
    notes.append(f"FP8 comes with the mixed_precision recipe {name} (Megatron-Bridge training/mixed_precision.py), "
                 "whose FP8 format, amax history and parameter gathering are its own: they override the model's "
                 "fp8 fields and may differ from the plan's")
    return [f"mixed_precision={name}"]


def bridge_launch(config: Config, megatron: Launch) -> Launch:
    """The plan's Megatron-LM launch (`megatron`, from megatron_launch(config)) as Megatron-Bridge overrides."""
    notes = list(megatron.notes)
    overrides: list[str] = []
    for arg in megatron.args:
        flag, _, value = arg.partition(" ")
        if flag not in OVERRIDES:
            notes.append(f"{flag} has no Megatron-Bridge override memplan knows (memplan/launch/bridge.py): set it "
                         "in the recipe")
            continue
        for key, make in OVERRIDES[flag]:
            text = value if make == "$" else make(value, config) if callable(make) else make
            overrides.append(shlex.quote(f"{key}={text}"))  # a list's brackets are a glob to the shell
    overrides += _precision(config, notes)
    if config.model.mlp == "swiglu":
        notes.append("model.activation_func is a function, which no KEY=VALUE override sets: start from a recipe "
                     "whose model is SiLU-gated (Llama, Qwen, Mistral), as --swiglu is")
    return Launch(overrides, dict(megatron.env), notes, kind="bridge")


def launch_for(config: Config, emit: str, impl: str = "megatron", alloc_conf: str = "") -> Launch:
    """The launch `--emit` asks for: "megatron" (Megatron-LM's arguments), "bridge" (Megatron-Bridge's overrides),
    "accelerate" / "deepspeed" (an HF Trainer stack's config file, launch/trainer.py), "torchtitan" (a Python module
    returning torchtitan's Trainer.Config, launch/titan.py);
    impl and alloc_conf as megatron_launch takes them."""
    if emit in ("accelerate", "deepspeed"):
        return trainer_launch(config, emit)
    if emit == "torchtitan":
        return titan_launch(config)
    megatron = megatron_launch(config, impl, alloc_conf)
    return bridge_launch(config, megatron) if emit == "bridge" else megatron
