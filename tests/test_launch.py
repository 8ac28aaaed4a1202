"""`search --emit megatron`: Megatron-LM's real flags, precision and attention backend, the environment,
the paste-ready --emit-only block, the JSON document and the refused combinations."""

import json
import re
import shlex
import shutil
import subprocess

import pytest

from memplan.launch.megatron import CONNECTIONS, megatron_args, megatron_launch
from memplan.core.model import ModelSpec
from memplan.core.specs import Config, ParallelSpec
from memplan.core.training import FUSIONS, TrainingSpec

# Every flag memplan can emit, as Megatron-LM's own argument parser defines it: None for a switch
# (store_true / store_false, no value), a type for a value, a tuple for its choices. Transcribed from
# the parser that megatron/training/arguments.py builds (add_megatron_arguments) in NVIDIA/Megatron-LM at
# tag core_v0.16.1 (commit 55ac7082517c3878ae653c07c09c534b8aed49f6, the release of the newest
# megatron-core wheel for Python 3.11, which does not ship megatron/training), the attention backends
# from AttnBackend in megatron/core/transformer/enums.py there; checked again on main at commit
# d98e8a64ddf34856e74b24714e3bedb2f5a39553 (2026-08-22), which only adds choices (position embedding
# 'yarn', more optimizers). Choices list only what both define.
MEGATRON_FLAGS = {
    "--num-layers": int,
    "--hidden-size": int,
    "--num-attention-heads": int,
    "--ffn-hidden-size": int,
    "--seq-length": int,
    "--max-position-embeddings": int,
    "--kv-channels": int,
    "--group-query-attention": None,
    "--num-query-groups": int,
    "--swiglu": None,
    "--normalization": ("LayerNorm", "RMSNorm"),
    "--position-embedding-type": ("learned_absolute", "rope", "mrope", "relative", "none"),
    "--untie-embeddings-and-output-weights": None,
    "--disable-bias-linear": None,
    "--attention-dropout": float,
    "--hidden-dropout": float,
    "--attention-backend": ("flash", "fused", "unfused", "local", "auto"),
    "--tensor-model-parallel-size": int,
    "--pipeline-model-parallel-size": int,
    "--num-layers-per-virtual-pipeline-stage": int,
    "--sequence-parallel": None,
    "--recompute-granularity": ("full", "selective"),
    "--recompute-method": ("uniform", "block"),
    "--recompute-num-layers": int,
    "--micro-batch-size": int,
    "--global-batch-size": int,
    "--use-distributed-optimizer": None,
    "--num-distributed-optimizer-instances": int,
    "--use-megatron-fsdp": None,
    "--data-parallel-sharding-strategy": ("no_shard", "optim", "optim_grads", "optim_grads_params"),
    "--no-gradient-accumulation-fusion": None,
    # kernels and fusions (memplan/launch/megatron.py _kernels): arguments.py _add_training_args at core_v0.16.1
    # (store_false switches); --transformer-impl is TransformerConfig.transformer_impl made a flag by
    # ArgumentGroupFactory (arguments.py:1621; transformer_config.py:880: 'local', 'transformer_engine', ...)
    "--transformer-impl": ("local", "transformer_engine"),
    "--no-masked-softmax-fusion": None,
    "--no-bias-gelu-fusion": None,
    "--no-bias-swiglu-fusion": None,
    "--no-bias-dropout-fusion": None,
    "--no-rope-fusion": None,
    # the fused cross-entropy: arguments.py _add_training_args '--cross-entropy-loss-fusion' (store_true, dest
    # cross_entropy_loss_fusion; read in NVIDIA/Megatron-LM's stored arguments.py); '--cross-entropy-fusion-impl'
    # sets ModelParallelConfig.cross_entropy_fusion_impl (Literal['native', 'te'] in megatron-core 0.16.1's
    # model_parallel_config.py), the flag seen in Megatron-LM launch scripts for MCore 0.16, not in its parser here
    "--cross-entropy-loss-fusion": None,
    "--cross-entropy-fusion-impl": ("native", "te"),
    # apex's memory-efficient LayerNorm (TransformerConfig.memory_efficient_layer_norm): arguments.py
    # '--memory-efficient-layer-norm' (store_true), as Megatron-LM's argument docs list it
    "--memory-efficient-layer-norm": None,
    "--ckpt-format": ("torch", "torch_dist", "torch_dcp", "fsdp_dtensor"),
    "--overlap-grad-reduce": None,
    "--overlap-param-gather": None,
    "--optimizer": ("adam", "sgd", "muon", "dist_muon"),
    "--sgd-momentum": float,
    # optimizer and activation offload (memplan/launch/megatron.py _offload): arguments.py:2059-2062 and 2840 at core_v0.16.1;
    # --cpu-offloading-num-layers is TransformerConfig's cpu_offloading_num_layers (ModelParallelConfig, an int),
    # made a flag by ArgumentGroupFactory (arguments.py:1621; megatron/training/argument_utils.py:71-82)
    "--use-precision-aware-optimizer": None,
    "--optimizer-cpu-offload": None,
    "--optimizer-offload-fraction": float,
    "--cpu-offloading-num-layers": int,
    "--bf16": None,
    "--fp16": None,
    # FP8 (memplan/inventory/fp8.py launch_args), read on main at d98e8a6 only: TransformerConfig's fp8 (arg_names
    # --fp8-format), fp8_recipe, fp8_amax_history_len (megatron/core/transformer/transformer_config.py), made flags by
    # ArgumentGroupFactory; --fp8-param-gather is arguments.py's own (store_true)
    "--fp8-format": ("e4m3", "hybrid"),
    "--fp8-recipe": ("tensorwise", "delayed", "mxfp8", "blockwise", "custom"),
    "--fp8-amax-history-len": int,
    "--fp8-param-gather": None,
    # Uneven pipeline stages, mixture of experts and multi-head latent attention (memplan/launch/megatron.py _pipeline,
    # _experts, _latent_attention), checked in the parser itself: NVIDIA/Megatron-LM's megatron/training/arguments.py
    # add_megatron_arguments, built from the sources at core_v0.16.1 (commit 55ac7082517c3878ae653c07c09c534b8aed49f6)
    # and at main commit d98e8a64ddf34856e74b24714e3bedb2f5a39553 (2026-08-22), its option strings listed with their
    # actions and types; the same in both. --decoder-first/last-pipeline-num-layers are _add_distributed_args'
    # (arguments.py); the others come from TransformerConfig / MLATransformerConfig fields through
    # ArgumentGroupFactory (megatron/training/argument_utils.py), --num-experts from arguments.py itself (its
    # TransformerConfig field is num_moe_experts). --moe-layer-freq's type is arguments.py moe_freq_type: an int, or
    # a Python list expression of 0 / 1 per layer made of digits, brackets, parentheses, '+', '*' and commas.
    "--decoder-first-pipeline-num-layers": int,
    "--decoder-last-pipeline-num-layers": int,
    "--num-virtual-stages-per-pipeline-rank": int,
    "--qk-layernorm": None,
    "--multi-latent-attention": None,
    "--q-lora-rank": int,
    "--kv-lora-rank": int,
    "--qk-head-dim": int,
    "--qk-pos-emb-head-dim": int,
    "--v-head-dim": int,
    "--num-experts": int,
    "--moe-router-topk": int,
    "--moe-ffn-hidden-size": int,
    "--moe-shared-expert-intermediate-size": int,
    "--moe-layer-freq": "moe_freq",
    # multi-token prediction (memplan/launch/megatron.py _latent_attention): Megatron-LM megatron/training/arguments.py
    # _add_mtp_args: group.add_argument('--mtp-num-layers', type=int, default=None)
    "--mtp-num-layers": int,
    # MoE routing (memplan/launch/megatron.py _experts): TransformerConfig fields moe_token_dispatcher_type (Literal 'allgather',
    # 'alltoall', 'flex'), moe_expert_capacity_factor (Optional[float]) and moe_pad_expert_input_to_capacity (bool) in
    # megatron-core 0.16.1 (megatron/core/transformer/transformer_config.py, as installed by the test extra); Megatron-LM's
    # arguments.py _add_moe_args: --moe-expert-capacity-factor type=float, --moe-pad-expert-input-to-capacity
    # store_true, --moe-token-dispatcher-type with those choices
    "--moe-token-dispatcher-type": ("allgather", "alltoall", "flex"),
    "--moe-expert-capacity-factor": float,
    "--moe-pad-expert-input-to-capacity": None,
    # the router's options (memplan/launch/megatron.py _experts), in the mirror of NVIDIA/Megatron-LM main at commit
    # d98e8a64ddf34856e74b24714e3bedb2f5a39553: arguments.py _add_moe_args --moe-aux-loss-coeff type=float nargs='+'
    # (one value given); from TransformerConfig through ArgumentGroupFactory: moe_z_loss_coeff Optional[float],
    # moe_router_dtype Optional[Literal['fp32', 'fp64']] (choices), moe_router_pre_softmax bool = False (store_true);
    # the same fields in megatron-core 0.16.1's TransformerConfig
    "--moe-aux-loss-coeff": float,
    "--moe-z-loss-coeff": float,
    "--moe-router-dtype": ("fp32", "fp64"),
    "--moe-router-pre-softmax": None,
    # the experts' kernels and streams (memplan/launch/megatron.py _experts): megatron-core 0.16.1 TransformerConfig
    # moe_grouped_gemm, moe_permute_fusion, moe_shared_expert_overlap, each bool = False (store_true through
    # ArgumentGroupFactory); Megatron-LM's arguments.py _add_moe_args has --moe-grouped-gemm action='store_true'
    "--moe-grouped-gemm": None,
    # TransformerConfig moe_flex_dispatcher_backend: Literal['deepep', 'hybridep'] = "deepep" (megatron-core 0.16.1)
    "--moe-flex-dispatcher-backend": ("deepep", "hybridep"),
    "--moe-permute-fusion": None,
    "--moe-shared-expert-overlap": None,
    # the model's own settings (memplan/launch/megatron.py _architecture), read at core_v0.16.1 and main d98e8a6:
    # arguments.py _add_network_size_args: --rotary-base type=int, --window-size type=tuple_type ("a,b" -> (a, b)),
    # --window-attn-skip-freq type=moe_freq_type (an int N: N - 1 sliding layers, then one full); TransformerConfig
    # layernorm_epsilon (arg_names ["--norm-epsilon"], a float) and add_qkv_bias (a bool defaulting to False:
    # store_true, megatron/training/argument_utils.py) through ArgumentGroupFactory
    "--rotary-base": int,
    "--norm-epsilon": float,
    "--add-qkv-bias": None,
    "--window-size": "int_tuple",
    "--window-attn-skip-freq": int,
}


