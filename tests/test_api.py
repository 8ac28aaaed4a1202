"""The Python API (memplan/api/, docs/api.md): the documentation's examples run, a result's .to_dict() is the
document the command prints with --json, `import memplan` loads nothing heavy, and each command imports only what
it uses."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import memplan
from memplan.cli import cli

DOC = Path(__file__).resolve().parent.parent / "docs" / "api.md"
SECONDS = re.compile(r'"seconds": [0-9.e+-]+')


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def test_the_documentation_examples_run(capsys):
    blocks = python_blocks(DOC.read_text())
    assert len(blocks) >= 5
    namespace: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{DOC.name} block {i + 1}", "exec"), namespace)
    assert "refused: unknown model preset 'nope'" in capsys.readouterr().out


def _cli_json(args: list[str]) -> str:
    result = CliRunner().invoke(cli, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return result.output


def _same_document(api_doc, cli_text: str) -> None:
    """The API's dict printed as the command prints it (print_json) is the command's output, timings aside."""
    assert SECONDS.sub('"seconds": X', json.dumps(api_doc, indent=2) + "\n") == SECONDS.sub('"seconds": X', cli_text)


@pytest.mark.parametrize("args, kwargs", [
    (["--model", "gpt3-530b"], dict(model="gpt3-530b")),
    (["--model", "llama3-8b", "--gpus", "8", "--tp", "1", "--pp", "1", "--zero", "1", "--recompute", "none",
      "--global-batch", "8", "--offload", "optimizer"],
     dict(model="llama3-8b", gpus=8, tp=1, pp=1, zero=1, recompute="none", global_batch=8, offload=("optimizer",))),
    (["--model", "llama3-8b", "--impl", "hf-sdpa", "--precision", "bf16-true", "--gpus", "1", "--global-batch", "1",
      "--max-seq", "--mem", "80GiB"],
     dict(model="llama3-8b", impl="hf-sdpa", precision="bf16-true", gpus=1, global_batch=1, max_seq=True,
          mem="80GiB")),
    (["--model", "mixtral-8x7b", "--gpus", "64", "--tp", "2", "--sp", "--ep", "8", "--recompute", "selective",
      "--zero", "1", "--mem", "80GB", "--max-micro-batch"],
     dict(model="mixtral-8x7b", gpus=64, tp=2, sp=True, ep=8, recompute="selective", zero=1, mem=80 * 10**9,
          max_micro_batch=True)),
    (["--model", "llama3-8b", "--gpus", "8", "--fp8", "delayed", "--gpu", "h100-80gb", "--global-batch-tokens", "4M"],
     dict(model="llama3-8b", gpus=8, fp8="delayed", gpu="h100-80gb", global_batch_tokens="4M")),
])
def test_estimate_to_dict_is_the_json_document(args, kwargs):
    _same_document(memplan.estimate(**kwargs).to_dict(), _cli_json(["estimate", *args]))


@pytest.mark.parametrize("args, kwargs", [
    (["--model", "gpt3-530b", "--gpus", "2240", "--mem", "80GB", "--top", "5"],
     dict(model="gpt3-530b", gpus=2240, mem="80GB", top=5)),
    (["--model", "llama3-8b", "--gpus", "32", "--mem", "80GB", "--seq-len", "32768", "--global-batch", "64",
      "--top", "3", "--sort", "memory", "--emit", "megatron"],
     dict(model="llama3-8b", gpus=32, mem="80GB", seq_len=32768, global_batch=64, top=3, sort="memory",
          emit="megatron")),
])
def test_search_to_dict_is_the_json_document(args, kwargs):
    _same_document(memplan.search(**kwargs).to_dict(), _cli_json(["search", *args]))


def test_bad_input_is_a_memplan_error():
    with pytest.raises(memplan.MemplanError, match="must be positive"):
        memplan.estimate(model="llama3-8b", mem=0)
    with pytest.raises(memplan.MemplanError, match="--gpus is required for search"):
        memplan.search(model="llama3-8b")
    with pytest.raises(TypeError):
        memplan.estimate(model="llama3-8b", no_such_option=1)
    # before: a str or negative first_step_seq_len reached the allocation stream (TypeError deep in the sizes;
    # -5 tokens replayed); a str count reached pydantic under another name
    for kw, what in ((dict(first_step_seq_len="1024"), "first_step_seq_len: an integer, not str"),
                     (dict(first_step_seq_len=-5), "at least 1 token"), (dict(micro_batch=True), "not bool")):
        with pytest.raises(memplan.MemplanError, match=what):
            memplan.estimate(model="llama3-8b", impl="hf-sdpa", gpus=1, global_batch=1, gpu="h100-80gb", **kw)


def _loaded(code: str) -> set[str]:
    """The modules a fresh interpreter has loaded after `code` (memplan's, and numpy, pydantic, rich)."""
    script = code + "\nimport sys\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent).stdout.split("\n")[-2]
    return {m for m in out.split() if m.split(".")[0] in ("memplan", "numpy", "pydantic", "rich")}


def test_import_memplan_loads_nothing_heavy():
    assert _loaded("import memplan") == {"memplan"}


def _command(args: str) -> str:
    return (f"import sys\nsys.argv = ['memplan', *{args.split()!r}]\nfrom memplan.cli import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass")


@pytest.mark.slow
def test_each_command_imports_only_what_it_uses():
    assert _loaded(_command("--help")) == {"memplan", "memplan.cli", "memplan.cli.options"}
    estimate = _loaded(_command("estimate --model gpt3-530b --json"))
    assert "memplan.plan.search" not in estimate and "memplan.api.searching" not in estimate
    search = _loaded(_command("search --model gpt3-530b --gpus 2240 --mem 80GB --json"))
    assert "memplan.plan.search" in search and "numpy" in search
