"""From plan to launch, the torchtitan way: a plan of --impl torchtitan as torchtitan 0.3.0's configuration.

torchtitan 0.3.0 (the version installed beside torch 2.13; its TOML job files are gone) is configured by Python:
``torchtitan.train`` calls ``ConfigManager.parse_args``, which imports ``--module M`` (a short name such as llama3, or
any importable module) and calls its function ``--config F``, which returns a ``Trainer.Config``
(torchtitan/config/manager.py, torchtitan/trainer.py). The emitted text is such a module: ``memplan_plan()`` starts
from the shipped ``llama3_8b`` / ``llama3_70b`` / ``llama3_405b`` of torchtitan/models/llama3/config_registry.py
(Qwen3 MoE: ``qwen3_30b_a3b``; DeepSeek-V3: ``deepseek_v3_671b``) and sets what memplan planned: the model with torchtitan's ``Float8LinearConverter`` (``--float8 rowwise``: recipe
"rowwise", ``filter_fqns=["lm_head"]`` as the shipped float8 config) or without converters, torch.compile of the model only where the plan has ``--compile`` (memplan does not model
the compiled loss), the plain cross-entropy loss
(the shipped configs chunk the loss with ChunkedLossWrapper, which memplan does not model), the local and global
batch, the sequence length, the data-parallel degrees (dp_replicate x dp_shard), the tensor-parallel degree (sequence
parallelism on, torchtitan's default; with TP > 1 the ``partial_dtensor`` SPMD backend, the DTensor path memplan measured
(validation/titan.py tp_rank): 0.3.0's default ``spmd_types`` with TP stopped in torch 2.13's fully_shard, which
wants DTensor parameters), the context-parallel degree (with CP > 1 the ``partial_dtensor`` backend too: its
``apply_cp_to_forward`` is what validation/titan_cp.py measured), pipeline parallelism with its schedule and micro-batch size, and the activation checkpointing (``FullAC`` / ``SelectiveAC`` / None).  Field names checked against
torchtitan 0.3.0's dataclasses; tests/test_launch_titan.py loads the emitted module with torchtitan's own
ConfigManager.

torchtitan's launcher (run_train.sh) runs torchrun with expandable segments ("expandable_segments:True", spelled
PYTORCH_ALLOC_CONF there, torch's newer name for PYTORCH_CUDA_ALLOC_CONF, which torch 2.13 still reads): the launch
sets it the same way."""

from __future__ import annotations

from typing import Optional

from memplan.core.errors import MemplanError
from memplan.core.specs import Config
from memplan.core.training import Recompute
from memplan.inventory.titan_float8 import FILTER_FQNS
from memplan.launch.megatron import ALLOC_CONF, Launch

EXPANDABLE = "expandable_segments:True"
MODULE = "memplan_titan"  # the file name the emitted text is saved as (memplan_titan.py)
FUNCTION = "memplan_plan"

# torchtitan 0.3.0's Llama 3 flavours (torchtitan/models/llama3/__init__.py llama3_configs): layers, dim, heads, KV
# heads, FFN hidden, vocabulary -> the config_registry function that ships it; tests/test_launch_titan.py checks each
# against torchtitan's own model configs
FLAVORS = {(32, 4096, 32, 8, 14336, 128256): ("8B", "llama3_8b"),
           (80, 8192, 64, 8, 28672, 128256): ("70B", "llama3_70b"),
           (126, 16384, 128, 8, 53248, 128256): ("405B", "llama3_405b")}
# torchtitan 0.3.0's Qwen3 MoE flavours (torchtitan/models/qwen3/__init__.py qwen3_configs): layers, dim, heads, KV
# heads, head dim, experts, expert FFN hidden, top-k, vocabulary -> the shipped config function it starts from.
# 0.3.0 ships one Qwen3 MoE config, qwen3_30b_a3b: the 235B-A22B plan starts from it with the model swapped (the
# same Qwen3 tokenizer; its hf_assets_path names the 30B's folder: a note says so). tests/test_launch_titan.py checks
# each against torchtitan's own model configs
QWEN3_MOE_FLAVORS = {(48, 2048, 32, 4, 128, 128, 768, 8, 151936): ("30B-A3B", "qwen3_30b_a3b"),
                     (94, 4096, 64, 4, 128, 128, 1536, 8, 151936): ("235B-A22B", "qwen3_30b_a3b")}