def int_tuple(value):
    """A --window-size value as arguments.py tuple_type reads it: integers separated by commas."""
    return tuple(int(i) for i in value.strip("()").split(","))


def moe_freq(value):
    """A --moe-layer-freq value as Megatron-LM's moe_freq_type reads it (after the shell's quotes): a list of 0 / 1."""
    (text,) = shlex.split(value)
    assert re.fullmatch(r"[,\d\[\]\(\)\+\*]+", text), text  # arguments.py _eval_pattern's character check
    layers = eval(text)  # only digits and list operators, as Megatron-LM itself evaluates it
    assert isinstance(layers, list) and set(layers) <= {0, 1}
    return layers

GPT = dict(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048, vocab_size=51200)
LLAMA = dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_kv_heads=8, ffn_hidden_size=14336,
             seq_length=8192, vocab_size=128256, norm="rmsnorm", mlp="swiglu", position_embedding="rope",
             tied_embeddings=False, dropout=False, bias=False, attention="flash")


MIXTRAL = dict(LLAMA, num_layers=8, num_experts=8, moe_top_k=2, ffn_hidden_size=14336, seq_length=4096,
               vocab_size=32000)
DEEPSEEK = dict(LLAMA, num_layers=8, num_attention_heads=16, num_kv_heads=None, hidden_size=2048, num_experts=64,
                moe_top_k=6, moe_ffn_hidden_size=1408, moe_shared_ffn_hidden_size=2816, moe_first_dense_layers=1,
                kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


def config(model=GPT, **kw):
    parallel = {k: kw.pop(k) for k in ("tp", "pp", "dp", "vpp", "sp", "zero", "zero_shard", "first_stage_layers",
                                       "last_stage_layers") if k in kw}
    model = {**model, **{k: kw.pop(k) for k in ("attention", "head_dim") if k in kw}}
    return Config(model=ModelSpec(**model), parallel=ParallelSpec(**parallel), training=TrainingSpec(**kw))


# one of every branch of megatron_launch
GRID = [
    config(),
    config(LLAMA, tp=4, pp=2, dp=4, sp=True, zero=1, zero_shard=2, recompute="selective", micro_batch=2),
    config(tp=2, pp=4, dp=2, vpp=3, sp=True, recompute="full", global_batch=64),
    config(tp=2, pp=4, dp=2, vpp=3, recompute="full", recompute_num_layers=1, precision="16-mixed"),
    config(tp=2, dp=8, zero=2, precision="32-true", optimizer="sgd"),
    config(dp=8, optimizer="sgd-nomomentum"),
    config(dp=8, optimizer="muon"),
    config(LLAMA, dp=16, zero=3, zero_shard=4, precision="bf16-true", attention="eager"),
    config(dict(GPT, hidden_size=2560), head_dim=128, tp=2),  # heads not h/a wide: --kv-channels
    config(dp=8, zero=1, offload_optimizer_fraction=0.5),  # optimizer offload
    config(dict(LLAMA, qkv_bias=True, rope_theta=1e6, norm_eps=1e-6, sliding_window=4096, sliding_window_pattern=6),
           dp=2),  # the model's own settings: QKV bias, RoPE base, norm epsilon, sliding windows
    config(tp=2, sp=True, offload_activations=True),  # activation offload: layer offloading, p = 1
    # (the FP8 plans stay last: test_fp8_flags_and_chunked_loss_note takes them by position)
    config(pp=4, dp=2, first_stage_layers=5, last_stage_layers=5, global_batch=16),  # uneven stages
    config(pp=4, dp=2, vpp=2, first_stage_layers=4, last_stage_layers=4, global_batch=16),  # uneven + interleaving
    config(MIXTRAL, tp=2, pp=2, dp=2, sp=True),  # experts (MoE with t > 1 needs SP)
    config(dict(MIXTRAL, moe_capacity_factor=1.25, moe_pad_to_capacity=True, moe_token_dispatcher="allgather"),
           dp=2),  # MoE routing: token dropping, padding, the dispatcher
    config(dict(MIXTRAL, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001, moe_router_dtype="fp32",
                moe_router_pre_softmax=True), dp=2),  # the router's options
    config(dict(DEEPSEEK, moe_grouped_gemm=True, moe_permute_fusion=True, moe_shared_expert_overlap=True),
           pp=2),  # the experts' kernels and streams: grouped GEMM, fused permutation, shared-expert overlap
    config(dict(MIXTRAL, moe_token_dispatcher="flex"), tp=2, dp=4, sp=True),  # the flex dispatcher (DeepEP; etp ep > 1)
    config(dict(DEEPSEEK, qk_norm=True), pp=2),  # MLA without a query latent, shared experts, a dense layer first
    config(dict(DEEPSEEK, q_lora_rank=1536, mtp_layers=1), pp=2),  # MLA with a query latent, multi-token prediction
    config(LLAMA, dp=8, zero=2, fusions_off=FUSIONS),  # every fusion off; ZeRO 2 also turns gradient accumulation's off
    config(GPT, dp=8, fusions_off=FUSIONS),  # GeLU: --no-bias-gelu-fusion (the SwiGLU switch does nothing there)
    config(LLAMA, dp=8, cross_entropy_fusion="te"),  # the fused cross-entropy, Transformer Engine's kernel
    config(GPT, dp=8, memory_efficient_layer_norm=True),  # apex's memory-efficient LayerNorm
    config(LLAMA, tp=2, dp=4, zero=1, fp8="delayed", fp8_amax_history_len=16, fp8_param_gather=True),  # FP8
    config(LLAMA, dp=2, fp8="blockwise", loss_chunks=8),  # FP8 without history; chunked loss: a note, no flag
]


def flags(args):
    """{flag: value or None} of "--flag value" strings, checking each has at most one value."""
    out = {}
    for arg in args:
        words = arg.split()
        assert len(words) in (1, 2) and words[0].startswith("--"), arg
        assert words[0] not in out, f"{words[0]} given twice"
        out[words[0]] = words[1] if len(words) == 2 else None
    return out


@pytest.mark.parametrize("cfg", GRID, ids=range(len(GRID)))
def test_every_flag_is_megatron_lm_s_own(cfg):
    for flag, value in flags(megatron_args(cfg)).items():
        assert flag in MEGATRON_FLAGS, f"{flag} is not a Megatron-LM argument"
        kind = MEGATRON_FLAGS[flag]
        if kind is None:
            assert value is None, f"{flag} is a switch, given {value!r}"
        elif kind == "moe_freq":
            moe_freq(value)
        elif kind == "int_tuple":
            assert len(int_tuple(value)) == 2, value  # TransformerConfig.window_size: (left, right)
        elif isinstance(kind, tuple):
            assert value in kind, f"{flag} {value}: not one of {kind}"
        else:
            kind(value)  # int / float parse
    assert any(a.startswith("--fp8") for a in megatron_args(cfg)) == (cfg.training.fp8 is not None)


def test_fp8_flags_and_chunked_loss_note():
    plan = megatron_launch(GRID[-2])
    assert {"--fp8-format hybrid", "--fp8-recipe delayed", "--fp8-amax-history-len 16", "--fp8-param-gather"} <= set(
        plan.args)
    assert any("derived from Transformer Engine" in n for n in plan.notes)
    plan = megatron_launch(GRID[-1])
    assert "--fp8-recipe blockwise" in plan.args and not any("amax" in a for a in plan.args)
    assert not any("chunk" in a for a in plan.args)  # Megatron-LM has no chunked loss: no flag, a note
    assert any("--loss-chunks 8" in n and "no flag is given" in n for n in plan.notes)
    # --fp8-param-gather needs the distributed optimizer: not emitted with ZeRO 0, and said so
    plan = megatron_launch(config(LLAMA, dp=1, fp8="delayed", fp8_param_gather=True))
    assert "--fp8-param-gather" not in plan.args and any("--fp8-param-gather needs" in n for n in plan.notes)


def test_grid_covers_every_flag_memplan_emits():
    emitted = set().union(*(flags(megatron_args(c)) for c in GRID), flags(megatron_args(GRID[0], "megatron-local")))
    assert emitted == set(MEGATRON_FLAGS), set(MEGATRON_FLAGS) ^ emitted


@pytest.mark.parametrize("precision, expected", [("bf16-mixed", ["--bf16"]), ("16-mixed", ["--fp16"]),
                                                 ("32-true", []), ("bf16-true", [])])
def test_precision_flags(precision, expected):
    launch = megatron_launch(config(precision=precision))
    given = [a for a in launch.args if a in ("--bf16", "--fp16") or a.startswith(("--fp8", "--loss-scale"))]
    assert given == expected  # fp16: dynamic loss scaling is Megatron-LM's default (no --loss-scale)
    if precision == "bf16-true":
        assert len(launch.notes) == 1 and "no Megatron-LM equivalent" in launch.notes[0]
    else:
        assert launch.notes == []


def test_byte_sizes_overridden_in_yaml_get_a_note():
    launch = megatron_launch(config(precision="bf16-mixed", grad_bytes=2))
    assert "--bf16" in launch.args and any("overrides the byte sizes" in n for n in launch.notes)


@pytest.mark.parametrize("attention, backend", [("eager", "unfused"), ("flash", "flash")])
def test_attention_backend(attention, backend):
    assert f"--attention-backend {backend}" in megatron_args(config(attention=attention))


def test_parallel_flags():
    args = megatron_args(config(tp=2, pp=4, dp=2, vpp=3, sp=True, recompute="full", recompute_num_layers=1))
    # L / (p m) = 24 / 12 = 2 layers per chunk; 1 of them recomputed: the block method
    for flag in ("--tensor-model-parallel-size 2", "--pipeline-model-parallel-size 4", "--sequence-parallel",
                 "--num-layers-per-virtual-pipeline-stage 2", "--recompute-granularity full",
                 "--recompute-method block", "--recompute-num-layers 1", "--overlap-grad-reduce"):
        assert flag in args
    args = megatron_args(config(tp=2, pp=4, dp=2, vpp=3, recompute="full"))
    assert "--recompute-method uniform" in args and "--recompute-num-layers 1" in args
    args = megatron_args(config(dp=8, zero=1, zero_shard=2))
    assert {"--use-distributed-optimizer", "--num-distributed-optimizer-instances 4",
            "--overlap-param-gather"} <= set(args) and "--use-megatron-fsdp" not in args
    args = megatron_args(config(dp=8, zero=2))
    assert "--data-parallel-sharding-strategy optim_grads" in args and "--ckpt-format fsdp_dtensor" in args


def test_head_dim_is_kv_channels():
    assert "--kv-channels 128" in megatron_args(config(dict(GPT, hidden_size=2560, num_attention_heads=16),
                                                       head_dim=128))
    assert not any(a.startswith("--kv-channels") for a in megatron_args(config(head_dim=128)))  # 16 x 128 = h


@pytest.mark.parametrize("kw, env", [
    (dict(tp=2, dp=4), {CONNECTIONS: "1"}),  # TP: Megatron-LM asserts 1 before Blackwell
    (dict(tp=2, dp=4, zero=1), {CONNECTIONS: "1"}),
    (dict(dp=8), {}),
    (dict(dp=8, zero=3), {CONNECTIONS: None}),  # Megatron-FSDP asserts it is not 1: unset
    (dict(tp=2, dp=4, zero=2), {CONNECTIONS: None}),
])
def test_environment(kw, env):
    launch = megatron_launch(config(**kw))
    assert launch.env == env
    lines = launch.block().splitlines()
    expected = [f"export {CONNECTIONS}=1"] if env.get(CONNECTIONS) == "1" else \
        [f"unset {CONNECTIONS}"] if env else []
    assert lines[:len(expected)] == expected and lines[len(expected)].startswith("--num-layers")
    assert any("tensor-parallel" in n for n in launch.notes) == (kw.get("tp", 1) > 1 and kw.get("zero", 0) >= 2)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("cfg", [GRID[0], GRID[1], GRID[5]], ids=["no-env", "export", "unset"])
def test_block_is_what_a_shell_runs(cfg):
    # the block pasted after a command gives that command exactly the arguments, one word each
    launch = megatron_launch(cfg)
    script = launch.script("title").replace(launch.args_block(), "printf '%s\\n' " + launch.args_block())
    script += f"\necho \"{CONNECTIONS}=${{{CONNECTIONS}-unset}}\""
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True,
                         env={CONNECTIONS: "8"}).stdout.splitlines()
    assert out[:-1] == [w for a in launch.args for w in shlex.split(a)]
    assert out[-1] == f"{CONNECTIONS}={launch.env.get(CONNECTIONS) or ('8' if not launch.env else 'unset')}"


