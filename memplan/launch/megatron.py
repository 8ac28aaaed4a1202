"""From plan to launch: a Config as Megatron-LM command-line arguments and the environment they need.

The flag names, their values and the environment rules are Megatron-LM's own
(megatron/training/arguments.py, megatron/core/transformer/enums.py; read at tag core_v0.16.1,
the release of the newest megatron-core wheel for Python 3.11, and still the same on main in
2026-08); tests/test_launch.py checks every flag emitted here against a list transcribed from there.
ZeRO 2 / 3 map to Megatron-FSDP's sharding strategies, HSDP to distributed-optimizer instances."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.core.spec_base import echo
from memplan.core.specs import Config
from memplan.core.training import DEFAULT_RECOMPUTE_MODULES, PRECISIONS, Recompute
from memplan.inventory.chunked_loss import launch_note as loss_chunks_note
from memplan.inventory.fp8 import launch_args as fp8_launch_args

# ZeRO stage -> Megatron-FSDP data-parallel sharding strategy (stage 1 is the distributed optimizer).
_FSDP_STRATEGY = {2: "optim_grads", 3: "optim_grads_params"}

# memplan's precision (PyTorch Lightning's names) -> Megatron-LM's flags. bf16 mixed keeps fp32 main
# gradients and fp32 master weights and Adam moments (18 B per parameter); fp16 mixed uses dynamic loss
# scaling unless --loss-scale is given. fp32 is Megatron-LM's default (no flag). bf16-true has no entry:
# Megatron-LM always keeps fp32 (at best fp16) master weights, so no flag gives a pure bf16 run.
_PRECISION_FLAGS = {"bf16-mixed": ["--bf16"], "16-mixed": ["--fp16"], "32-true": []}

# memplan's attention kernel -> Megatron-LM --attention-backend (AttnBackend in
# megatron/core/transformer/enums.py). eager: Transformer Engine's unfused attention, which
# materialises the s x s scores K22 counts; flash: FlashAttention (stores no s x s tensor).
_ATTENTION_BACKEND = {"eager": "unfused", "flash": "flash"}

CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"

# the --emit values that launch Megatron-LM (launch_refusal applies to them; accelerate / deepspeed: launch/trainer.py)
MEGATRON_EMITS = ("megatron", "bridge")
ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


@dataclass(frozen=True)
class Launch:
    """What launching one plan takes: the arguments of pretrain_gpt.py, the environment (a value of
    None: the variable must be unset) and what the arguments cannot say."""

    args: list[str]
    env: dict[str, Optional[str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    kind: str = "megatron"  # megatron: pretrain_gpt.py's arguments; bridge: Megatron-Bridge's (launch/bridge.py);
    # accelerate / deepspeed: a config file's lines (launch/trainer.py), `document` its content; torchtitan: a Python
    # module's lines (launch/titan.py), `document` the fields it sets
    document: Optional[dict] = None

    def as_dict(self) -> dict:
        """The JSON form: `megatron` (the arguments, as before), `bridge` (the overrides) or `accelerate` /
        `deepspeed` (the config file's content), `env` and `notes`."""
        body = self.document if self.document is not None else list(self.args)
        return {self.kind: body, "env": dict(self.env), "notes": list(self.notes)}

    @property
    def what(self) -> str:
        """What the block is, for the `# title` line of the report."""
        return {"bridge": "Megatron-Bridge recipe overrides", "accelerate": "an accelerate config (YAML)",
                "deepspeed": "a DeepSpeed config (JSON)", "torchtitan": "a torchtitan config (Python)"}.get(
                    self.kind, "Megatron-LM arguments")

    def env_lines(self) -> list[str]:
        """export / unset lines; commented out when the block is a Python file (torchtitan: its docstring says
        how to launch with them)."""
        lines = [f"export {name}={value}" if value is not None else f"unset {name}" for name, value in self.env.items()]
        return [f"# {line}" for line in lines] if self.kind == "torchtitan" else lines

    def args_block(self) -> str:
        """The arguments one per line with ` \\` continuations: paste after `torchrun ... pretrain_gpt.py`."""
        return "\n".join(self.args) if self.document is not None else " \\\n".join(self.args)

    def block(self) -> str:
        """The environment lines, then the arguments: what `search --emit megatron --emit-only` prints."""
        return "\n".join(self.env_lines() + [self.args_block()])

    def script(self, title: str) -> str:
        """The block under a `# title` comment and `# note:` comments: a shell snippet for the report."""
        return "\n".join([f"# {title}"] + [f"# note: {n}" for n in self.notes] + [self.block()])


def megatron_launch(config: Config, impl: str = "megatron", alloc_conf: str = "") -> Launch:
    """The plan as Megatron-LM arguments, environment and notes; `impl` megatron-local is --transformer-impl local
    (transformer_engine, the default, gets no flag); `alloc_conf`: the PYTORCH_CUDA_ALLOC_CONF the plan fits with
    (memplan/memory/reserved.py launch_alloc_conf; "" for the default allocator), exported."""
    m, par, tr = config.model, config.parallel, config.training
    refusal = launch_refusal(m)
    if refusal:
        raise MemplanError(refusal)
    notes: list[str] = []
    args = [
        f"--num-layers {m.num_layers}",
        f"--hidden-size {m.hidden_size}",
        f"--num-attention-heads {m.num_attention_heads}",
        f"--ffn-hidden-size {m.f}",
        f"--seq-length {m.seq_length}",
        # a learned table's rows (the count memplan plans); otherwise the sequence length
        f"--max-position-embeddings {m.position_rows if m.position_embedding == 'learned' and m.position_rows else m.seq_length}",
    ]
    if m.q != m.hidden_size and not m.is_mla:  # heads not h/a wide (Mistral-Nemo): --kv-channels (default h/a)
        args.append(f"--kv-channels {m.head_dim}")
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
    if m.qk_norm:
        args.append("--qk-layernorm")
    args += _architecture(config, notes)
    args += _latent_attention(config) + _experts(config) + _kernels(config, impl)
    if impl != "megatron-local":  # the local spec runs its own DotProductAttention whatever the backend says
        args.append(f"--attention-backend {_ATTENTION_BACKEND[m.attention]}")
    args += [f"--tensor-model-parallel-size {par.tp}"] + _pipeline(config)
    if par.sp:
        args.append("--sequence-parallel")
    # context / expert parallelism (memplan/memory/parallel.py): names as Megatron-LM's ModelParallelConfig fields and
    # arguments.py define them (docs/user-guide/parallelism-guide.md)
    if par.cp > 1:
        args += [f"--context-parallel-size {par.cp}", f"--cp-comm-type {par.cp_comm_type}"]
    if par.ep > 1:
        args.append(f"--expert-model-parallel-size {par.ep}")
    if m.is_moe and par.expert_tp != par.tp:
        args.append(f"--expert-tensor-parallel-size {par.expert_tp}")
    if tr.recompute == Recompute.SELECTIVE:
        args.append("--recompute-granularity selective")
        if tr.recompute_modules != DEFAULT_RECOMPUTE_MODULES:  # Megatron-LM's default: core_attn
            args.append(f"--recompute-modules {' '.join(tr.recompute_modules)}")
    elif tr.recompute == Recompute.FULL:
        n = tr.recompute_num_layers
        if n is None or (n == config.layers_per_chunk and tr.recompute_method != "block"):
            args += ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
        else:
            args += ["--recompute-granularity full", "--recompute-method block", f"--recompute-num-layers {n}"]
    args += [f"--micro-batch-size {tr.micro_batch}", f"--global-batch-size {config.global_batch}"]
    if par.zero >= 1:
        args.append("--use-distributed-optimizer")
        if par.shard < par.dp:  # HSDP: d / shard replicas (also Megatron-FSDP's outer data-parallel group)
            args.append(f"--num-distributed-optimizer-instances {par.dp // par.shard}")
    if par.zero >= 2:
        args += ["--use-megatron-fsdp", f"--data-parallel-sharding-strategy {_FSDP_STRATEGY[par.zero]}",
                 "--ckpt-format fsdp_dtensor"]
        if "gradient-accumulation" not in tr.fusions_off:  # else _kernels gives it
            args.append("--no-gradient-accumulation-fusion")
    muon = tr.optimizer == "muon" and par.zero == 0
    if par.dp > 1 and not muon:  # Megatron-LM's Muon refuses to overlap them (arguments.py, below)
        args += ["--overlap-grad-reduce"] + (["--overlap-param-gather"] if par.zero >= 1 else [])
    args += _optimizer(tr.optimizer, par.zero, notes)
    args += _offload(config, notes)
    args += _precision(tr.precision, notes)
    args += fp8_launch_args(tr, par.zero, notes)
    if tr.loss_chunks > 1:
        notes.append(loss_chunks_note(tr.loss_chunks))
    if {k: getattr(tr, k) for k in PRECISIONS[tr.precision]} != PRECISIONS[tr.precision]:
        notes.append(f"the model's training: section overrides the byte sizes of {tr.precision}; the arguments "
                     f"follow {tr.precision}, Megatron-LM's memory may differ from the plan's")
    env = _environment(config, notes)
    if alloc_conf:
        env[ALLOC_CONF] = alloc_conf
        notes.append(f"{ALLOC_CONF}={alloc_conf}: the caching allocator's settings the plan fits with (memplan's "
                     "replay of the run through PyTorch's caching allocator; derived, not measured)")
    return Launch(args, env, notes)


def launch_refusal(model: ModelSpec) -> Optional[str]:
    """Why no Megatron-LM arguments build this model (None: they do). Its gated MLP must be SiLU-gated: --swiglu
    is gated_linear_unit with F.silu, --quick-geglu x * sigmoid(1.702 x) (arguments.py core_args_from_args at
    core_v0.16.1 and main), and no flag gives the GeLU gate of Gemma (gelu_pytorch_tanh)."""
    if model.encoder_kind:  # memplan/presets/hf_encoders.py
        return (f"--emit megatron: {echo(model.name)} is {model.encoder_description}, which Megatron-LM's GPTModel "
                "does not build: no launch is given for it")
    if model.mlp == "swiglu" and model.gate_activation == "relu2":
        return (f"--emit megatron: {echo(model.name)}'s MLP is gated by a squared ReLU (BitNet): Megatron-LM's "
                "--swiglu is SiLU-gated, so no Megatron-LM argument builds this model")
    if model.mlp == "swiglu" and model.gate_activation == "gelu":
        return (f"--emit megatron: {echo(model.name)}'s MLP is GeLU-gated (GeGLU, as Gemma's): Megatron-LM's --swiglu "
                "is SiLU-gated and --quick-geglu is x * sigmoid(1.702 x), so no Megatron-LM argument builds this model")
    if model.mla_indexer:
        return (f"--emit megatron: {echo(model.name)} has a lightning indexer (DeepSeek sparse attention): memplan's "
                "Megatron-LM inventories do not model megatron-core's experimental DSA (experimental_attention_variant "
                "dsa, its indexer trained by a KL loss): no launch is given for it")
    # the layouts of transformers' other families (memplan/core/model.py): GPTModel's layer is a sequential pre-norm
    # block with every linear biased or none (--add-bias-linear), Q and K norms per head (--qk-layernorm)
    layouts = [(model.layer_layout == "parallel", "attention and MLP in parallel"),
               (model.layer_layout == "post-norm", "norms on the sub-layers' outputs (post-norms)"),
               (model.norms_per_layer not in (None, 2), f"{model.norms_per_layer} norm(s) per layer"),
               (model.attention_bias and not model.bias, "biases on the attention's projections only"),
               (model.head_bias, "a bias on the output head"), (model.attention_sinks, "attention sinks"),
               (model.attention_output_gate is not None, "a gate on the attention output"),
               (model.differential_attention, "differential attention"), (model.dynamic_mask, "dynamic-mask attention"),
               (model.looped_stacks, "stacks run in a loop (HRM)"),
               (model.activation_params > 0, "learned activation parameters"),
               (model.sub_norms, "norms inside the attention and the MLP (sub-norms)"),
               (model.moe_bias, "biased router and experts"), (model.moe_router_bias, "a biased router"),
               (model.mlp_bias and not model.bias, "biases on the MLP's linears only"),
               (model.out_bias and not model.bias, "a bias on the attention output alone"),
               (model.moe_shared_gate, "a gate on the shared experts"),
               (model.moe_block_norms > 0, "norms in the MoE block"),
               (model.mla_query_gate, "a gate on the attention output from the query latent"),
               (model.gated_norm_rank > 0, "low-rank gates on the norms"),
               (model.value_head_dim is not None, "V heads narrower than the Q / K heads"), (not model.norm_params, "norms without weights"),
               (not model.final_norm, "no final norm"),
               (model.position_offset > 0, "position rows beyond the sequence"),
               (model.embedding_norm, "a norm on the embeddings"),
               (model.qk_norm and model.qk_norm_width == "full", "Q and K norms over the whole width"),
               (model.norm == "layernorm" and model.norm_bias is False, "LayerNorms without a bias"),
               # Megatron-LM's MambaModel (--hybrid-override-pattern) builds hybrids; memplan emits GPTModel only
               (model.layer_pattern is not None, "state-space mixer blocks (layer_pattern: a hybrid, MambaModel)")]
    missing = [what for on, what in layouts if on]
    if missing:
        return (f"--emit megatron: {echo(model.name)} has {', '.join(missing)}, which no Megatron-LM argument builds "
                "(its GPTModel layer is sequential pre-norm): no launch is given for it")
    return None


def _architecture(config: Config, notes: list[str]) -> list[str]:
    """What else the model needs to be the same model in Megatron-LM (TransformerConfig fields at core_v0.16.1 and
    main made flags by ArgumentGroupFactory, or arguments.py's own): --rotary-base (an int in arguments.py),
    --norm-epsilon (layernorm_epsilon's arg_names), --add-qkv-bias (add_qkv_bias; implied by bias on every linear,
    validate_args), --window-size left,right (TransformerConfig.window_size, TE's (W - 1, 0) for a window of W
    tokens, as Megatron-Bridge converts transformers' sliding_window) and --window-attn-skip-freq N (one
    full-attention layer after N - 1 sliding ones)."""
    m = config.model
    args: list[str] = []
    if m.position_embedding == "rope" and m.rope_theta is not None:
        if m.rope_theta == int(m.rope_theta):
            args.append(f"--rotary-base {int(m.rope_theta)}")
        else:
            notes.append(f"RoPE base {m.rope_theta:g} is not an integer, which Megatron-LM's --rotary-base (type int) "
                         "requires: no flag is given (Megatron-LM uses 10000)")
    if m.norm_eps is not None:
        args.append(f"--norm-epsilon {m.norm_eps:g}")
    if m.qkv_bias and not m.bias:
        args.append("--add-qkv-bias")
    if m.sliding_window is not None:
        args.append(f"--window-size {m.sliding_window - 1},0")
        if m.sliding_window_pattern is not None:
            args.append(f"--window-attn-skip-freq {m.sliding_window_pattern}")
    if m.sandwich_norms:
        notes.append("the norms on the attention's and the MLP's outputs (sandwich_norms, Gemma 2 / 3) have no "
                     "Megatron-LM argument: Megatron-LM builds the layer without them")
    return args


def _pipeline(config: Config) -> list[str]:
    """Pipeline parallelism: p, interleaving and an uneven split. Megatron-LM (arguments.py validate_args at
    core_v0.16.1 and main) refuses --num-layers-per-virtual-pipeline-stage with uneven stages and asks for
    --num-virtual-stages-per-pipeline-rank; --decoder-first/last-pipeline-num-layers become TransformerConfig's
    num_layers_in_first/last_pipeline_stage (megatron/training/argument_utils.py), which
    get_num_layers_to_build (megatron/core/transformer/transformer_block.py) splits as memplan does."""
    par = config.parallel
    args = [f"--pipeline-model-parallel-size {par.pp}"]
    if config.uneven:
        first, _, last = config.split
        args += [f"--decoder-first-pipeline-num-layers {first}", f"--decoder-last-pipeline-num-layers {last}"]
        if par.vpp > 1:
            args.append(f"--num-virtual-stages-per-pipeline-rank {par.vpp}")
    elif par.vpp > 1:
        args.append(f"--num-layers-per-virtual-pipeline-stage {config.layers_per_chunk}")
    return args


def _latent_attention(config: Config) -> list[str]:
    """Multi-head latent attention (MLATransformerConfig in megatron/core/transformer/transformer_config.py: its
    qk_head_dim is the part of a head without rotary embedding, d_n; qk_pos_emb_head_dim the rotated part, d_r;
    --q-lora-rank left out: queries projected from h directly; --qk-layernorm: MLA's q / kv latent norms, which
    memplan/inventory/mla.py and states.py count) and multi-token prediction (--mtp-num-layers, Megatron-LM
    megatron/training/arguments.py _add_mtp_args)."""
    m = config.model
    mtp = [f"--mtp-num-layers {m.mtp_layers}"] if m.mtp_layers else []
    if not m.is_mla:
        return mtp
    return (["--multi-latent-attention"] + ([f"--q-lora-rank {m.q_lora_rank}"] if m.q_lora_rank else [])
            + [f"--kv-lora-rank {m.kv_lora_rank}", f"--qk-head-dim {m.qk_nope_head_dim}",
               f"--qk-pos-emb-head-dim {m.qk_rope_head_dim}", f"--v-head-dim {m.v_head_dim}"]
            + ([] if m.qk_norm else ["--qk-layernorm"]) + mtp)


def _experts(config: Config) -> list[str]:
    """Mixture of experts: the model's experts (the plan's expert parallelism is added beside, by the plan).
    --moe-layer-freq takes a Python list expression of 0 (dense) and 1 (MoE) per layer (arguments.py
    moe_freq_type / _eval_pattern), quoted for the shell."""
    m = config.model
    if not m.is_moe:
        return []
    args = [f"--num-experts {m.num_experts}", f"--moe-router-topk {m.moe_top_k}", f"--moe-ffn-hidden-size {m.fe}"]
    if m.moe_shared_ffn_hidden_size:
        args.append(f"--moe-shared-expert-intermediate-size {m.moe_shared_ffn_hidden_size}")
    if m.moe_first_dense_layers:
        args.append(f"--moe-layer-freq '[0]*{m.moe_first_dense_layers}+[1]*{m.moe_layers}'")
    # the routing memplan's MoE inventory assumed (memplan/inventory/moe.py): TransformerConfig's
    # moe_token_dispatcher_type, moe_expert_capacity_factor, moe_pad_expert_input_to_capacity
    args.append(f"--moe-token-dispatcher-type {m.moe_token_dispatcher}")
    if m.moe_token_dispatcher == "flex":  # the backend memplan models (memplan/inventory/moe.py _flex_terms)
        args.append("--moe-flex-dispatcher-backend deepep")
    if m.moe_capacity_factor is not None:
        args.append(f"--moe-expert-capacity-factor {m.moe_capacity_factor:g}")
    if m.moe_pad_to_capacity:
        args.append("--moe-pad-expert-input-to-capacity")
    # the router's options (TransformerConfig moe_aux_loss_coeff, moe_z_loss_coeff, moe_router_dtype,
    # moe_router_pre_softmax: megatron-core requires the last for k = 1)
    if m.moe_aux_loss_coeff:
        args.append(f"--moe-aux-loss-coeff {m.moe_aux_loss_coeff:g}")
    if m.moe_z_loss_coeff is not None:
        args.append(f"--moe-z-loss-coeff {m.moe_z_loss_coeff:g}")
    if m.moe_router_dtype:
        args.append(f"--moe-router-dtype {m.moe_router_dtype}")
    if m.moe_router_pre_softmax or m.moe_top_k == 1:
        args.append("--moe-router-pre-softmax")
    # the experts' kernels and streams (TransformerConfig moe_grouped_gemm, moe_permute_fusion,
    # moe_shared_expert_overlap; store_true in Megatron-LM)
    args += [flag for flag, on in (("--moe-grouped-gemm", m.moe_grouped_gemm), ("--moe-permute-fusion",
             m.moe_permute_fusion), ("--moe-shared-expert-overlap", m.moe_shared_expert_overlap)) if on]
    return args


def megatron_args(config: Config, impl: str = "megatron") -> list[str]:
    """The plan as Megatron-LM command-line arguments ("--flag value" strings)."""
    return megatron_launch(config, impl).args


def _kernels(config: Config, impl: str) -> list[str]:
    """--transformer-impl local for megatron-core's local spec, the fusions switched off (memplan/inventory/
    fusions.py), under Megatron-LM's names (arguments.py at core_v0.16.1: --no-<name>-fusion, store_false), and the
    fused cross-entropy (--cross-entropy-loss-fusion, --cross-entropy-fusion-impl native|te)."""
    args = ["--transformer-impl local"] if impl == "megatron-local" else []
    # core_transformer_config_from_args: bias_activation_fusion is bias_swiglu_fusion with --swiglu, else
    # bias_gelu_fusion, so the other activation's switch does nothing and is not emitted
    idle = "bias-gelu" if config.model.mlp == "swiglu" else "bias-swiglu"
    args += [f"--no-{name}-fusion" for name in config.training.fusions_off if name != idle]
    if config.training.cross_entropy_fusion:  # ModelParallelConfig.cross_entropy_loss_fusion / _fusion_impl
        args += ["--cross-entropy-loss-fusion", f"--cross-entropy-fusion-impl {config.training.cross_entropy_fusion}"]
    if config.training.memory_efficient_layer_norm:  # TransformerConfig.memory_efficient_layer_norm (apex)
        args.append("--memory-efficient-layer-norm")
    return args


def _optimizer(optimizer: str, zero: int, notes: list[str]) -> list[str]:
    """Megatron-LM's --optimizer (arguments.py at core_v0.16.1: adam, the default, which is AdamW's
    decoupled weight decay; sgd with --sgd-momentum, default 0.9; muon: Muon on the 2-D hidden weights,
    Adam on the rest, megatron/core/optimizer/muon.py, which refuses the distributed optimizer, FSDP and
    overlapped gradient reduction or parameter gathering). No Adafactor, 8-bit Adam or Lion there."""
    if optimizer == "adamw":
        return []
    if optimizer == "sgd":
        return ["--optimizer sgd"]
    if optimizer == "sgd-nomomentum":
        return ["--optimizer sgd", "--sgd-momentum 0.0"]
    if optimizer == "muon":
        if zero == 0:
            return ["--optimizer muon"]
        notes.append(f"Megatron-LM's Muon (core_v0.16.1) refuses the distributed optimizer and FSDP that ZeRO-{zero} "
                     "needs: no --optimizer is given (Adam runs); plan with --zero 0 to launch with --optimizer muon")
        return []
    notes.append(f"Megatron-LM (core_v0.16.1) has no {optimizer} optimizer: no --optimizer is given (Adam runs, whose "
                 "states differ from the plan's)")
    return []


def _offload(config: Config, notes: list[str]) -> list[str]:
    """Offload as Megatron-LM launches it (core_v0.16.1). Optimizer: --optimizer-cpu-offload and
    --optimizer-offload-fraction (megatron/training/arguments.py:2059-2062), which arguments.py:1189-1194 allows only
    with --use-precision-aware-optimizer (2840), which is Adam-only and needs the distributed optimizer
    (megatron/core/optimizer/optimizer_config.py:375-381). Activations: Megatron-LM has layer offloading,
    --cpu-offloading-num-layers N (a TransformerConfig field, ModelParallelConfig.cpu_offloading_num_layers, turned
    into a flag by ArgumentGroupFactory: arguments.py:1574-1577 exclude only cpu_offloading and its sub-switches,
    1621; N > 0 turns cpu_offloading on, 1236-1237), N < L, no pipeline parallelism, no recompute
    (transformer_config.py:1137-1152); torch's save_on_cpu, which memplan models, has no flag."""
    m, par, tr = config.model, config.parallel, config.training
    args: list[str] = []
    fraction = tr.offload_optimizer_fraction
    if fraction > 0:
        if tr.optimizer != "adamw":
            notes.append(f"Megatron-LM's optimizer CPU offload needs --use-precision-aware-optimizer, which is Adam-only "
                         f"(megatron/core/optimizer/optimizer_config.py:375-378): no offload flag is given for "
                         f"{tr.optimizer}")
        elif par.zero >= 2:
            notes.append("Megatron-LM's optimizer CPU offload with Megatron-FSDP (ZeRO 2 / 3) is not checked: no offload "
                         "flag is given; plan with --zero 1 to launch with --optimizer-cpu-offload")
        elif par.zero == 0 and par.dp > 1:
            notes.append("Megatron-LM's optimizer CPU offload needs the distributed optimizer (--use-precision-aware-"
                         "optimizer requires it, optimizer_config.py:379-381): no offload flag is given; plan with "
                         "--zero 1 to launch with --optimizer-cpu-offload")
        else:
            if par.zero == 0:  # d = 1: the distributed optimizer shards nothing, the same memory
                args.append("--use-distributed-optimizer")
            args += ["--use-precision-aware-optimizer", "--optimizer-cpu-offload",
                     f"--optimizer-offload-fraction {fraction:g}"]
    if tr.offload_activations:
        if par.pp > 1:
            notes.append("Megatron-LM's activation offloading (--cpu-offloading-num-layers) refuses pipeline parallelism "
                         "(megatron/core/transformer/transformer_config.py:1144-1147): no flag is given; torch's "
                         "save_on_cpu, which memplan models, has no Megatron-LM flag")
        else:
            args.append(f"--cpu-offloading-num-layers {m.num_layers - 1}")
            notes.append(f"--cpu-offloading-num-layers offloads at most L - 1 = {m.num_layers - 1} layers "
                         "(transformer_config.py:1137-1142): the last layer's saved tensors stay on the GPU, where "
                         "memplan's first backward has them too. Transformer Engine's offloader (cpu_offload.py "
                         "OffloadSynchronizer, read at TE commit 00382b96) then keeps at most L - N = 1 layer's "
                         "activations on the GPU, as memplan's torch save_on_cpu model does, but copies on a side "
                         "stream a layer ahead and keeps weights and tensors under 1 MB on the GPU (no host copy): "
                         "the GPU bytes match to about one layer's small tensors, the host bytes and copy time are "
                         "memplan's upper bound (derived, not measured)")
    return args


def _precision(precision: str, notes: list[str]) -> list[str]:
    if precision in _PRECISION_FLAGS:
        return list(_PRECISION_FLAGS[precision])
    notes.append(f"{precision} (bf16 weights, gradients and moments, no master copy) has no Megatron-LM "
                 "equivalent, which always keeps higher-precision master weights: no precision flag is given; "
                 "the nearest is --bf16 (bf16-mixed, 18 B per parameter): plan with --precision bf16-mixed to "
                 "launch with it")
    return []


def _environment(config: Config, notes: list[str]) -> dict[str, Optional[str]]:
    """CUDA_DEVICE_MAX_CONNECTIONS as megatron/training/arguments.py validates it: tensor parallelism
    asserts it is 1 (on GPUs before Blackwell, which all of memplan's presets are), so that its
    communication kernels are scheduled before the GEMMs they overlap with; Megatron-FSDP asserts it
    is not 1 (and wins when both are on: arguments.py only warns for TP + FSDP)."""
    par = config.parallel
    model_parallel = par.tp > 1 or par.cp > 1  # arguments.py asks for it with context parallelism too
    if par.zero >= 2:
        if model_parallel:
            notes.append(f"Megatron-FSDP requires {CONNECTIONS} unset (or > 1), which slows the overlap of "
                         f"{'tensor' if par.tp > 1 else 'context'}-parallel communication")
        return {CONNECTIONS: None}
    if model_parallel:
        return {CONNECTIONS: "1"}
    return {}