# torchtitan 0.3.0's DeepSeek-V3 flavours memplan models (models/deepseek_v3/__init__.py): layers, dense first layers,
# dim, heads, q / kv latents, experts, expert FFN hidden, top-k, vocabulary -> the shipped config function (the 16B
# flavour's router options are not modelled: memplan/inventory/titan_dsv3.py ROUTER_GROUPS); tests/test_titan_dsv3_emit.py
# checks it against torchtitan's own model config
DSV3_FLAVORS = {(61, 3, 7168, 128, 1536, 512, 256, 2048, 8, 129280): ("671B", "deepseek_v3_671b")}


def flavor(config: Config) -> tuple[str, str, str]:
    """The torchtitan model family (its models/ package), flavour and the shipped config function of the plan's
    model, or refused."""
    m = config.model
    if m.is_mla:
        key = (m.num_layers, m.moe_first_dense_layers, m.hidden_size, m.num_attention_heads, m.q_lora_rank,
               m.kv_lora_rank, m.num_experts, m.moe_ffn_hidden_size, m.moe_top_k, m.vocab_size)
        if key not in DSV3_FLAVORS:
            raise MemplanError("--emit torchtitan starts from torchtitan's DeepSeek-V3 671B flavour for a latent-"
                               f"attention plan; {m.name[:40]!r} is not it")
        return ("deepseek_v3",) + DSV3_FLAVORS[key]
    if m.is_moe:
        key = (m.num_layers, m.hidden_size, m.num_attention_heads, m.g, m.head_dim, m.num_experts,
               m.moe_ffn_hidden_size, m.moe_top_k, m.vocab_size)
        if key not in QWEN3_MOE_FLAVORS:
            raise MemplanError("--emit torchtitan starts from torchtitan's Qwen3 MoE flavours (30B-A3B, 235B-A22B) "
                               f"for an MoE plan; {m.name[:40]!r} is none of them")
        return ("qwen3",) + QWEN3_MOE_FLAVORS[key]
    key = (m.num_layers, m.hidden_size, m.num_attention_heads, m.g, m.f, m.vocab_size)
    if key not in FLAVORS:
        raise MemplanError(f"--emit torchtitan starts from torchtitan's shipped Llama 3 configs (8B, 70B, 405B); "
                           f"{m.name[:40]!r} is none of them")
    return ("llama3",) + FLAVORS[key]


def _ac(config: Config) -> tuple[str, str]:
    """The activation-checkpointing line and its import name (refusing what 0.3.0 cannot say)."""
    tr = config.training
    if tr.recompute == Recompute.FULL and tr.recompute_num_layers is not None:
        raise MemplanError("--emit torchtitan: torchtitan 0.3.0 has no per-layer selective AC (selective_ac_option "
                           "was removed with the TOML configs): plan it with --ac none, full or selective-op")
    if tr.recompute == Recompute.FULL:
        return "FullAC.Config()", "FullAC"
    if tr.recompute == Recompute.SELECTIVE:
        return "SelectiveAC.Config()", "SelectiveAC"
    if tr.memory_budget is not None:  # torchtitan's MemoryBudgetAC: activation_memory_budget = F, the model compiled
        return f"MemoryBudgetAC.Config(memory_budget={tr.memory_budget:g})", "MemoryBudgetAC"
    return "None", ""