SEARCH = ("search", "--model", "gpt-22b", "--gpus", "8", "--mem", "80GB", "--emit", "megatron")


def test_emit_only_prints_exactly_the_block(run_cli):
    code, out, err = run_cli(*SEARCH, "--emit-only", "--zero", "1")
    assert code == 0 and err == ""
    code, doc, _ = run_cli(*SEARCH, "--zero", "1", "--json")
    launch = json.loads(doc)["launch"]
    lines = out.splitlines()
    assert lines[0] == f"export {CONNECTIONS}=1" and launch["env"] == {CONNECTIONS: "1"}
    assert [line.removesuffix(" \\") for line in lines[1:]] == launch["megatron"]
    assert all(line.endswith(" \\") for line in lines[1:-1]) and not lines[-1].endswith("\\")


def test_emit_only_notes_go_to_stderr(run_cli):
    code, out, err = run_cli(*SEARCH, "--emit-only", "--precision", "bf16-true", "--zero", "0")
    assert code == 0 and "--bf16" not in out and "note" not in out
    assert err.startswith("memplan: note: bf16-true") and "no Megatron-LM equivalent" in err


def test_emit_only_without_a_fitting_plan_exits_1(run_cli):
    code, out, err = run_cli("search", "--model", "gpt3-530b", "--gpus", "8", "--mem", "80GB", "--emit", "megatron",
                             "--emit-only")
    assert code == 1 and out == "" and err.strip() == "memplan: no plan fits: nothing to launch"


