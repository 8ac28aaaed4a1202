"""From plan to launch: a Config as Megatron-LM command-line arguments (real flag names,
megatron/training/arguments.py). ZeRO 2 / 3 map to Megatron-FSDP's sharding strategies."""

from __future__ import annotations

from memplan.specs import Config, Recompute

# ZeRO stage -> Megatron-LM data-parallel sharding (stage 1 is the distributed optimizer).
_FSDP_STRATEGY = {2: "optim_grads", 3: "optim_grads_params"}


def megatron_args(config: Config) -> list[str]:
    m, par, tr = config.model, config.parallel, config.training
    args = [
        f"--num-layers {m.num_layers}",
        f"--hidden-size {m.hidden_size}",
        f"--num-attention-heads {m.num_attention_heads}",
        f"--ffn-hidden-size {m.f}",
        f"--seq-length {m.seq_length}",
        f"--max-position-embeddings {m.seq_length}",
    ]
    if m.g != m.num_attention_heads:
        args += ["--group-query-attention", f"--num-query-groups {m.g}"]
    if m.mlp == "swiglu":
        args.append("--swiglu")
    if m.norm == "rmsnorm":
        args.append("--normalization RMSNorm")
    if m.position_embedding == "rope":
        args.append("--position-embedding-type rope")
    if not m.tied_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    if not m.bias:
        args.append("--disable-bias-linear")
    if not m.dropout:
        args += ["--attention-dropout 0.0", "--hidden-dropout 0.0"]
    args += [
        f"--tensor-model-parallel-size {par.tp}",
        f"--pipeline-model-parallel-size {par.pp}",
    ]
    if par.vpp > 1:
        args.append(f"--num-layers-per-virtual-pipeline-stage {config.layers_per_chunk}")
    if par.sp:
        args.append("--sequence-parallel")
    if tr.recompute == Recompute.SELECTIVE:
        args.append("--recompute-granularity selective")
    elif tr.recompute == Recompute.FULL:
        n = tr.recompute_num_layers
        if n is None or n == config.layers_per_chunk:
            args += ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
        else:
            args += ["--recompute-granularity full", "--recompute-method block", f"--recompute-num-layers {n}"]
    args += [f"--micro-batch-size {tr.micro_batch}", f"--global-batch-size {config.global_batch}"]
    if par.zero >= 1:
        args.append("--use-distributed-optimizer")
        if par.shard < par.dp:
            args.append(f"--num-distributed-optimizer-instances {par.dp // par.shard}")
    if par.zero >= 2:
        args += ["--use-megatron-fsdp", f"--data-parallel-sharding-strategy {_FSDP_STRATEGY[par.zero]}",
                 "--no-gradient-accumulation-fusion", "--ckpt-format fsdp_dtensor"]
    if par.dp > 1:
        args += ["--overlap-grad-reduce"] + (["--overlap-param-gather"] if par.zero >= 1 else [])
    if tr.weight_bytes == 2:
        args.append("--bf16")
    return args