def _converters(config: Config) -> str:
    """The model's converters: torchtitan 0.3.0's float8 converter for --float8 rowwise; tensorwise refused."""
    recipe = config.training.float8
    if recipe is None:
        return "[]"
    if recipe != "rowwise":
        raise MemplanError("--emit torchtitan: torchtitan 0.3.0's Float8LinearConverter names the rowwise recipes "
                           "only and has no float8 all-gather (--float8 tensorwise is torchtitan <= 0.2's): plan it "
                           "with --float8 rowwise")
    fqns = ", ".join(f'"{x}"' for x in FILTER_FQNS)
    return (f'[Float8LinearConverter.Config(recipe_name="rowwise", filter_fqns=[{fqns}], '
            f"model_compile_enabled={config.training.compile})]")


def layers_per_stage(config: Config) -> Optional[int]:
    """pipeline_parallel_layers_per_stage giving the plan's vpp stages a rank (torchtitan's _get_pipeline_metadata:
    ceil((L + 2) / N) virtual stages), None for its default (1 stage a rank single-stage, 2 multi-stage)."""
    par, L = config.parallel, config.model.num_layers
    if par.pp_schedule in ("1F1B", "GPipe") or par.vpp == 2:
        return None
    n = -(-(L + 2) // (par.pp * par.vpp))
    if -(-(L + 2) // n) != par.pp * par.vpp:
        raise MemplanError(f"--emit torchtitan: no pipeline_parallel_layers_per_stage makes {par.vpp} stages a rank")
    return n


def titan_document(config: Config) -> dict:
    """What the emitted module sets, by torchtitan's field names (the JSON form of the launch)."""
    par, tr = config.parallel, config.training
    replicate = par.dp // par.shard
    family, flavour, base = flavor(config)
    ep = par.ep if config.model.is_moe else 1
    return {"module": MODULE, "config": FUNCTION, "family": family, "base": base, "flavor": flavour,
            # with PP the local batch is the pipeline's M micro-batches (pipeline_parallel.py: n_microbatches =
            # local_batch_size // pipeline_parallel_microbatch_size), without it one micro-batch (accumulation steps)
            "training.local_batch_size": tr.micro_batch * (config.num_microbatches if par.pp > 1 else 1),
            "training.global_batch_size": config.global_batch,
            "training.seq_len": config.model.seq_length,
            "parallelism.data_parallel_replicate_degree": replicate,
            "parallelism.data_parallel_shard_degree": par.shard,
            "parallelism.tensor_parallel_degree": par.tp,
            "parallelism.context_parallel_degree": par.cp,
            "parallelism.pipeline_parallel_degree": par.pp,
            "parallelism.pipeline_parallel_schedule": par.pp_schedule,
            "parallelism.pipeline_parallel_microbatch_size": tr.micro_batch,
            # multi-stage schedules: torchtitan's default is 2 stages a rank; more need its layers-per-stage setting
            "parallelism.pipeline_parallel_layers_per_stage": layers_per_stage(config),
            # MoE: EP borrows the FSDP ranks (torchtitan's efsdp = dp_shard cp tp / ep); dense models: 1
            "parallelism.expert_parallel_degree": ep,
            "parallelism.spmd_backend": "partial_dtensor" if max(par.tp, par.cp, ep) > 1 else "spmd_types",
            # torchtitan's _validate_cuda_graphs refuses graphs with PP and with EP's AllToAllTokenDispatcher
            "training.disable_cuda_graphs": par.pp > 1 or ep > 1,
            "activation_checkpoint": _ac(config)[0], "compile.enable": bool(tr.compile),
            "compile.components": ["model"] if tr.compile else [],
            # async TP (--async-tp: memplan/inventory/titan_async_tp.py), which torchtitan's CompileConfig allows compiled
            "compile.enable_async_tensor_parallel": bool(tr.async_tp),
            # DeepSeek-V3's MTP layers (model_registry num_mtp_layers; MTPLoss, as its deepseek_v3_debugmodel_mtp)
            "num_mtp_layers": config.model.mtp_layers,
            "loss": "MTPLoss" if config.model.mtp_layers else "CrossEntropyLoss", "converters": _converters(config)}


def titan_launch(config: Config) -> Launch:
    """--emit torchtitan: the plan as a Python module returning torchtitan 0.3.0's Trainer.Config."""
    if config.training.dp_stack != "torchtitan":
        raise MemplanError("--emit torchtitan writes torchtitan's config: plan it with --impl torchtitan")
    doc = titan_document(config)
    ac, ac_name = _ac(config)
    graphs = " and ".join(w for w, on in (("PP", config.parallel.pp > 1),
                                          ("EP's all-to-all dispatcher", doc["parallelism.expert_parallel_degree"] > 1))
                          if on)
    gpus = config.parallel.dp * config.parallel.tp * config.parallel.cp * config.parallel.pp
    imports = ", ".join(n for n in ("FullAC", "MemoryBudgetAC", "SelectiveAC") if n == ac_name)
    lines = [
        f'"""memplan\'s plan as torchtitan 0.3.0\'s config. Save as {MODULE}.py, then, from its folder:',
        f"    PYTHONPATH=. {ALLOC_CONF}={EXPANDABLE} torchrun --nproc_per_node={gpus} \\",
        f"        -m torchtitan.train --module {MODULE} --config {FUNCTION}",
        '"""',
    ] + (["from torchtitan.components.loss import CrossEntropyLoss"] if not doc["num_mtp_layers"] else []) + (
        ["from torchtitan.components.quantization import Float8LinearConverter"] if config.training.float8 else []) + [
        "from torchtitan.config import CompileConfig, ParallelismConfig",
    ]
    if imports:
        lines.append(f"from torchtitan.distributed.activation_checkpoint import {imports}")
    lines += [
        "from torchtitan.models.common.config_utils import decoder_vocab_size",
        f"from torchtitan.models.{doc['family']} import model_registry",
        f"from torchtitan.models.{doc['family']}.config_registry import {doc['base']}",
    ] + (["from torchtitan.models.deepseek_v3.mtp import MTPLoss"] if doc["num_mtp_layers"] else []) + [
        "from torchtitan.trainer import Trainer",
        "",
        "",
        f"def {FUNCTION}() -> Trainer.Config:",
        f"    config = {doc['base']}()",
        f"    config.model_spec = model_registry(\"{doc['flavor']}\", converters={doc['converters']}"
        + (f", num_mtp_layers={doc['num_mtp_layers']})" if doc["num_mtp_layers"] else ")"),
        "    config.compile = CompileConfig(enable=True, components=[\"model\"]"
        + (", enable_async_tensor_parallel=True)" if doc["compile.enable_async_tensor_parallel"] else ")")
        if doc["compile.enable"] else
        "    config.compile = CompileConfig(enable=False)",
        f"    config.loss = {doc['loss']}.Config(global_vocab_size=decoder_vocab_size(config.model_spec))",
        f"    config.training.local_batch_size = {doc['training.local_batch_size']}",
        f"    config.training.global_batch_size = {doc['training.global_batch_size']}",
        f"    config.training.seq_len = {doc['training.seq_len']}",
    ] + ([f"    config.training.disable_cuda_graphs = True  # torchtitan's Trainer.Config refuses CUDA graphs with {graphs}"]
         if doc["training.disable_cuda_graphs"] else []) + [
        "    config.parallelism = ParallelismConfig(",
        f"        data_parallel_replicate_degree={doc['parallelism.data_parallel_replicate_degree']},",
        f"        data_parallel_shard_degree={doc['parallelism.data_parallel_shard_degree']},",
        f"        tensor_parallel_degree={doc['parallelism.tensor_parallel_degree']}, "
        f"pipeline_parallel_degree={doc['parallelism.pipeline_parallel_degree']}, context_parallel_degree={doc['parallelism.context_parallel_degree']},",
    ] + ([f"        expert_parallel_degree={doc['parallelism.expert_parallel_degree']},"] if config.model.is_moe else []) + (
        [f"        pipeline_parallel_schedule=\"{doc['parallelism.pipeline_parallel_schedule']}\", "
          f"pipeline_parallel_microbatch_size={doc['parallelism.pipeline_parallel_microbatch_size']},"]
         if config.parallel.pp > 1 else []) + (
        [f"        pipeline_parallel_layers_per_stage={doc['parallelism.pipeline_parallel_layers_per_stage']},"]
        if doc["parallelism.pipeline_parallel_layers_per_stage"] is not None else []) + [
        f"        spmd_backend=\"{doc['parallelism.spmd_backend']}\")",
        f"    config.activation_checkpoint = {ac}",
        "    return config",
    ]
    notes = [f"torchtitan 0.3.0 is configured in Python: save the block as {MODULE}.py and launch it as its docstring "
             "says (torchtitan's run_train.sh sets expandable segments the same way)",
             "the shipped configs' chunked loss (ChunkedLossWrapper) is switched off: memplan plans the plain "
             "cross-entropy, " + ("the model compiled (not the loss)" if config.training.compile else "eager") + ", "
             + ("float8 rowwise linears (the converter needs an SM89+ GPU: H100, H200)" if config.training.float8
                else "bf16")]
    if config.model.is_moe:
        ep = doc["parallelism.expert_parallel_degree"]
        notes.append(f"{'DeepSeek-V3' if config.model.is_mla else 'Qwen3 MoE'} {doc['flavor']}, expert_parallel_degree {ep}"
                     + (" (torchtitan's all-to-all dispatcher, the experts' FSDP over efsdp = dp_shard cp tp / ep) on the "
                        "partial_dtensor backend, the path memplan measured EP on (validation/titan_moe.py)" if ep > 1
                        else "") + (f", tensor_parallel_degree {config.parallel.tp}: the experts' hidden dim "
                                    "sharded over tp at ep 1, whole at ep > 1 (torchtitan 0.3.0 has no expert-TP "
                                    "setting)" if config.parallel.tp > 1 else "")
                     + ": memplan assumes balanced routing (the expert-side sizes grow with imbalance)")
        if config.model.is_mla:
            mtp = config.model.mtp_layers
            notes.append("DeepSeek-V3 as torchtitan's model_registry builds it: " + (
                         f"num_mtp_layers {mtp} with MTPLoss" if mtp else "no multi-token-prediction layers "
                         "(num_mtp_layers 0)") + ", the 671B flavour's router groups; under TP its latent projections "
                         "(wq_a, wkv_a and their norms) replicated on the whole sequence (set_deepseek_v3_sharding_"
                         "config), the shared experts colwise / rowwise")
        if doc["family"] == "qwen3" and doc["flavor"] != "30B-A3B":
            notes.append(f"torchtitan 0.3.0 ships no {doc['flavor']} config: the module starts from qwen3_30b_a3b with "
                         "the model swapped (its hf_assets_path still names Qwen3-30B-A3B's tokenizer folder)")
    if config.parallel.cp > 1:
        notes.append(f"context parallelism {config.parallel.cp} on torchtitan's partial_dtensor backend, the path "
                     "memplan measured (apply_cp_to_forward: FlexAttention's K and V all-gathered over the cp group); "
                     "FSDP2 shards over dp_shard x cp")
    if config.training.async_tp:
        notes.append("async TP (compile.enable_async_tensor_parallel): torchtitan enables symmetric memory for the TP "
                     "group and inductor's micro-pipeline pass; torchtitan's own async-TP integration tests run on H100s "
                     "with NVLink")
    if config.parallel.tp > 1:
        notes.append("TP runs torchtitan's partial_dtensor backend (DTensor TP, sequence parallel, loss parallel), "
                     "the one memplan measured on CPU; 0.3.0's default spmd_types stopped in torch 2.13's fully_shard")
    return Launch(lines, {ALLOC_CONF: EXPANDABLE}, notes, kind="torchtitan", document=doc)