def test_json_stays_one_valid_document(run_cli):
    code, out, _ = run_cli(*SEARCH, "--json")
    data = json.loads(out)
    launch = data["launch"]
    assert set(launch) == {"megatron", "env", "notes"} and isinstance(launch["megatron"], list)
    assert launch["env"] == {CONNECTIONS: None} or launch["env"] == {CONNECTIONS: "1"} or launch["env"] == {}
    assert f"--tensor-model-parallel-size {data['plans'][0]['tp']}" in launch["megatron"]
    # every preset: a JSON list, each model with its launch
    code, out, _ = run_cli("search", "--gpus", "64", "--mem", "80GB", "--emit", "megatron", "--json")
    rows = json.loads(out)
    assert isinstance(rows, list) and all("launch" in r for r in rows if r["plans"] and "gemma" not in r["model"])
    # the GeLU-gated Gemma models: no Megatron-LM argument builds them, a note says so instead of a launch
    gemma = [r for r in rows if r["model"].startswith("gemma")]
    assert gemma and all("launch" not in r and any("GeLU-gated" in n for n in r["notes"]) for r in gemma)


def test_table_and_markdown_end_with_the_block(run_cli):
    code, out, _ = run_cli(*SEARCH, "--zero", "0", "--top", "1")
    tail = out.splitlines()
    start = tail.index("# gpt-22b: best plan as Megatron-LM arguments")
    assert tail[start + 1] == f"export {CONNECTIONS}=1" and tail[-1] == "--bf16"
    code, out, _ = run_cli(*SEARCH, "--zero", "0", "--top", "1", "--format", "markdown")
    assert out.rstrip().endswith("--bf16\n```") and "```bash\n# gpt-22b: best plan" in out


