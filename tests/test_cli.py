"""Every command through the real entry point: output, JSON shape, and one-line errors (exit 2)."""

import json
import re
import subprocess
import sys

import pytest

from memplan.cli import cli


def assert_one_line_error(code, err, *fragments):
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("memplan: error:")
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_every_command_has_help(run_cli):
    for name in cli.commands:
        code, out, _ = run_cli(name, "--help")
        assert code == 0 and "Usage" in out and len(out) > 100


def test_models_lists_presets(run_cli):
    code, out, _ = run_cli("models", "--json")
    names = {row["name"] for row in json.loads(out)}
    assert {"gpt-22b", "gpt3-175b", "gpt3-530b", "gpt-1t"} <= names


def test_estimate_table(run_cli):
    code, out, _ = run_cli("estimate", "--model", "gpt3-530b")
    assert code == 0
    for text in ("GeLU input", "8sbh/t", "2sbh/t", "stage 0", "fits", "GB"):
        assert text in out


def test_estimate_json_fields(run_cli):
    code, out, _ = run_cli("estimate", "--model", "gpt3-530b", "--vpp", "1", "--mem", "80GB", "--json")
    data = json.loads(out)
    mem = data["memory"]
    assert mem["total_bytes"] == sum(mem[k] for k in ("weights_bytes", "gradients_bytes", "optimizer_bytes",
                                                       "activations_bytes"))
    # K22 Eq. 6 per layer, 34sbh/t = 34 * 2048 * 20480 / 8, plus what K22 ignores: two layer norms
    # each keep an fp32 mean and rstd per token (2 * 4 bytes * sb), split by t under SP: 16sb/t.
    assert data["activations"]["per_layer_bytes"] == 34 * 2048 * 20480 // 8 + 16 * 2048 // 8
    terms = data["activations"]["terms"]
    assert all({"name", "symbolic", "bytes"} <= set(t) for t in terms)
    assert len(data["stages"]) == 35
    assert data["budget_bytes"] == 80 * 10**9
    assert data["fits"] is (mem["device_bytes"] <= 80 * 10**9)
    # a GPU (the preset's A100) and a global batch are known, so the step time is estimated
    assert data["perf"]["step_time_s"] > 0 and 0 < data["perf"]["mfu"] < 1


def test_paper_only_view(run_cli):
    _, out, _ = run_cli("estimate", "--model", "gpt3-530b", "--paper-only", "--json")
    data = json.loads(out)
    assert data["activations"]["per_layer_bytes"] == 34 * 2048 * 20480 // 8  # K22 Eq. 6
    assert data["activations"]["per_layer_symbolic"] == "34sbh/t"
    assert all(t["in_k22"] for t in data["activations"]["terms"])


def test_mem_units_gb_and_gib(run_cli):
    _, out_gb, _ = run_cli("estimate", "--model", "gpt-22b", "--mem", "80GB", "--json")
    _, out_gib, _ = run_cli("estimate", "--model", "gpt-22b", "--mem", "80GiB", "--json")
    assert json.loads(out_gb)["budget_bytes"] == 80_000_000_000
    assert json.loads(out_gib)["budget_bytes"] == 80 * 2**30


def test_overflow_is_reported(run_cli):
    code, out, _ = run_cli("estimate", "--model", "gpt3-530b", "--tp", "1", "--pp", "1", "--recompute", "none",
                           "--mem", "80GB")
    assert code == 0 and "does not fit" in out and "over by" in out


def test_budget_below_the_runtime_says_so(run_cli):
    # 1 GB is less than what lives outside PyTorch's pool (the preset's runtime: CUDA context, kernels, NCCL), so the
    # allocator may take nothing: said in words, never as a negative size
    code, out, _ = run_cli("estimate", "--model", "llama3-8b", "--gpus", "8", "--mem", "1GB")
    assert code == 0 and "does not fit" in out
    assert "0 GB it may take (the budget is" in out and "short of what lives outside" in out
    assert not re.search(r"-\d[\d.,]* GB", out)


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--model", "gpt-99b"], ["unknown model preset 'gpt-99b'", "gpt3-530b", "gpt-22b"]),
        (["--model", "gpt3-530b", "--tp", "3"], ["t=3", "a=128"]),
        (["--model", "gpt3-530b", "--gpus", "1000"], ["1000", "t*p"]),
        (["--model", "gpt3-530b", "--mem", "80"], ["80", "unit"]),
        (["--model", "gpt3-530b", "--mem", "80XB"], ["unknown unit"]),
        (["--model", "gpt3-530b", "--tp", "1", "--sp"], ["sequence parallelism"]),
        (["--model", "gpt3-530b", "--pp", "4"], ["L=105", "p*m"]),
        (["--model", "gpt3-530b", "--micro-batch", "3"], ["global batch 280", "3"]),
        (["--model", "gpt3-530b", "--gpus", "0"], ["GPU count"]),
        (["--model", "gpt3-530b", "--vpp", "2", "--pp", "1"], ["interleaved"]),
        # --recompute-num-layers alone is full recompute (as search pins it): 2 of the 1 layer of a 530B chunk
        # (L / (p m) = 105 / (35 * 3))
        (["--model", "gpt3-530b", "--recompute-num-layers", "2"], ["exceeds the 1 layers of a model chunk"]),
        (["--model", "gpt3-530b", "--gpu", "tpu9"], ["unknown GPU preset", "a100-80gb"]),
        (["--model", "gpt3-530b", "--tp", "abc"], ["--tp"]),
        (["--model", "gpt3-530b", "--zero", "1", "--distributed-optimizer", "--zero", "2"], ["conflicts"]),
        ([], ["--model is required"]),
        (["--model", "llama3-8b", "--tp", "16", "--pp", "1", "--dp", "1"], ["t=16", "key/value heads 8"]),
        (["--model", "gpt3-530b", "--gpus", "2240", "--zero", "1", "--zero-shard", "3"], ["zero_shard=3", "d=8"]),
        (["--model", "gpt3-530b", "--gpus", "2240", "--zero-shard", "2"], ["needs ZeRO"]),
    ],
)
def test_bad_input_one_line_exit_2(run_cli, args, fragments):
    code, _, err = run_cli("estimate", *args)
    assert_one_line_error(code, err, *fragments)


