"""`search --emit megatron`: Megatron-LM's real flags, precision and attention backend, the environment,
the paste-ready --emit-only block, the JSON document and the refused combinations."""

import json
import shlex
import shutil
import subprocess

import pytest

from memplan.launch import CONNECTIONS, megatron_args, megatron_launch
from memplan.specs import Config, ModelSpec, ParallelSpec, TrainingSpec

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
    "--ckpt-format": ("torch", "torch_dist", "torch_dcp", "fsdp_dtensor"),
    "--overlap-grad-reduce": None,
    "--overlap-param-gather": None,
    "--optimizer": ("adam", "sgd", "muon", "dist_muon"),
    "--sgd-momentum": float,
    # optimizer and activation offload (memplan/launch.py _offload): arguments.py:2059-2062 and 2840 at core_v0.16.1;
    # --cpu-offloading-num-layers is TransformerConfig's cpu_offloading_num_layers (ModelParallelConfig, an int),
    # made a flag by ArgumentGroupFactory (arguments.py:1621; megatron/training/argument_utils.py:71-82)
    "--use-precision-aware-optimizer": None,
    "--optimizer-cpu-offload": None,
    "--optimizer-offload-fraction": float,
    "--cpu-offloading-num-layers": int,
    "--bf16": None,
    "--fp16": None,
    # FP8 (memplan/fp8.py launch_args), read on main at d98e8a6 only: TransformerConfig's fp8 (arg_names
    # --fp8-format), fp8_recipe, fp8_amax_history_len (megatron/core/transformer/transformer_config.py), made flags by
    # ArgumentGroupFactory; --fp8-param-gather is arguments.py's own (store_true)
    "--fp8-format": ("e4m3", "hybrid"),
    "--fp8-recipe": ("tensorwise", "delayed", "mxfp8", "blockwise", "custom"),
    "--fp8-amax-history-len": int,
    "--fp8-param-gather": None,
}

GPT = dict(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048, vocab_size=51200)
LLAMA = dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_kv_heads=8, ffn_hidden_size=14336,
             seq_length=8192, vocab_size=128256, norm="rmsnorm", mlp="swiglu", position_embedding="rope",
             tied_embeddings=False, dropout=False, bias=False, attention="flash")


def config(model=GPT, **kw):
    parallel = {k: kw.pop(k) for k in ("tp", "pp", "dp", "vpp", "sp", "zero", "zero_shard") if k in kw}
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
    config(tp=2, sp=True, offload_activations=True),  # activation offload: layer offloading, p = 1
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
    emitted = set().union(*(flags(megatron_args(c)) for c in GRID))
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
    assert isinstance(rows, list) and all("launch" in r for r in rows if r["plans"])


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
    (["--emit", "megatron", "--impl", "hf-eager"], "plan it with --impl megatron"),
])
def test_bad_combinations(run_cli, extra, fragment):
    code, out, err = run_cli("search", "--model", "gpt-22b", "--gpus", "8", "--mem", "80GB", *extra)
    assert_one_line_error(code, err, fragment)
    assert out == ""


def test_emit_only_needs_one_model(run_cli):
    code, out, err = run_cli("search", "--gpus", "8", "--mem", "80GB", "--emit", "megatron", "--emit-only")
    assert_one_line_error(code, err, "--emit-only prints one launch block: give --model")