def assert_one_line_error(code, err, fragment):
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memplan: error:") and fragment in lines[0], err


@pytest.mark.parametrize("extra, fragment", [
    (["--emit-only"], "--emit-only needs --emit megatron"),
    (["--emit", "megatron", "--emit-only", "--json"], "conflicts with --format json"),
    (["--emit", "megatron", "--emit-only", "--format", "markdown"], "conflicts with --format markdown"),
    (["--emit", "megatron", "--format", "csv"], "--emit megatron cannot follow CSV"),
    (["--emit", "megatron", "--impl", "hf-eager"], "plan it with --impl megatron or megatron-local"),
])
def test_bad_combinations(run_cli, extra, fragment):
    code, out, err = run_cli("search", "--model", "gpt-22b", "--gpus", "8", "--mem", "80GB", *extra)
    assert_one_line_error(code, err, fragment)
    assert out == ""


def test_emit_only_needs_one_model(run_cli):
    code, out, err = run_cli("search", "--gpus", "8", "--mem", "80GB", "--emit", "megatron", "--emit-only")
    assert_one_line_error(code, err, "--emit-only prints one launch block: give --model")


def test_uneven_stages_flags():
    """Llama 3.1 405B's published layout (7 / 8 x 14 / 7) as Megatron-LM's uneven-stage flags; with interleaving
    Megatron-LM asks for --num-virtual-stages-per-pipeline-rank instead of layers per virtual stage."""
    from memplan.presets.batch import make_config
    from memplan.presets.catalog import load_model

    got = flags(megatron_args(make_config(load_model("llama3.1-405b"))))
    assert (got["--pipeline-model-parallel-size"], got["--decoder-first-pipeline-num-layers"],
            got["--decoder-last-pipeline-num-layers"]) == ("16", "7", "7")
    assert "--num-layers-per-virtual-pipeline-stage" not in got
    got = flags(megatron_args(config(pp=4, dp=2, vpp=2, first_stage_layers=4, last_stage_layers=4, global_batch=16)))
    assert got["--num-virtual-stages-per-pipeline-rank"] == "2" and "--num-layers-per-virtual-pipeline-stage" not in got
    assert "--decoder-first-pipeline-num-layers" not in flags(megatron_args(config(pp=4, dp=2, global_batch=16)))