def write(tmp_path, text, name="m.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


GOOD = """model:
  name: tiny
  num_layers: 4
  hidden_size: 256
  num_attention_heads: 8
  seq_length: 512
  vocab_size: 1000
"""


def test_yaml_model_file(run_cli, tmp_path):
    code, out, _ = run_cli("estimate", "--model", write(tmp_path, GOOD), "--json")
    assert code == 0 and json.loads(out)["config"]["model"]["name"] == "tiny"


@pytest.mark.parametrize(
    "text, fragments",
    [
        (GOOD.replace("hidden_size", "hiden_size"), ["unknown field", "hiden_size", "m.yaml"]),
        (GOOD + "parallel: {tp: 2, pipeline: 2}\n", ["unknown field", "pipeline", "m.yaml"]),
        (GOOD + "optimiser: adam\n", ["unknown field", "optimiser", "m.yaml"]),
        (GOOD.replace("num_layers: 4", "num_layers: four"), ["num_layers", "m.yaml"]),
        (GOOD.replace("hidden_size: 256", "hidden_size: 250"), ["h=250", "a=8", "m.yaml"]),
        (GOOD + "training: {recompute: sometimes}\n", ["recompute", "m.yaml"]),
        ("model: [1, 2\n", ["not valid YAML", "m.yaml"]),
    ],
)
def test_bad_yaml_one_line_exit_2(run_cli, tmp_path, text, fragments):
    code, _, err = run_cli("estimate", "--model", write(tmp_path, text))
    assert_one_line_error(code, err, *fragments)


def test_estimate_never_imports_torch():
    code = (
        "import sys\n"
        "from memplan.cli import main\n"
        "try:\n"
        "    main(['estimate', '--model', 'gpt3-530b', '--json'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('no torch')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "no torch" in result.stdout


def test_emit_megatron_inside_json(run_cli):
    # --emit with --json: one valid JSON document whose best plan carries its launch arguments
    code, out, _ = run_cli("search", "--model", "gpt-22b", "--gpus", "8", "--mem", "80GB", "--emit", "megatron",
                           "--json")
    data = json.loads(out)
    best = data["plans"][0]
    args = data["launch"]["megatron"]
    assert f"--tensor-model-parallel-size {best['tp']}" in args and "--num-layers 48" in args
    code, out, err = run_cli("search", "--model", "gpt-22b", "--gpus", "8", "--mem", "80GB", "--emit", "megatron",
                             "--format", "csv")
    assert_one_line_error(code, err, "--emit megatron cannot follow CSV")


def test_one_plan_schema_in_search_and_estimate(run_cli):
    # the best plan of a search, estimated on its own, has the same plan fields (effective values:
    # the ZeRO shard group and the recomputed layers per chunk are numbers in both)
    code, out, _ = run_cli("search", "--model", "gpt-22b", "--gpus", "16", "--mem", "80GB", "--json", "--top", "1")
    row = json.loads(out)["plans"][0]
    args = ["estimate", "--model", "gpt-22b", "--gpus", "16", "--tp", str(row["tp"]), "--pp", str(row["pp"]),
            "--vpp", str(row["vpp"]), "--micro-batch", str(row["micro_batch"]), "--recompute", row["recompute"],
            "--zero", str(row["zero"]), "--sp" if row["sp"] else "--no-sp", "--json"]
    if row["recompute"] == "full":
        args += ["--recompute-num-layers", str(row["recompute_num_layers"])]
    if row["zero"] and row["zero_shard"] < row["dp"]:
        args += ["--zero-shard", str(row["zero_shard"])]
    plan = json.loads(run_cli(*args)[1])["plan"]
    assert plan == {k: row[k] for k in plan}


def test_source_citations_are_not_cut_at_a_comma():
    from memplan.report.tables import _cite

    # the flash terms' source lists what the kernel saves after the work it cites
    assert _cite("FlashAttention-2 (Dao 2023) forward saves q, k, v, out, softmax_lse") == "FlashAttention-2 (Dao 2023)"
    assert _cite("K22 section 4.1: QKV input 2sbh") == "K22 4.1"
    assert _cite("transformers 5.23.0, measured (validation/hf.py): x") == "transformers 5.23.0"