def test_experts_and_latent_attention_flags():
    """DeepSeek-V3 (configs/traced/deepseek-v3/config.json): 256 experts of 2048, top 8, one shared expert of 2048,
    3 dense layers then 58 MoE ones, MLA with r_q 1536, r_kv 512, heads of 128 + 64 (rotated) and values of 128."""
    from memplan.presets.catalog import load_model

    model = load_model("deepseek-v3").model
    got = flags(megatron_args(Config(model=model, parallel=ParallelSpec(pp=1), training=TrainingSpec())))
    assert {k: got[k] for k in ("--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size",
                                "--moe-shared-expert-intermediate-size", "--q-lora-rank", "--kv-lora-rank",
                                "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim")} == {
        "--num-experts": "256", "--moe-router-topk": "8", "--moe-ffn-hidden-size": "2048",
        "--moe-shared-expert-intermediate-size": "2048", "--q-lora-rank": "1536", "--kv-lora-rank": "512",
        "--qk-head-dim": "128", "--qk-pos-emb-head-dim": "64", "--v-head-dim": "128"}
    assert moe_freq(got["--moe-layer-freq"]) == [0] * 3 + [1] * 58
    assert "--multi-latent-attention" in got and "--kv-channels" not in got
    # the latent norms (memplan/inventory/mla.py) and the config.json's num_nextn_predict_layers = 1
    assert "--qk-layernorm" in got and got["--mtp-num-layers"] == "1"
    assert not {"--num-experts", "--multi-latent-attention", "--moe-layer-freq"} & set(flags(megatron_args(config())))


def test_kernels_flags():
    # --transformer-impl local for megatron-core's local spec; each fusion switched off by its own flag, once
    args = megatron_args(config(LLAMA, dp=8, zero=2, fusions_off=FUSIONS), "megatron-local")
    assert "--transformer-impl local" in args
    # (bias_activation_fusion is bias_swiglu_fusion with --swiglu, else bias_gelu_fusion: the other switch is idle)
    assert [a for a in args if a.endswith("-fusion")] == [f"--no-{name}-fusion" for name in FUSIONS if name != "bias-gelu"]
    gelu = megatron_args(config(GPT, dp=8, fusions_off=FUSIONS), "megatron-local")
    assert [a for a in gelu if a.endswith("-fusion")] == [f"--no-{name}-fusion" for name in FUSIONS
                                                           if name != "bias-swiglu"]
    # Megatron-LM's defaults: Transformer Engine, every fusion on: no flag
    assert not [a for a in megatron_args(config(LLAMA, dp=8)) if a.endswith("-fusion") or "transformer-impl" in a]
